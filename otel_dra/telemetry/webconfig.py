"""``--web-config-file``: TLS, basic auth and response headers for the metrics server, in the format
of the Prometheus exporter-toolkit (https://github.com/prometheus/exporter-toolkit, "web
configuration"), so that a file written for node_exporter & co. works here.

:func:`load_web_config` reads and checks the whole file up front (every certificate and key is
loaded once, every bcrypt hash parsed) and raises :class:`WebConfigError` naming the field at fault.
The served certificate, its key and the client CA are then re-read by :class:`TLSContexts` whenever
one of those files changes, so a rotated certificate (a cert-manager renewal, a Secret update) is
served from the next connection on without a restart. The file itself is read once, at start-up.

What Python's ``ssl`` module cannot do is refused rather than silently approximated: asking for a
client certificate without verifying it (``RequestClientCert``, ``RequireAnyClientCert``), curve
preferences, inline certificates, per-SAN client filtering.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import ssl
import threading
import warnings
from collections.abc import Mapping
from dataclasses import field
from pathlib import Path
from typing import Any

from otel_dra.records import record

log = logging.getLogger(__name__)


class WebConfigError(ValueError):
    """An invalid web config file; the message names the file and the field."""


# client_auth_type -> (verify mode, needs client_ca_file). Go's RequestClientCert and
# RequireAnyClientCert accept a client certificate without verifying it; OpenSSL through Python's
# ssl module verifies every certificate it asks for, so those two cannot be honoured.
CLIENT_AUTH_TYPES: Mapping[str, ssl.VerifyMode | None] = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": None,
    "RequireAnyClientCert": None,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}

TLS_VERSIONS: Mapping[str, ssl.TLSVersion] = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}

# Go's crypto/tls names (tls.CipherSuites(), the ones exporter-toolkit accepts) -> OpenSSL's. The TLS
# 1.3 suites are accepted and, as in Go, have no effect: TLS 1.3 suites are not configurable.
CIPHER_SUITES: Mapping[str, str | None] = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_AES_128_GCM_SHA256": None,
    "TLS_AES_256_GCM_SHA384": None,
    "TLS_CHACHA20_POLY1305_SHA256": None,
}

# The headers exporter-toolkit lets http_server_config.headers set, with the values it accepts
# (None: any string).
EXTRA_HEADERS: Mapping[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}

_TLS_FIELDS = {
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "min_version",
    "max_version",
    "cipher_suites",
    "prefer_server_cipher_suites",
}
# exporter-toolkit fields this server does not implement: named in the error instead of "unknown".
_TLS_UNSUPPORTED = {
    "cert": "inline certificates are not supported: use cert_file",
    "key": "inline keys are not supported: use key_file",
    "client_ca": "an inline client CA is not supported: use client_ca_file",
    "curve_preferences": "not supported (Python's ssl module cannot set a curve preference list)",
    "client_allowed_sans": "not supported",
}
_TOP_FIELDS = {"tls_server_config", "http_server_config", "basic_auth_users"}
_TOP_UNSUPPORTED = {
    "auth_excluded_paths": "not supported: only /metrics is authenticated (/healthz, /readyz and / never are)",
    "rate_limit": "not supported",
}
_HTTP_FIELDS = {"http2", "headers"}


@record(frozen=True)
class TLSSettings:
    cert_file: Path
    key_file: Path
    client_auth: ssl.VerifyMode = ssl.CERT_NONE
    client_ca_file: Path | None = None
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3
    ciphers: str | None = None  # an OpenSSL cipher list for TLS <= 1.2; None: OpenSSL's defaults
    prefer_server_ciphers: bool = True

    @property
    def files(self) -> tuple[Path, ...]:
        return (self.cert_file, self.key_file, *((self.client_ca_file,) if self.client_ca_file else ()))

    def context(self) -> ssl.SSLContext:
        """A server context from the files as they are now; raises OSError / ssl.SSLError."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with warnings.catch_warnings():  # TLS10/TLS11 are deprecated; the file asked for them
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx.minimum_version = self.min_version
            ctx.maximum_version = self.max_version
        if self.ciphers is not None:
            ctx.set_ciphers(self.ciphers)
        if self.prefer_server_ciphers:
            ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        else:
            ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
        ctx.load_cert_chain(str(self.cert_file), str(self.key_file))
        ctx.verify_mode = self.client_auth
        if self.client_ca_file is not None:
            ctx.load_verify_locations(cafile=str(self.client_ca_file))
        return ctx


@record(frozen=True)
class WebConfig:
    """A parsed web config file: each part None / empty when the file leaves it out."""

    path: Path
    tls: TLSSettings | None = None
    basic_auth_users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Mapping[str, str] = field(default_factory=dict)


def load_web_config(path: str | Path) -> WebConfig:
    """Read and check ``path``; raises :class:`WebConfigError` with the file and the field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise WebConfigError(f"web config file {path}: cannot read it: {exc.strerror or exc}") from None
    import yaml  # only with --web-config-file: the plugin starts without it (docs/benchmarks.md)

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise WebConfigError(f"web config file {path}: not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    where = f"web config file {path}"
    top = _mapping(raw, where, "the file")
    _check_fields(top, _TOP_FIELDS, _TOP_UNSUPPORTED, where, "")
    base = path.parent
    tls = _tls(top.get("tls_server_config"), base, where)
    users = _users(top.get("basic_auth_users"), where)
    headers = _http(top.get("http_server_config"), where)
    return WebConfig(path=path, tls=tls, basic_auth_users=users, headers=headers)


def _mapping(value: Any, where: str, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: {name} must be a mapping, not {type(value).__name__}")
    for key in value:
        if not isinstance(key, str):
            raise WebConfigError(f"{where}: {name}: key {key!r} is not a string")
    return value


def _check_fields(
    section: Mapping[str, Any], known: set[str], unsupported: Mapping[str, str], where: str, prefix: str
) -> None:
    for key in section:
        if key in unsupported:
            raise WebConfigError(f"{where}: {prefix}{key}: {unsupported[key]}")
        if key not in known:
            raise WebConfigError(f"{where}: {prefix}{key}: unknown field (known: {', '.join(sorted(known))})")


def _string(section: Mapping[str, Any], key: str, where: str, prefix: str) -> str | None:
    value = section.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise WebConfigError(f"{where}: {prefix}{key}: must be a string, not {type(value).__name__}")
    return value


def _tls(raw: Any, base: Path, where: str) -> TLSSettings | None:
    if raw is None:
        return None
    prefix = "tls_server_config."
    section = _mapping(raw, where, "tls_server_config")
    _check_fields(section, _TLS_FIELDS, _TLS_UNSUPPORTED, where, prefix)
    if not any(section.get(k) for k in ("cert_file", "key_file", "client_auth_type", "client_ca_file")):
        return None  # as exporter-toolkit: an empty TLS section means plain HTTP

    def file(key: str) -> Path | None:
        value = _string(section, key, where, prefix)
        if value is None:
            return None
        resolved = (base / value).expanduser() if not os.path.isabs(value) else Path(value)
        try:
            resolved.read_bytes()
        except OSError as exc:
            raise WebConfigError(f"{where}: {prefix}{key}: cannot read {resolved}: {exc.strerror or exc}") from None
        return resolved

    cert_file, key_file = file("cert_file"), file("key_file")
    if cert_file is None:
        raise WebConfigError(f"{where}: {prefix}cert_file: missing (TLS needs cert_file and key_file)")
    if key_file is None:
        raise WebConfigError(f"{where}: {prefix}key_file: missing (TLS needs cert_file and key_file)")
    client_ca_file = file("client_ca_file")

    auth_name = _string(section, "client_auth_type", where, prefix) or "NoClientCert"
    if auth_name not in CLIENT_AUTH_TYPES:
        raise WebConfigError(
            f"{where}: {prefix}client_auth_type: {auth_name!r} is not one of {', '.join(CLIENT_AUTH_TYPES)}"
        )
    client_auth = CLIENT_AUTH_TYPES[auth_name]
    if client_auth is None:
        raise WebConfigError(
            f"{where}: {prefix}client_auth_type: {auth_name} (a client certificate accepted without being "
            "verified) is not supported; use VerifyClientCertIfGiven or RequireAndVerifyClientCert with "
            "client_ca_file"
        )
    if client_auth != ssl.CERT_NONE and client_ca_file is None:
        raise WebConfigError(f"{where}: {prefix}client_ca_file: client_auth_type {auth_name} needs a client CA")
    if client_auth == ssl.CERT_NONE and client_ca_file is not None:
        raise WebConfigError(
            f"{where}: {prefix}client_auth_type: client_ca_file is set but client_auth_type is NoClientCert "
            "(set VerifyClientCertIfGiven or RequireAndVerifyClientCert)"
        )

    def version(key: str, default: ssl.TLSVersion) -> ssl.TLSVersion:
        name = _string(section, key, where, prefix)
        if name is None:
            return default
        if name not in TLS_VERSIONS:
            raise WebConfigError(f"{where}: {prefix}{key}: {name!r} is not one of {', '.join(TLS_VERSIONS)}")
        return TLS_VERSIONS[name]

    min_version = version("min_version", ssl.TLSVersion.TLSv1_2)
    max_version = version("max_version", ssl.TLSVersion.TLSv1_3)
    if min_version > max_version:
        raise WebConfigError(f"{where}: {prefix}min_version: higher than max_version")

    ciphers: str | None = None
    suites = section.get("cipher_suites")
    if suites is not None:
        if not isinstance(suites, list) or not all(isinstance(s, str) for s in suites):
            raise WebConfigError(f"{where}: {prefix}cipher_suites: must be a list of cipher suite names")
        names: list[str] = []
        for suite in suites:
            if suite not in CIPHER_SUITES:
                raise WebConfigError(
                    f"{where}: {prefix}cipher_suites: unknown or insecure cipher suite {suite!r} "
                    f"(known: {', '.join(CIPHER_SUITES)})"
                )
            openssl_name = CIPHER_SUITES[suite]
            if openssl_name is not None:
                names.append(openssl_name)
        if names:
            ciphers = ":".join(names)

    prefer = section.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise WebConfigError(f"{where}: {prefix}prefer_server_cipher_suites: must be true or false")

    settings = TLSSettings(
        cert_file=cert_file,
        key_file=key_file,
        client_auth=client_auth,
        client_ca_file=client_ca_file,
        min_version=min_version,
        max_version=max_version,
        ciphers=ciphers,
        prefer_server_ciphers=prefer,
    )
    try:
        settings.context()
    except ssl.SSLError as exc:
        # Say which field: the cipher list, the client CA or the key pair.
        reason = exc.reason or str(exc)
        if ciphers is not None and "cipher" in str(exc).lower():
            key = "cipher_suites"
        elif client_ca_file is not None and _loads_as_key_pair(settings):
            key = "client_ca_file"
        else:
            key = "cert_file/key_file"
        raise WebConfigError(f"{where}: {prefix}{key}: {reason}") from None
    except OSError as exc:
        raise WebConfigError(f"{where}: {prefix}cert_file/key_file: {exc}") from None
    return settings


def _loads_as_key_pair(settings: TLSSettings) -> bool:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(str(settings.cert_file), str(settings.key_file))
    except (OSError, ssl.SSLError):
        return False
    return True


# bcrypt hashes: $2a$, $2b$, $2y$ (htpasswd -B), a cost of 04..31, 53 characters of salt and hash.
_BCRYPT = re.compile(r"^\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}$")


def _users(raw: Any, where: str) -> dict[str, bytes]:
    if raw is None:
        return {}
    section = _mapping(raw, where, "basic_auth_users")
    users: dict[str, bytes] = {}
    for user, hashed in section.items():
        name = f"basic_auth_users.{user}"
        if not user or ":" in user:
            raise WebConfigError(f"{where}: {name}: a user name may be neither empty nor contain ':'")
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise WebConfigError(
                f"{where}: {name}: not a bcrypt hash (expected $2y$<cost>$ and 53 characters, "
                "e.g. from `htpasswd -nBC 10 \"\" | tr -d ':\\n'`); passwords are never stored in clear"
            )
        users[user] = hashed.encode()
    return users


def _http(raw: Any, where: str) -> dict[str, str]:
    if raw is None:
        return {}
    section = _mapping(raw, where, "http_server_config")
    _check_fields(section, _HTTP_FIELDS, {}, where, "http_server_config.")
    http2 = section.get("http2", True)
    if not isinstance(http2, bool):
        raise WebConfigError(f"{where}: http_server_config.http2: must be true or false")
    # http2 is accepted for compatibility; this server speaks HTTP/1.1 (what Prometheus scrapes with).
    headers_raw = section.get("headers")
    if headers_raw is None:
        return {}
    headers = _mapping(headers_raw, where, "http_server_config.headers")
    result: dict[str, str] = {}
    canonical = {name.lower(): name for name in EXTRA_HEADERS}
    for key, value in headers.items():
        name = f"http_server_config.headers.{key}"
        header = canonical.get(key.lower())
        if header is None:
            raise WebConfigError(f"{where}: {name}: this header cannot be set (allowed: {', '.join(EXTRA_HEADERS)})")
        if value is None or value == "":
            continue  # unset if blank
        if not isinstance(value, str) or any(c in value for c in "\r\n"):
            raise WebConfigError(f"{where}: {name}: must be a single-line string")
        allowed = EXTRA_HEADERS[header]
        if allowed is not None and value.lower() not in allowed:
            raise WebConfigError(f"{where}: {name}: {value!r} is not one of {', '.join(allowed)}")
        result[header] = value
    return result


# --- serving -------------------------------------------------------------------------------------------


def _stamp(paths: tuple[Path, ...]) -> tuple[tuple[int, int, int, int], ...]:
    """What identifies the files' current contents without reading them: (device, inode, size,
    mtime) through symlinks, so a Secret volume's atomic ..data swap counts as a change."""
    stamps = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            stamps.append((0, 0, -1, 0))
        else:
            stamps.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


class TLSContexts:
    """The server's SSL context, rebuilt when the certificate, key or client CA files change.

    :meth:`current` is called for every new connection and costs a few ``stat`` calls. A change that
    does not load (a certificate written before its key, a half-written file) keeps the previous
    context and is retried on the next connection; the error is logged once per change.
    """

    def __init__(self, settings: TLSSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._stamp = _stamp(settings.files)
        self._context = settings.context()
        self._failed_stamp: tuple[tuple[int, int, int, int], ...] | None = None
        self.reloads = 0

    def current(self) -> ssl.SSLContext:
        stamp = _stamp(self.settings.files)
        if stamp == self._stamp:
            return self._context
        with self._lock:
            if stamp != self._stamp and stamp != self._failed_stamp:
                try:
                    context = self.settings.context()
                except (OSError, ssl.SSLError) as exc:
                    self._failed_stamp = stamp
                    log.error("web config: keeping the previous certificate: the changed files do not load: %s", exc)
                else:
                    self._context, self._stamp, self._failed_stamp = context, stamp, None
                    self.reloads += 1
                    log.info("web config: reloaded the TLS certificate from %s", self.settings.cert_file)
            return self._context


class BasicAuth:
    """Checks ``Authorization: Basic`` against bcrypt hashes. A bcrypt check costs tens of
    milliseconds by design, so successful checks are remembered (by a SHA-256 of user, password and
    hash; bounded) and steady scraping pays it once."""

    _MAX_CACHED = 256

    def __init__(self, users: Mapping[str, bytes]) -> None:
        self._users = dict(users)
        self._good: set[bytes] = set()
        self._lock = threading.Lock()

    def check(self, user: str, password: str) -> bool:
        import bcrypt

        hashed = self._users.get(user)
        if hashed is None:
            return False
        key = hashlib.sha256(b"\0".join((user.encode(), password.encode(), hashed))).digest()
        with self._lock:
            if key in self._good:
                return True
        try:
            ok = bcrypt.checkpw(password.encode(), hashed)
        except ValueError:  # a password over bcrypt's 72 bytes, or a hash bcrypt cannot read
            ok = False
        if ok:
            with self._lock:
                if len(self._good) >= self._MAX_CACHED:
                    with contextlib.suppress(KeyError):
                        self._good.pop()
                self._good.add(key)
        return ok
