"""The chart's config webhook (plugin.configWebhook.enabled) with the real helm CLI and the real API
server: what it renders, that its flags are the CLI's, its TLS (the user's Secret, or a CA and a
certificate the chart makes, kept across upgrades by `lookup`), and that its ServiceAccount gets
nothing. The webhook against the API server: tests/integration/test_webhook.py (with this chart's
rules)."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_dra.cli import build_parser
from otel_dra.cli.webhook import start_webhook
from tests.integration.test_chart import CHART, _apply, _assert_rejected, _by_kind, _helm, render

SETS = ("plugin.configWebhook.enabled=true",)
NAME = "rel-otel-dra-config-webhook"


def _objects(helm: Path, *sets: str, **kwargs: Any) -> dict[str, list[dict]]:
    mine = [d for d in render(helm, *SETS, *sets, **kwargs) if "config-webhook" in d["metadata"]["name"]]
    return _by_kind(mine)


def _container(kinds: dict[str, list[dict]]) -> dict:
    [deploy] = kinds["Deployment"]
    [container] = deploy["spec"]["template"]["spec"]["containers"]
    return container


def _args(kinds: dict[str, list[dict]], monkeypatch: pytest.MonkeyPatch):
    for name in (
        "OTEL_DRA_DRIVER_NAME",
        "OTEL_DRA_OPAQUE_CONFIG",
        "OTEL_DRA_MAX_REVIEW_BYTES",
        "OTEL_DRA_WEBHOOK_PORT",
    ):
        monkeypatch.delenv(name, raising=False)
    return build_parser("webhook").parse_args(_container(kinds)["args"])


def test_off_by_default(helm):
    assert not [d for d in render(helm, "plugin.enabled=true") if "webhook" in d["metadata"]["name"]]


def test_the_deployment_is_as_restricted_as_the_exporters_and_has_no_rbac(helm):
    kinds = _objects(helm, "plugin.enabled=true", "otlp.endpoint=http://collector:4318")
    [deploy] = kinds["Deployment"]
    assert deploy["metadata"]["namespace"] == "monitoring"
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    pod = deploy["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == NAME
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = _container(kinds)
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["resources"]["limits"]["memory"]
    assert container["ports"] == [
        {"name": "https", "containerPort": 8443, "protocol": "TCP"},
        {"name": "metrics", "containerPort": 8080, "protocol": "TCP"},
    ]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "https" and container[probe]["httpGet"]["scheme"] == "HTTPS"
    assert container["volumeMounts"] == [
        {"name": "webhook-tls", "mountPath": "/etc/otel-dra/webhook-tls", "readOnly": True}
    ]
    assert pod["volumes"] == [{"name": "webhook-tls", "secret": {"secretName": f"{NAME}-tls"}}]
    env = {e["name"]: e for e in container["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector:4318"
    assert env["OTEL_SERVICE_NAME"]["value"] == NAME
    assert deploy["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "config-webhook"
    # No token and no rules: the webhook reads nothing from the API server.
    assert pod["automountServiceAccountToken"] is False
    [sa] = kinds["ServiceAccount"]
    assert sa["metadata"]["name"] == NAME and sa["automountServiceAccountToken"] is False
    assert "ClusterRole" not in kinds and "Role" not in kinds
    everything = render(helm, *SETS, "plugin.enabled=true", "bindingController.enabled=true")
    for binding in (d for d in everything if d["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        assert all(s.get("name") != NAME for s in binding.get("subjects", [])), binding["metadata"]["name"]
    [service] = kinds["Service"]
    assert service["spec"]["ports"][0] == {"name": "https", "port": 443, "targetPort": "https", "protocol": "TCP"}
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]


def test_the_webhook_configuration(helm):
    [vwc] = _objects(helm)["ValidatingWebhookConfiguration"]
    [webhook] = vwc["webhooks"]
    assert webhook["name"] == "config.gpu.example.com"
    assert webhook["failurePolicy"] == "Fail" and webhook["timeoutSeconds"] == 5
    assert webhook["sideEffects"] == "None" and webhook["admissionReviewVersions"] == ["v1"]
    assert webhook["clientConfig"]["service"] == {
        "name": NAME,
        "namespace": "monitoring",
        "path": "/validate",
        "port": 443,
    }
    # Claims and templates at creation (their spec is immutable), classes at creation and update.
    assert [(r["resources"], r["operations"]) for r in webhook["rules"]] == [
        (["resourceclaims", "resourceclaimtemplates"], ["CREATE"]),
        (["deviceclasses"], ["CREATE", "UPDATE"]),
    ]
    assert all(r["apiGroups"] == ["resource.k8s.io"] and r["apiVersions"] == ["v1"] for r in webhook["rules"])
    [vwc] = _objects(
        helm,
        "plugin.driverName=npu.acme.io",
        "plugin.configWebhook.failurePolicy=Ignore",
        "plugin.configWebhook.timeoutSeconds=2",
    )["ValidatingWebhookConfiguration"]
    assert vwc["webhooks"][0]["name"] == "config.npu.acme.io"
    assert (vwc["webhooks"][0]["failurePolicy"], vwc["webhooks"][0]["timeoutSeconds"]) == ("Ignore", 2)


def test_values_reach_the_cli(helm, monkeypatch):
    defaults = _args(_objects(helm), monkeypatch)
    cli = build_parser("webhook").parse_args(["webhook"])
    # The chart's defaults are the CLI's, but for the metrics port (the CLI's default is off).
    assert (defaults.driver_name, defaults.opaque_config, defaults.max_review_bytes, defaults.port) == (
        cli.driver_name,
        cli.opaque_config,
        cli.max_review_bytes,
        cli.port,
    )
    assert defaults.metrics_port == 8080 and defaults.log_format == "json"
    assert defaults.tls_cert_file == "/etc/otel-dra/webhook-tls/tls.crt"
    assert defaults.tls_private_key_file == "/etc/otel-dra/webhook-tls/tls.key"
    args = _args(
        _objects(
            helm,
            "plugin.driverName=cpu.acme.io",
            "plugin.deviceProfile=cpu",
            "plugin.configWebhook.port=9443",
            "plugin.configWebhook.maxReviewBytes=65536",
            "plugin.configWebhook.logLevel=debug",
        ),
        monkeypatch,
    )
    assert (args.driver_name, args.opaque_config, args.port, args.max_review_bytes, args.log_level) == (
        "cpu.acme.io",
        "none",
        9443,
        65536,
        "debug",
    )
    assert _args(_objects(helm, "plugin.deviceProfile=net"), monkeypatch).opaque_config == "none"
    assert _args(_objects(helm, "plugin.deviceProfile=gpu-partitionable"), monkeypatch).opaque_config == "GpuConfig"
    # metricsSecurity reaches it; authorization.mode=kubernetes then gives it a token and the review rules.
    kinds = _objects(
        helm,
        "metricsSecurity.tls.enabled=true",
        "metricsSecurity.tls.existingSecret=tls",
        "metricsSecurity.authorization.mode=kubernetes",
    )
    container = _container(kinds)
    assert "--authorization=kubernetes" in container["args"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {
        "/etc/otel-dra/webhook-tls",
        "/etc/otel-dra/web",
        "/etc/otel-dra/tls",
    }
    assert kinds["Deployment"][0]["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    [role] = kinds["ClusterRole"]
    assert {r["resources"][0] for r in role["rules"]} == {"tokenreviews", "subjectaccessreviews"}
    [binding] = kinds["ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": NAME, "namespace": "monitoring"}]


def _openssl(*args: str, input: bytes | None = None) -> str:
    return subprocess.run(["openssl", *args], input=input, capture_output=True, check=True).stdout.decode()


def test_the_generated_certificate_names_the_service_and_is_served(helm, tmp_path):
    kinds = _objects(helm)
    [secret] = kinds["Secret"]
    assert secret["type"] == "kubernetes.io/tls" and secret["metadata"]["name"] == f"{NAME}-tls"
    files = {}
    for key, value in secret["data"].items():
        files[key] = tmp_path / key
        files[key].write_bytes(base64.b64decode(value))
    [vwc] = kinds["ValidatingWebhookConfiguration"]
    assert vwc["webhooks"][0]["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    assert "OK" in _openssl("verify", "-CAfile", str(files["ca.crt"]), str(files["tls.crt"]))
    san = _openssl("x509", "-in", str(files["tls.crt"]), "-noout", "-ext", "subjectAltName").split("\n", 1)[1]
    assert [n.strip() for n in san.split(",")] == [
        f"DNS:{name}"
        for name in (NAME, f"{NAME}.monitoring", f"{NAME}.monitoring.svc", f"{NAME}.monitoring.svc.cluster.local")
    ]
    assert secret["metadata"]["annotations"]["otel-dra/serving-names"] == (
        f"{NAME},{NAME}.monitoring,{NAME}.monitoring.svc,{NAME}.monitoring.svc.cluster.local"
    )
    # The webhook serves it (an RSA key as Helm makes them), verified by the CA the API server gets.
    app = start_webhook(cert_file=str(files["tls.crt"]), key_file=str(files["tls.key"]), address="127.0.0.1", port=0)
    try:
        out = subprocess.run(
            ["openssl", "s_client", "-connect", f"127.0.0.1:{app.port}", "-CAfile", str(files["ca.crt"]),
             "-servername", f"{NAME}.monitoring.svc", "-verify_hostname", f"{NAME}.monitoring.svc", "-verify_return_error"],
            input=b"", capture_output=True, timeout=30,
        )  # fmt: skip
        assert out.returncode == 0 and b"Verify return code: 0 (ok)" in out.stdout, out.stdout[-500:] + out.stderr
    finally:
        app.stop()
    # Each render without a cluster makes a new pair (what `lookup` prevents on upgrades, below).
    [again] = _objects(helm)["Secret"]
    assert again["data"]["tls.crt"] != secret["data"]["tls.crt"]


def test_the_users_secret_and_ca_bundle(helm):
    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").decode()
    kinds = _objects(helm, "plugin.configWebhook.tls.secretName=my-tls", f"plugin.configWebhook.tls.caBundle={ca}")
    assert "Secret" not in kinds
    assert kinds["Deployment"][0]["spec"]["template"]["spec"]["volumes"][0]["secret"] == {"secretName": "my-tls"}
    assert kinds["ValidatingWebhookConfiguration"][0]["webhooks"][0]["clientConfig"]["caBundle"] == ca
    # cert-manager's cainjector fills the bundle: none needed then.
    kinds = _objects(
        helm,
        "plugin.configWebhook.tls.secretName=my-tls",
        "plugin.configWebhook.annotations.cert-manager\\.io/inject-ca-from=monitoring/webhook-cert",
    )
    [vwc] = kinds["ValidatingWebhookConfiguration"]
    assert vwc["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": "monitoring/webhook-cert"}
    assert "caBundle" not in vwc["webhooks"][0]["clientConfig"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["plugin.configWebhook.tls.secretName=my-tls"], "needs plugin.configWebhook.tls.caBundle"),
        (["plugin.configWebhook.tls.caBundle=QUJD"], "tls.caBundle is set but tls.secretName is empty"),
        (["plugin.configWebhook.tls.caBundle=not base64!"], "caBundle"),
        (["plugin.configWebhook.failurePolicy=Sometimes"], "failurePolicy"),
        (["plugin.configWebhook.timeoutSeconds=31"], "timeoutSeconds"),
        (["plugin.configWebhook.maxReviewBytes=10"], "maxReviewBytes"),
        (["plugin.configWebhook.port=8080"], "port and plugin.configWebhook.metricsPort must differ"),
        (["plugin.configWebhook.replicas=0"], "replicas"),
        (["plugin.configWebhook.matchConditions=x"], "additional properties"),
    ],
)
def test_rejections(helm, sets, message):
    _assert_rejected(helm, [*SETS, *sets], message)


def test_server_side_dry_run(helm, testbed):
    """The API server accepts every object (nothing is stored: a webhook with failurePolicy Fail and
    no pods behind it would refuse every other test's claims)."""
    testbed.kubectl("create", "namespace", "monitoring", check=False)
    _apply(
        testbed, render(helm, *SETS, "plugin.enabled=true", "otlp.endpoint=http://collector:4318"), "--dry-run=server"
    )


def _install_dry_run(helm: Path, testbed, namespace: str, *sets: str) -> dict[str, list[dict]]:
    """What `helm install` would create, rendered with the cluster at hand (`lookup` works):
    --dry-run=server stores nothing."""
    args = ["install", "hooked", str(CHART), "--namespace", namespace, "--kubeconfig", str(testbed.kubeconfig),
            "--dry-run=server", "--output", "json"]  # fmt: skip
    for s in (*SETS, *sets):
        args += ["--set", s]
    result = _helm(helm, *args, check=False)
    assert result.returncode == 0, result.stderr
    manifest = json.loads(result.stdout)["manifest"]
    return _by_kind([d for d in yaml.safe_load_all(manifest) if d])


def test_an_upgrade_keeps_the_generated_certificate(helm, testbed):
    namespace = "webhook-lookup"
    testbed.kubectl("create", "namespace", namespace, check=False)
    secret_name = "hooked-otel-dra-config-webhook-tls"
    testbed.kubectl("delete", "secret", secret_name, "-n", namespace, "--ignore-not-found")
    [first] = _install_dry_run(helm, testbed, namespace)["Secret"]
    # Installed: the Secret exists as the chart made it, owned by the release as helm marks it.
    owned = {"meta.helm.sh/release-name": "hooked", "meta.helm.sh/release-namespace": namespace}
    first["metadata"]["annotations"].update(owned)
    _apply(testbed, [first])
    try:
        kinds = _install_dry_run(helm, testbed, namespace)
        [kept] = kinds["Secret"]
        assert kept["data"] == first["data"]  # the same CA, certificate and key
        [vwc] = kinds["ValidatingWebhookConfiguration"]
        assert vwc["webhooks"][0]["clientConfig"]["caBundle"] == first["data"]["ca.crt"]
        checksum = kinds["Deployment"][0]["spec"]["template"]["metadata"]["annotations"]["checksum/tls"]
        assert (
            checksum
            == _install_dry_run(helm, testbed, namespace)["Deployment"][0]["spec"]["template"]["metadata"][
                "annotations"
            ]["checksum/tls"]
        )
        # A Secret made for other names (or not by the chart) is not kept: a new pair, with new names.
        stale = {**first, "metadata": {**first["metadata"], "annotations": {**owned, "otel-dra/serving-names": "old"}}}
        _apply(testbed, [stale])
        [renewed] = _install_dry_run(helm, testbed, namespace)["Secret"]
        assert renewed["data"]["tls.crt"] != first["data"]["tls.crt"]
        assert renewed["data"]["ca.crt"] != first["data"]["ca.crt"]
    finally:
        testbed.kubectl("delete", "secret", secret_name, "-n", namespace, "--ignore-not-found")
