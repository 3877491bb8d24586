"""/metrics over TLS with Kubernetes authorization, end to end with the real pieces: the real
Prometheus scrapes the exporter and the kubelet plugin over HTTPS with ServiceAccount tokens
(``authorization.credentials_file``) and the CA in its ``tls_config``; the real API server answers
the TokenReviews and SubjectAccessReviews. An allowed account gets 200, another account 403, no
token 401, a scraper trusting another CA fails the handshake, and a rotated certificate is served
without a restart. Steady scraping costs no API call after the first review of each token."""

from __future__ import annotations

import os
import shutil
import ssl
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_dra.cli.plugin import PluginApp, start_plugin
from otel_dra.cli.web import WebOptions
from otel_dra.telemetry.webconfig import load_web_config
from tests.helpers import wait_until
from tests.pki import make_ca, serial, served_serial

NS = "metrics-authz"

RBAC = f"""
apiVersion: v1
kind: Namespace
metadata: {{name: {NS}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: prometheus, namespace: {NS}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: intruder, namespace: {NS}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: otel-dra-test-metrics-reader}}
rules:
  - nonResourceURLs: ["/metrics"]
    verbs: ["get"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: otel-dra-test-metrics-reader}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: otel-dra-test-metrics-reader}}
subjects:
  - {{kind: ServiceAccount, name: prometheus, namespace: {NS}}}
"""


@pytest.fixture(scope="module")
def setup(testbed, tmp_path_factory) -> dict[str, Any]:
    testbed.kubectl("apply", "-f", "-", input=RBAC)
    d = tmp_path_factory.mktemp("metrics-security")
    ca, other_ca = make_ca(d, "ca"), make_ca(d, "other-ca")
    cert, key = ca.issue("exporter")
    rotated_cert, rotated_key = other_ca.issue("exporter-rotated")
    tokens = {}
    for account in ("prometheus", "intruder"):
        path = d / f"{account}.token"
        path.write_text(testbed.mint_token(NS, account, duration="1h"))
        tokens[account] = path
    return {
        "dir": d,
        "ca": ca,
        "other_ca": other_ca,
        "cert": cert,
        "key": key,
        "rotated": (rotated_cert, rotated_key),
        "tokens": tokens,
    }


@pytest.fixture
def tls_dir(setup, tmp_path) -> Path:
    """This test's serving certificate files and web config (the rotation test replaces the files)."""
    shutil.copy(setup["cert"], tmp_path / "tls.crt")
    shutil.copy(setup["key"], tmp_path / "tls.key")
    (tmp_path / "web.yml").write_text(
        yaml.safe_dump({"tls_server_config": {"cert_file": "tls.crt", "key_file": "tls.key"}})
    )
    return tmp_path


def _web(tls_dir: Path) -> WebOptions:
    return WebOptions(load_web_config(tls_dir / "web.yml"), "kubernetes", 120.0, 30.0)


@pytest.fixture
def plugin(testbed, tls_dir) -> Iterator[PluginApp]:
    root = Path(tempfile.mkdtemp(prefix="odp-", dir="/tmp"))  # unix socket paths: short
    app = start_plugin(
        node_name=f"node-{uuid.uuid4().hex[:8]}",
        kubeconfig=str(testbed.kubeconfig),
        plugins_dir=root / "plugins",
        registrar_dir=root / "registry",
        cdi_root=root / "cdi",
        metrics_port=0,
        metrics_address="127.0.0.1",
        web=_web(tls_dir),
    )
    yield app
    app.stop(remove_slices=True)
    shutil.rmtree(root, ignore_errors=True)


def _job(targets: list[str], ca: Path, token: Path | None) -> dict[str, Any]:
    job: dict[str, Any] = {
        "scheme": "https",
        "tls_config": {"ca_file": str(ca)},
        "static_configs": [{"targets": targets}],
    }
    if token is not None:
        job["authorization"] = {"type": "Bearer", "credentials_file": str(token)}
    return job


def _targets(prometheus, job: str) -> list[dict[str, Any]]:
    return [t for t in prometheus.api("/api/v1/targets")["activeTargets"] if t["labels"].get("job") == job]


def _scraped(prometheus, job: str) -> list[dict[str, Any]] | None:
    """The job's targets once each has been scraped at least once, else None."""
    targets = _targets(prometheus, job)
    return targets if len(targets) == 2 and all(t["health"] != "unknown" for t in targets) else None


def test_prometheus_scrapes_over_tls_with_kubernetes_authorization(
    testbed, prometheus, start_exporter_app, setup, tls_dir, plugin
):
    exporter = start_exporter_app(str(testbed.kubeconfig), web=_web(tls_dir))
    wait_until(lambda: exporter.state.not_synced() is None, timeout=30, what="exporter synced")
    targets = [f"127.0.0.1:{exporter.port}", f"127.0.0.1:{plugin.metrics_port}"]
    ca, other_ca, tokens = setup["ca"].cert, setup["other_ca"].cert, setup["tokens"]
    prometheus.set_jobs(
        {
            "tls-allowed": _job(targets, ca, tokens["prometheus"]),
            "tls-intruder": _job(targets, ca, tokens["intruder"]),
            "tls-anonymous": _job(targets, ca, None),
            "tls-other-ca": _job(targets, other_ca, tokens["prometheus"]),
        }
    )
    try:
        results = {
            job: wait_until(lambda job=job: _scraped(prometheus, job), timeout=30, what=f"{job} scraped")
            for job in ("tls-allowed", "tls-intruder", "tls-anonymous", "tls-other-ca")
        }
        for target in results["tls-allowed"]:
            assert target["health"] == "up", target
        for target in results["tls-intruder"]:
            assert target["health"] == "down" and "403" in target["lastError"], target
        for target in results["tls-anonymous"]:
            assert target["health"] == "down" and "401" in target["lastError"], target
        for target in results["tls-other-ca"]:
            assert target["health"] == "down" and "x509" in target["lastError"], target
        wait_until(
            lambda: prometheus.query('otel_dra_collection_duration_seconds_count{job="tls-allowed"}'),
            timeout=30,
            what="exporter series in Prometheus over TLS",
        )

        # The API calls: a TokenReview and a SubjectAccessReview for each token, once; nothing for
        # the token-less scraper or the one that never completes a handshake; then nothing per scrape.
        wait_until(lambda: exporter.authorizer.api_calls == 4, timeout=10, what="4 review calls")
        wait_until(lambda: plugin.metrics_authorizer.api_calls == 4, timeout=10, what="4 review calls (plugin)")
        before = _scrape_count(prometheus)
        wait_until(lambda: _scrape_count(prometheus) >= before + 10, timeout=30, what="5 more scrapes of each")
        assert exporter.authorizer.api_calls == 4 and plugin.metrics_authorizer.api_calls == 4
        assert exporter.authorizer.cache.reviews == 2

        # Rotation: new files (signed by the other CA) are served from the next handshake on.
        old = serial(setup["cert"])
        assert served_serial(exporter.port, setup["ca"]) == old
        cert, key = setup["rotated"]
        for src, name in ((key, "tls.key"), (cert, "tls.crt")):  # as a Secret update: replaced, not edited
            shutil.copy(src, tls_dir / f".{name}.new")
            os.replace(tls_dir / f".{name}.new", tls_dir / name)
        assert served_serial(exporter.port, setup["other_ca"]) == serial(cert)
        assert served_serial(plugin.metrics_port, setup["other_ca"]) == serial(cert)
        # Prometheus trusting the other CA now completes its handshakes (without any restart).
        wait_until(
            lambda: all(t["health"] == "up" for t in _targets(prometheus, "tls-other-ca")),
            timeout=30,
            what="tls-other-ca up after the rotation",
        )
    finally:
        prometheus.set_jobs({})


def _scrape_count(prometheus) -> float:
    samples = prometheus.query('count_over_time(up{job="tls-allowed"}[10m])')
    return sum(float(s["value"][1]) for s in samples)


def test_decisions_seen_by_a_plain_https_client(testbed, start_exporter_app, setup, tls_dir):
    """The same decisions for a client that is not Prometheus, and probes that need no token."""
    exporter = start_exporter_app(str(testbed.kubeconfig), web=_web(tls_dir))
    ctx = ssl.create_default_context(cafile=str(setup["ca"].cert))
    base = f"https://127.0.0.1:{exporter.port}"

    def get(path: str, token: str | None = None) -> int:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            with urllib.request.urlopen(
                urllib.request.Request(base + path, headers=headers), timeout=10, context=ctx
            ) as r:
                return r.status
        except urllib.error.HTTPError as exc:
            return exc.code

    wait_until(lambda: get("/readyz") == 200, timeout=30, what="exporter ready")
    assert get("/healthz") == 200
    assert get("/metrics") == 401
    assert get("/metrics", "not-a-token") == 401
    assert get("/metrics", setup["tokens"]["intruder"].read_text()) == 403
    assert get("/metrics", setup["tokens"]["prometheus"].read_text()) == 200
