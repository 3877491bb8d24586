"""A small Kubernetes REST client: credentials from the usual places, raw JSON, one request path.

Why not the generated ``kubernetes`` client API: its typed models are about 10x slower than
``json.loads`` at 10^4 objects, one malformed object fails a whole list, and its watch helper is
broken for resource.k8s.io/v1 (see docs/design.md). We reuse only its credential loading
(kubeconfig merging, exec plugins, in-cluster tokens with refresh) and do the HTTP ourselves with
urllib3, so every API request goes through :meth:`KubeClient.request` -- the single place where
request metrics are recorded.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import urllib3

from otel_dra.records import record

log = logging.getLogger(__name__)

IN_CLUSTER_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class CredentialsError(RuntimeError):
    """No usable Kubernetes credentials; the message says what was tried."""


class ApiError(Exception):
    """A non-2xx answer from the API server (``status`` 0: no answer at all). ``retry_after``: the
    seconds its ``Retry-After`` header asked for (429 from priority and fairness or max-in-flight,
    503), None when it sent none (or an HTTP date, which the API server never sends)."""

    def __init__(self, status: int, reason: str, body: str = "", retry_after: float | None = None) -> None:
        self.status = status
        self.reason = reason
        self.body = body
        self.retry_after = retry_after
        message = reason
        try:
            parsed = json.loads(body) if body else None
            if isinstance(parsed, dict) and parsed.get("message"):
                message = str(parsed["message"])
        except ValueError:
            pass
        self.message = message
        super().__init__(f"HTTP {status}: {message}" if status else message)


@record(frozen=True)
class Credentials:
    """Where the API server is and how to authenticate; ``source`` says where it came from."""

    host: str
    source: str
    ca_file: str | None
    cert_file: str | None
    key_file: str | None
    verify: bool
    tls_server_name: str | None
    auth_headers: Callable[[], dict[str, str]]


def load_credentials(kubeconfig: str | None = None, env: Mapping[str, str] | None = None) -> Credentials:
    """``--kubeconfig``, else ``KUBECONFIG`` (path list), else in-cluster, else ``~/.kube/config``.

    The common cases (one kubeconfig file with a token or client certificate, the in-cluster
    service account) are read here directly, with the kubernetes client's rules; everything else
    (several files to merge, exec plugins, auth providers, basic auth, proxies, a broken file) goes
    to the kubernetes client's loaders. Importing the ``kubernetes`` package costs about 0.35 s of
    CPU (pydantic models, requests, oauthlib), which the plugin would pay on every node at start-up
    before the kubelet can register it (docs/benchmarks.md, real kubelet)."""
    env = os.environ if env is None else env
    home_config = Path(env.get("HOME", str(Path.home()))) / ".kube" / "config"
    fast = _simple_credentials(kubeconfig, env, home_config)
    if fast is not None:
        return fast
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config

    cfg = k8s_client.Configuration()
    try:
        if kubeconfig:
            for path in kubeconfig.split(os.pathsep):
                if path and not Path(path).expanduser().exists():
                    raise CredentialsError(f"--kubeconfig {path}: file does not exist")
            k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
            source = f"--kubeconfig {kubeconfig}"
        elif env.get("KUBECONFIG"):
            paths = [p for p in env["KUBECONFIG"].split(os.pathsep) if p]
            if not any(Path(p).expanduser().exists() for p in paths):
                raise CredentialsError(f"KUBECONFIG={env['KUBECONFIG']}: none of these files exists")
            k8s_config.load_kube_config(config_file=env["KUBECONFIG"], client_configuration=cfg)
            source = f"KUBECONFIG={env['KUBECONFIG']}"
        elif env.get("KUBERNETES_SERVICE_HOST") and IN_CLUSTER_TOKEN.exists():
            k8s_config.load_incluster_config(client_configuration=cfg)
            source = "in-cluster service account"
        elif home_config.exists():
            k8s_config.load_kube_config(config_file=str(home_config), client_configuration=cfg)
            source = str(home_config)
        else:
            raise CredentialsError(
                "no Kubernetes credentials: pass --kubeconfig, set KUBECONFIG, run in a pod with a "
                f"service account, or create {home_config}"
            )
    except CredentialsError:
        raise
    except Exception as exc:  # the kubernetes loader raises many types; all mean "unusable config"
        raise CredentialsError(f"cannot load Kubernetes credentials: {exc}") from exc

    def auth_headers() -> dict[str, str]:
        headers: dict[str, str] = {}
        # auth_settings() also runs the refresh hook (exec plugins, rotated in-cluster tokens).
        settings: dict[str, Any] = dict(cfg.auth_settings())
        for setting in settings.values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[setting["key"]] = setting["value"]
        return headers

    return Credentials(
        host=cfg.host.rstrip("/"),
        source=source,
        ca_file=cfg.ssl_ca_cert,
        cert_file=cfg.cert_file,
        key_file=cfg.key_file,
        verify=bool(cfg.verify_ssl),
        tls_server_name=getattr(cfg, "tls_server_name", None),
        auth_headers=auth_headers,
    )


IN_CLUSTER_CA = IN_CLUSTER_TOKEN.parent / "ca.crt"
# As the kubernetes client's in-cluster loader: the projected token is re-read once a minute.
IN_CLUSTER_TOKEN_REFRESH = 60.0
_CLUSTER_KEYS = {
    "server",
    "certificate-authority",
    "certificate-authority-data",
    "insecure-skip-tls-verify",
    "tls-server-name",
}
_USER_KEYS = {"token", "tokenFile", "client-certificate", "client-certificate-data", "client-key", "client-key-data"}
_temp_files: dict[bytes, str] = {}


def _simple_credentials(kubeconfig: str | None, env: Mapping[str, str], home_config: Path) -> Credentials | None:
    """Credentials for the cases :func:`load_credentials` reads without the kubernetes package, in
    its order of sources; None for anything else (the kubernetes loaders then decide, and word
    the errors)."""
    if kubeconfig:
        return _simple_kubeconfig(kubeconfig, f"--kubeconfig {kubeconfig}")
    if env.get("KUBECONFIG"):
        return _simple_kubeconfig(env["KUBECONFIG"], f"KUBECONFIG={env['KUBECONFIG']}")
    if env.get("KUBERNETES_SERVICE_HOST") and IN_CLUSTER_TOKEN.exists():
        return _in_cluster(env, IN_CLUSTER_TOKEN, IN_CLUSTER_CA)
    if home_config.exists():
        return _simple_kubeconfig(str(home_config), str(home_config))
    return None


def _in_cluster(env: Mapping[str, str], token_file: Path, ca_file: Path) -> Credentials | None:
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    try:
        token = token_file.read_text()
        ca = ca_file.read_text()
    except OSError:
        return None
    if not (host and port and token and ca):
        return None
    if ":" in host or "%" in host:  # an IPv6 address, as net.JoinHostPort
        host = f"[{host}]"
    state: dict[str, Any] = {"token": token, "read": time.monotonic()}

    def auth_headers() -> dict[str, str]:
        if time.monotonic() - state["read"] >= IN_CLUSTER_TOKEN_REFRESH:
            try:
                fresh = token_file.read_text()
            except OSError:
                fresh = ""
            if fresh:  # a failed re-read keeps the last token, as the kubernetes loader does
                state["token"] = fresh
            state["read"] = time.monotonic()
        return {"authorization": f"bearer {state['token']}"}

    return Credentials(
        host=f"https://{host}:{port}",
        source="in-cluster service account",
        ca_file=str(ca_file),
        cert_file=None,
        key_file=None,
        verify=True,
        tls_server_name=None,
        auth_headers=auth_headers,
    )


def _simple_kubeconfig(path_list: str, source: str) -> Credentials | None:
    """One kubeconfig file whose current context's cluster and user use only static settings."""
    if os.pathsep in path_list or not Path(path_list).expanduser().is_file():
        return None
    path = Path(path_list).expanduser()
    try:
        config = _read_kubeconfig(path.read_text())
        context = _named(config["contexts"], config["current-context"], "context")
        cluster = _named(config["clusters"], context["cluster"], "cluster")
        user = _named(config.get("users") or [], context["user"], "user") if context.get("user") else {}
    except (OSError, KeyError, TypeError, ValueError, AttributeError):
        return None
    if not isinstance(cluster, dict) or not isinstance(user, dict) or set(cluster) - _CLUSTER_KEYS:
        return None
    if set(user) - _USER_KEYS or not isinstance(cluster.get("server"), str):
        return None
    base = Path(os.path.abspath(os.path.dirname(path)))  # as the kubernetes loader: symlinks kept
    host = cluster["server"].rstrip("/")
    ca_file = cert_file = key_file = None
    if host.startswith("https"):
        ca_file = _file_or_data(cluster, "certificate-authority", base)
        cert_file = _file_or_data(user, "client-certificate", base)
        key_file = _file_or_data(user, "client-key", base)
        if "" in (ca_file, cert_file, key_file):
            return None  # a named file is missing: the kubernetes loader says so
    token = user.get("token")
    if not token and user.get("tokenFile"):
        try:
            token = Path(os.path.normpath(base / user["tokenFile"])).read_text()
        except OSError:
            return None
    headers = {"authorization": f"Bearer {token}"} if token else {}
    skip = cluster.get("insecure-skip-tls-verify")
    return Credentials(
        host=host,
        source=source,
        ca_file=ca_file,
        cert_file=cert_file,
        key_file=key_file,
        verify=True if skip is None else not skip,
        tls_server_name=cluster.get("tls-server-name"),
        auth_headers=lambda: dict(headers),
    )


def _read_kubeconfig(text: str) -> Any:
    """A kubeconfig's content. JSON (what ``kubectl config view -o json`` writes, and valid YAML)
    is read without yaml: importing it is a tenth of the plugin's start-up CPU (docs/benchmarks.md).
    Raises ValueError for text that is neither."""
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except ValueError:
            pass  # YAML's flow style also starts with "{" and is not always JSON
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from exc


def _named(items: Any, name: Any, key: str) -> Any:
    """The ``key`` section of the entry called ``name`` of a kubeconfig list (KeyError if none)."""
    for item in items:
        if item.get("name") == name:
            return item[key]
    raise KeyError(name)


def _file_or_data(section: Mapping[str, Any], key: str, base: Path) -> str | None:
    """``<key>-data`` (base64) as a private temporary file, else the ``<key>`` file relative to
    the kubeconfig; None when neither is set, "" when the named file does not exist."""
    import base64

    data = section.get(f"{key}-data")
    if data:
        content = base64.standard_b64decode(data)
        if content not in _temp_files:
            import atexit
            import tempfile

            if not _temp_files:
                atexit.register(_remove_temp_files)
            fd, name = tempfile.mkstemp(prefix="otel-dra-kubeconfig-")
            with os.fdopen(fd, "wb") as out:
                out.write(content)
            _temp_files[content] = name
        return _temp_files[content]
    if section.get(key):
        file = os.path.normpath(base / section[key])
        return file if os.path.isfile(file) else ""
    return None


def _remove_temp_files() -> None:
    import contextlib

    for name in _temp_files.values():
        with contextlib.suppress(OSError):
            os.remove(name)
    _temp_files.clear()


@record(frozen=True)
class RequestRecord:
    """One attempt of one API request, as seen by a :data:`RequestObserver`."""

    method: str
    host: str  # host:port of the API server, as client-go's ``host`` label
    path: str
    status: int  # HTTP status, or 0 when the API server did not answer
    seconds: float
    retried: bool  # this attempt failed and the client is going to try again


# Called once per attempt (a retried request makes several calls), from the requesting thread.
RequestObserver = Callable[[RequestRecord], None]

RETRYABLE_STATUSES = frozenset({0, 429, 500, 502, 503, 504})


@record(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff for requests that are safe to repeat.

    Only ``methods`` (idempotent by HTTP semantics; a PUT carries a resourceVersion, so a repeat
    cannot overwrite someone else's change) are retried, and only on ``statuses`` (0: no answer,
    e.g. connection refused or reset). A ``Retry-After`` answer is honoured up to ``max_delay``.
    """

    max_retries: int = 3
    base_delay: float = 0.1
    max_delay: float = 2.0
    methods: frozenset[str] = frozenset({"GET", "HEAD", "PUT", "DELETE"})
    statuses: frozenset[int] = RETRYABLE_STATUSES

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        if retry_after:
            try:
                return min(max(float(retry_after), 0.0), self.max_delay)
            except ValueError:
                pass  # an HTTP date: fall back to our own backoff
        backoff: float = min(self.base_delay * 2 ** (attempt - 1), self.max_delay)
        return backoff * random.uniform(0.5, 1.0)  # jitter: retrying clients do not move in lockstep


class KubeClient:
    """HTTP against one API server. Thread-safe (urllib3 pools are)."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        observer: RequestObserver | None = None,
        retry: RetryPolicy | None = None,
        user_agent: str = "otel-dra",
        max_connections: int = 8,
    ) -> None:
        self.credentials = credentials
        self.host = credentials.host
        self._observer = observer
        self._retry = retry
        self._user_agent = user_agent
        self._netloc = urlsplit(credentials.host).netloc
        kwargs: dict[str, Any] = {"maxsize": max_connections, "retries": False}
        if credentials.host.startswith("https"):
            kwargs["cert_reqs"] = "CERT_REQUIRED" if credentials.verify else "CERT_NONE"
            if credentials.ca_file:
                kwargs["ca_certs"] = credentials.ca_file
            if credentials.cert_file:
                kwargs["cert_file"] = credentials.cert_file
                kwargs["key_file"] = credentials.key_file
            if credentials.tls_server_name:
                kwargs["server_hostname"] = credentials.tls_server_name
            if not credentials.verify:
                urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        self._pool = urllib3.PoolManager(**kwargs)

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str | int] | None = None,
        body: Any = None,
        timeout: tuple[float, float] = (10.0, 60.0),
        stream: bool = False,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> urllib3.BaseHTTPResponse:
        """One API request. Raises :class:`ApiError` for transport errors and non-2xx answers.

        With ``stream=True`` the caller reads (and must release) the body. With a retry policy,
        failed attempts of idempotent requests are repeated (see :class:`RetryPolicy`).
        """
        url = self.host + path
        if query:
            url += "?" + urlencode({k: v for k, v in query.items() if v is not None and v != ""})
        data: bytes | None = None
        if body is not None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
        policy = self._retry if self._retry is not None and method in self._retry.methods else None
        attempt = 0
        while True:
            try:
                return self._attempt(method, path, url, data, content_type, headers, timeout, stream, policy, attempt)
            except _Retry as retry:
                attempt += 1
                assert policy is not None
                time.sleep(policy.delay(attempt, retry.retry_after))

    def _attempt(
        self,
        method: str,
        path: str,
        url: str,
        data: bytes | None,
        content_type: str,
        extra_headers: Mapping[str, str] | None,
        timeout: tuple[float, float],
        stream: bool,
        policy: RetryPolicy | None,
        attempt: int,
    ) -> urllib3.BaseHTTPResponse:
        headers = {"Accept": "application/json", "User-Agent": self._user_agent}
        if extra_headers:
            headers.update(extra_headers)
        headers.update(self.credentials.auth_headers())
        if data is not None:
            headers["Content-Type"] = content_type
        start = time.monotonic()
        try:
            resp = self._pool.request(
                method,
                url,
                body=data,
                headers=headers,
                timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]),
                preload_content=not stream,
                redirect=False,
            )
        except urllib3.exceptions.HTTPError as exc:
            retry = policy is not None and attempt < policy.max_retries and 0 in policy.statuses
            self._observe(method, path, 0, start, retry)
            if retry:
                raise _Retry(None) from exc
            raise ApiError(0, f"{method} {self._netloc}{path}: {exc}") from exc
        status = resp.status
        retry = policy is not None and attempt < policy.max_retries and status in policy.statuses
        self._observe(method, path, status, start, retry)
        if status >= 300:
            text = resp.data.decode("utf-8", "replace") if not stream else resp.read().decode("utf-8", "replace")
            if stream:
                resp.release_conn()
            if retry:
                raise _Retry(resp.headers.get("Retry-After"))
            raise ApiError(status, resp.reason or "", text, retry_after_seconds(resp.headers.get("Retry-After")))
        return resp

    def _observe(self, method: str, path: str, status: int, start: float, retried: bool) -> None:
        if self._observer is not None:
            self._observer(RequestRecord(method, self._netloc, path, status, time.monotonic() - start, retried))

    def get_json(
        self,
        path: str,
        query: Mapping[str, str | int] | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: tuple[float, float] = (10.0, 60.0),
    ) -> Any:
        return json.loads(self.get_bytes(path, query, headers=headers, timeout=timeout))

    def get_bytes(
        self,
        path: str,
        query: Mapping[str, str | int] | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        timeout: tuple[float, float] = (10.0, 60.0),
    ) -> bytes:
        """The raw body of a GET (the reflector decodes list pages itself)."""
        data: bytes = self.request("GET", path, query=query, headers=headers, timeout=timeout).data
        return data

    def send_json(self, method: str, path: str, body: Any, content_type: str = "application/json") -> Any:
        return json.loads(self.request(method, path, body=body, content_type=content_type).data)


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header in seconds (delta-seconds only); None when absent or not a number."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


class _Retry(Exception):
    """Internal: the attempt failed in a way the retry policy repeats."""

    def __init__(self, retry_after: str | None) -> None:
        self.retry_after = retry_after
