"""/metrics security without a cluster: web config parsing (each bad field named), TLS with real
certificates (openssl), rotation without restart, client certificates, basic auth, extra headers,
bearer-token verdicts, and the review cache's API-call economy."""

from __future__ import annotations

import base64
import gzip
import shutil
import ssl
import threading
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest
import yaml
from prometheus_client import CollectorRegistry

from otel_dra.cli import main
from otel_dra.kube.authz import Review, ReviewCache, ReviewUnavailable
from otel_dra.telemetry.exposition import Chunk, GaugeFamily, assemble
from otel_dra.telemetry.http import Endpoints, MetricsServer, Security, TokenVerdict
from otel_dra.telemetry.webconfig import BasicAuth, TLSContexts, WebConfigError, load_web_config
from tests.pki import CA, make_ca, serial, served_serial

FAM = GaugeFamily("demo_value", "By", "A demo.", ("k",))


@pytest.fixture(autouse=True)
def _restore_logging():
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "ca")
    other = make_ca(d, "other-ca")
    cert, key = ca.issue("server")
    cert2, key2 = ca.issue("server2")
    client_cert, client_key = ca.issue("client", san="", client=True)
    return {
        "dir": d,
        "ca": ca,
        "other": other,
        "cert": cert,
        "key": key,
        "cert2": cert2,
        "key2": key2,
        "client_cert": client_cert,
        "client_key": client_key,
    }


def write_config(path: Path, config: object) -> Path:
    path.write_text(yaml.safe_dump(config) if not isinstance(config, str) else config)
    return path


def scrape_source(openmetrics: bool, gzipped: bool) -> list[bytes]:
    rows = [((f"v{i}" * 40,), float(i)) for i in range(3000)]  # ~400 KB: several TLS writes
    return assemble(CollectorRegistry(), [(FAM, [Chunk(FAM.render(rows))])], openmetrics, gzipped)


def start(security: Security | None) -> MetricsServer:
    return MetricsServer(Endpoints(scrape_source, lambda: None), "127.0.0.1", 0, security).start()


def get(url: str, headers=None, context: ssl.SSLContext | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def client_context(ca: CA, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca.cert))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


# --- parsing -----------------------------------------------------------------------------------------


def _tls(pki, **extra):
    return {"tls_server_config": {"cert_file": str(pki["cert"]), "key_file": str(pki["key"]), **extra}}


BAD_CONFIGS = [
    # (config given the pki, text the error must contain)
    (lambda p: {"nonsense": 1}, "nonsense: unknown field"),
    (lambda p: {"tls_server_config": {"key_file": str(p["key"])}}, "tls_server_config.cert_file: missing"),
    (lambda p: {"tls_server_config": {"cert_file": str(p["cert"])}}, "tls_server_config.key_file: missing"),
    (
        lambda p: {"tls_server_config": {"cert_file": str(p["cert"]), "key_file": "/nonexistent/key.pem"}},
        "tls_server_config.key_file: cannot read /nonexistent/key.pem",
    ),
    (lambda p: _tls(p, client_auth_type="Sometimes"), "tls_server_config.client_auth_type: 'Sometimes'"),
    (lambda p: _tls(p, client_auth_type="RequireAnyClientCert"), "client_auth_type: RequireAnyClientCert"),
    (lambda p: _tls(p, client_auth_type="RequestClientCert"), "client_auth_type: RequestClientCert"),
    (lambda p: _tls(p, client_auth_type="VerifyClientCertIfGiven"), "tls_server_config.client_ca_file: client_auth"),
    (lambda p: _tls(p, client_ca_file=str(p["ca"].cert)), "tls_server_config.client_auth_type: client_ca_file"),
    (
        lambda p: _tls(p, client_auth_type="RequireAndVerifyClientCert", client_ca_file=str(p["key"])),
        "tls_server_config.client_ca_file:",
    ),
    (lambda p: _tls(p, min_version="TLS14"), "tls_server_config.min_version: 'TLS14'"),
    (lambda p: _tls(p, max_version="SSL3"), "tls_server_config.max_version: 'SSL3'"),
    (lambda p: _tls(p, min_version="TLS13", max_version="TLS12"), "tls_server_config.min_version: higher"),
    (lambda p: _tls(p, cipher_suites=["TLS_RSA_WITH_RC4_128_SHA"]), "tls_server_config.cipher_suites: unknown"),
    (lambda p: _tls(p, cipher_suites="TLS_AES_128_GCM_SHA256"), "tls_server_config.cipher_suites: must be a list"),
    (lambda p: _tls(p, prefer_server_cipher_suites="yes"), "tls_server_config.prefer_server_cipher_suites"),
    (lambda p: _tls(p, curve_preferences=["X25519"]), "tls_server_config.curve_preferences: not supported"),
    (lambda p: _tls(p, cert="-----BEGIN"), "tls_server_config.cert: inline"),
    (
        lambda p: {"tls_server_config": {"cert_file": str(p["cert"]), "key_file": str(p["key2"])}},
        "tls_server_config.cert_file/key_file:",
    ),
    (
        lambda p: {"tls_server_config": {"cert_file": str(p["key"]), "key_file": str(p["key"])}},
        "tls_server_config.cert_file/key_file:",
    ),
    (lambda p: {"basic_auth_users": {"alice": "secret"}}, "basic_auth_users.alice: not a bcrypt hash"),
    (lambda p: {"basic_auth_users": {"a:b": "$2y$10$" + "a" * 53}}, "basic_auth_users.a:b: a user name"),
    (lambda p: {"basic_auth_users": ["alice"]}, "basic_auth_users must be a mapping"),
    (lambda p: {"http_server_config": {"headers": {"X-Powered-By": "otel"}}}, "headers.X-Powered-By: this header"),
    (lambda p: {"http_server_config": {"headers": {"X-Frame-Options": "allow"}}}, "headers.X-Frame-Options: 'allow'"),
    (lambda p: {"http_server_config": {"headers": {"X-XSS-Protection": "1\r\nX: y"}}}, "headers.X-XSS-Protection"),
    (lambda p: {"http_server_config": {"http2": "maybe"}}, "http_server_config.http2"),
    (lambda p: {"http_server_config": {"gzip": True}}, "http_server_config.gzip: unknown field"),
    (lambda p: {"auth_excluded_paths": ["/metrics"]}, "auth_excluded_paths: not supported"),
    (lambda p: "tls_server_config: [unclosed", "not valid YAML"),
    (lambda p: "- a list", "the file must be a mapping"),
]


@pytest.mark.parametrize(("make", "message"), BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_invalid_web_config_names_the_field(pki, tmp_path, make, message):
    path = write_config(tmp_path / "web.yml", make(pki))
    with pytest.raises(WebConfigError) as exc:
        load_web_config(path)
    assert message in str(exc.value) and str(path) in str(exc.value)


def test_valid_web_config_and_relative_paths(pki, tmp_path):
    d = pki["dir"]
    path = write_config(
        d / "web-relative.yml",
        {
            "tls_server_config": {
                "cert_file": "server.crt",  # relative to the file's directory, as exporter-toolkit
                "key_file": "server.key",
                "client_auth_type": "VerifyClientCertIfGiven",
                "client_ca_file": "ca.crt",
                "min_version": "TLS12",
                "max_version": "TLS13",
                "cipher_suites": ["TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", "TLS_AES_128_GCM_SHA256"],
                "prefer_server_cipher_suites": False,
            },
            "http_server_config": {"http2": False, "headers": {"x-frame-options": "deny", "X-XSS-Protection": ""}},
            "basic_auth_users": {"alice": bcrypt.hashpw(b"pw", bcrypt.gensalt(4)).decode()},
        },
    )
    config = load_web_config(path)
    assert config.tls is not None and config.tls.cert_file == d / "server.crt"
    assert config.tls.client_auth == ssl.CERT_OPTIONAL and config.tls.ciphers == "ECDHE-ECDSA-AES128-GCM-SHA256"
    assert config.headers == {"X-Frame-Options": "deny"}  # canonical name; a blank value is unset
    assert set(config.basic_auth_users) == {"alice"}
    assert load_web_config(write_config(tmp_path / "empty.yml", "")).tls is None
    assert load_web_config(write_config(tmp_path / "notls.yml", {"tls_server_config": {}})).tls is None


def test_cli_refuses_an_invalid_web_config_with_exit_code_2(pki, tmp_path, monkeypatch, capsys):
    bad = write_config(tmp_path / "bad.yml", _tls(pki, min_version="TLS9"))
    assert main(["exporter", "--web-config-file", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--web-config-file" in err and "tls_server_config.min_version: 'TLS9'" in err
    monkeypatch.setenv("OTEL_DRA_WEB_CONFIG_FILE", str(tmp_path / "missing.yml"))
    assert main(["plugin", "--node-name", "node-1"]) == 2
    assert "OTEL_DRA_WEB_CONFIG_FILE" in (err := capsys.readouterr().err) and "cannot read" in err
    monkeypatch.delenv("OTEL_DRA_WEB_CONFIG_FILE")
    with pytest.raises(SystemExit) as exc:
        main(["exporter", "--authorization", "rbac"])
    assert exc.value.code == 2 and "rbac" in capsys.readouterr().err
    monkeypatch.setenv("OTEL_DRA_AUTHORIZATION_ALLOW_TTL", "forever")
    assert main(["exporter"]) == 2
    assert "OTEL_DRA_AUTHORIZATION_ALLOW_TTL" in capsys.readouterr().err


# --- TLS -------------------------------------------------------------------------------------------------


def test_https_serves_the_same_bytes_and_plain_clients_or_other_cas_fail(pki, tmp_path):
    config = load_web_config(write_config(tmp_path / "web.yml", _tls(pki)))
    plain, tls = start(None), start(Security(tls=TLSContexts(config.tls)))
    try:
        ctx = client_context(pki["ca"])
        for headers in ({}, {"Accept-Encoding": "gzip"}, {"Accept": "application/openmetrics-text; version=1.0.0"}):
            code, got_headers, body = get(f"https://127.0.0.1:{tls.port}/metrics", headers, ctx)
            _, want_headers, want = get(f"http://127.0.0.1:{plain.port}/metrics", headers)
            assert code == 200 and got_headers["Content-Type"] == want_headers["Content-Type"]
            if got_headers.get("Content-Encoding") == "gzip":
                body, want = gzip.decompress(body), gzip.decompress(want)
            assert body == want and len(body) > 300_000
        assert get(f"https://127.0.0.1:{tls.port}/healthz", context=ctx)[0] == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(f"https://127.0.0.1:{tls.port}/metrics", context=client_context(pki["other"]))
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            get(f"http://127.0.0.1:{tls.port}/metrics")
        # The server is still fine after the failed handshakes.
        assert get(f"https://127.0.0.1:{tls.port}/metrics", context=ctx)[0] == 200
    finally:
        plain.stop()
        tls.stop()


def test_a_rotated_certificate_is_served_without_restart(pki, tmp_path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki["cert"], cert)
    shutil.copy(pki["key"], key)
    config = load_web_config(
        write_config(tmp_path / "web.yml", {"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"}})
    )
    contexts = TLSContexts(config.tls)
    server = start(Security(tls=contexts))
    try:
        assert served_serial(server.port, pki["ca"]) == serial(pki["cert"])
        # Half a rotation (the certificate written before its key) does not load: the old pair stays.
        shutil.copy(pki["cert2"], cert)
        assert served_serial(server.port, pki["ca"]) == serial(pki["cert"])
        shutil.copy(pki["key2"], key)
        assert served_serial(server.port, pki["ca"]) == serial(pki["cert2"])
        assert contexts.reloads == 1
        # Steady state: no rebuild per connection.
        served_serial(server.port, pki["ca"])
        assert contexts.reloads == 1
    finally:
        server.stop()


def test_client_certificates_required_and_verified(pki, tmp_path):
    config = load_web_config(
        write_config(
            tmp_path / "web.yml",
            _tls(pki, client_auth_type="RequireAndVerifyClientCert", client_ca_file=str(pki["ca"].cert)),
        )
    )
    server = start(Security(tls=TLSContexts(config.tls)))
    url = f"https://127.0.0.1:{server.port}/metrics"
    try:
        assert get(url, context=client_context(pki["ca"], pki["client_cert"], pki["client_key"]))[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError, OSError)):
            get(url, context=client_context(pki["ca"]))
    finally:
        server.stop()


# --- authentication and headers ---------------------------------------------------------------------------


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_basic_auth_guards_only_metrics_and_is_checked_once_per_password(tmp_path, monkeypatch):
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(6)).decode().replace("$2b$", "$2y$")  # as htpasswd -B
    config = load_web_config(
        write_config(
            tmp_path / "web.yml",
            {
                "basic_auth_users": {"prometheus": hashed},
                "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "deny"}},
            },
        )
    )
    checks = []
    real_checkpw = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda pw, h: checks.append(pw) or real_checkpw(pw, h))
    server = start(Security(basic_auth=BasicAuth(config.basic_auth_users), headers=config.headers))
    base = f"http://127.0.0.1:{server.port}"
    try:
        code, headers, _ = get(base + "/metrics")
        assert code == 401 and headers["WWW-Authenticate"].startswith("Basic realm=")
        assert headers["X-Content-Type-Options"] == "nosniff" and headers["X-Frame-Options"] == "deny"
        assert get(base + "/metrics", _basic("prometheus", "wrong"))[0] == 401
        assert get(base + "/metrics", _basic("nobody", "s3cret"))[0] == 401
        assert get(base + "/metrics", {"Authorization": "Basic !!notbase64"})[0] == 401
        assert get(base + "/metrics", {"Authorization": "Bearer abc"})[0] == 401
        for _ in range(5):
            code, headers, body = get(base + "/metrics", _basic("prometheus", "s3cret"))
            assert code == 200 and b"demo_value" in body and headers["X-Frame-Options"] == "deny"
        assert checks.count(b"s3cret") == 1  # bcrypt once; then the remembered result
        for path in ("/healthz", "/readyz", "/"):
            code, headers, _ = get(base + path)
            assert code == 200 and headers["X-Content-Type-Options"] == "nosniff"
    finally:
        server.stop()


def test_bearer_token_verdicts_map_to_401_403_503():
    verdicts = {"good": TokenVerdict(200), "other": TokenVerdict(403, "not allowed"), "down": TokenVerdict(503)}
    seen = []

    def authorize(token: str) -> TokenVerdict:
        seen.append(token)
        return verdicts.get(token, TokenVerdict(401, "unknown token"))

    server = start(Security(authorize_token=authorize))
    base = f"http://127.0.0.1:{server.port}"
    try:
        code, headers, _ = get(base + "/metrics")
        assert code == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert get(base + "/metrics", {"Authorization": "Bearer "})[0] == 401
        assert get(base + "/metrics", {"Authorization": "Bearer forged"})[0] == 401
        assert get(base + "/metrics", {"Authorization": "Bearer other"})[0] == 403
        assert get(base + "/metrics", {"Authorization": "Bearer down"})[0] == 503
        assert get(base + "/metrics", {"Authorization": "bearer good"})[0] == 200
        assert get(base + "/readyz")[0] == 200 and get(base + "/healthz")[0] == 200
        assert seen == ["forged", "other", "down", "good"]  # probes and token-less requests ask nobody
    finally:
        server.stop()


# --- the review cache (otel_dra/kube/authz.py) -------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_review_cache_steady_scraping_costs_no_review_after_the_first():
    clock, calls = Clock(), []
    answers = {"prom": Review(True, True, "system:serviceaccount:monitoring:prometheus")}

    def review(token: str) -> Review:
        calls.append(token)
        return answers.get(token, Review(False, False, reason="invalid token"))

    cache = ReviewCache(review, allow_ttl=120, deny_ttl=30, clock=clock)
    for _ in range(100):  # a scrape a second for 100 s
        assert cache("prom").allowed
        clock.now += 1
    assert calls == ["prom"]
    clock.now += 21  # 121 s after the first review: the allowed answer has expired
    assert cache("prom").allowed and calls == ["prom", "prom"]
    # Rejected tokens are remembered for deny_ttl.
    for _ in range(29):
        assert not cache("forged").authenticated
        clock.now += 1
    assert calls.count("forged") == 1
    clock.now += 1.5
    cache("forged")
    assert calls.count("forged") == 2
    assert cache.reviews == 4


def test_review_cache_shares_one_review_between_concurrent_requests_and_caches_no_errors():
    gate, calls = threading.Event(), []

    def review(token: str) -> Review:
        calls.append(token)
        if token == "flaky" and calls.count("flaky") == 1:
            raise ReviewUnavailable("API server unreachable")
        gate.wait(5)
        return Review(True, True, "u")

    cache = ReviewCache(review)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache("t"))) for _ in range(8)]
    for thread in threads:
        thread.start()
    gate.set()
    for thread in threads:
        thread.join(10)
    assert len(results) == 8 and all(r.allowed for r in results) and calls == ["t"]
    with pytest.raises(ReviewUnavailable):
        cache("flaky")
    assert cache("flaky").allowed and calls.count("flaky") == 2


def test_review_cache_is_bounded():
    cache = ReviewCache(lambda token: Review(True, True), max_entries=10)
    for i in range(50):
        cache(f"token-{i}")
    assert len(cache._entries) == 10
