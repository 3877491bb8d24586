"""The chart's metricsSecurity values: what they render, that the exporter's and the plugin's CLIs
accept it (the web config file through the real parser), the monitors' https settings, the RBAC, a
server-side dry run, and the chart's roles doing their job against the real API server."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from otel_dra.cli import build_parser
from otel_dra.cli.web import WebOptions
from otel_dra.telemetry.webconfig import load_web_config
from tests.helpers import wait_until
from tests.integration.test_chart import (
    _apply,
    _assert_rejected,
    _by_kind,
    _exporter_container,
    _parse_with_cli,
    operator_crds,  # noqa: F401 (a fixture)
    render,
)
from tests.pki import make_ca

SECURE = [
    "metricsSecurity.tls.enabled=true",
    "metricsSecurity.tls.existingSecret=metrics-tls",
    "metricsSecurity.authorization.mode=kubernetes",
    "metricsSecurity.headers.X-Frame-Options=deny",
]
REVIEW_RULES = [
    {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]},
    {"apiGroups": ["authorization.k8s.io"], "resources": ["subjectaccessreviews"], "verbs": ["create"]},
]


def _roles(kinds: dict[str, list[dict]]) -> dict[str, dict]:
    return {r["metadata"]["name"]: r for r in kinds.get("ClusterRole", [])}


def _plugin_container(kinds: dict[str, list[dict]]) -> dict:
    [ds] = kinds["DaemonSet"]
    [container] = ds["spec"]["template"]["spec"]["containers"]
    return container


def test_off_by_default_and_nothing_rendered(helm):
    kinds = _by_kind(render(helm, "plugin.enabled=true", "serviceMonitor.enabled=true"))
    assert (
        not [c for c in kinds["ConfigMap"] if "web-config" in c["metadata"]["name"]] if "ConfigMap" in kinds else True
    )
    roles = _roles(kinds)
    assert "rel-otel-dra-metrics-reader" not in roles
    for role in roles.values():
        assert not [r for r in role["rules"] if set(r.get("resources", [])) & {"tokenreviews", "subjectaccessreviews"}]
    for sm in kinds["ServiceMonitor"]:
        endpoint = sm["spec"]["endpoints"][0]
        assert "scheme" not in endpoint and "tlsConfig" not in endpoint and "bearerTokenFile" not in endpoint
    container = _exporter_container(render(helm))
    assert not [a for a in container["args"] if a.startswith(("--web-config-file", "--authorization"))]
    assert "scheme" not in container["livenessProbe"]["httpGet"]


def test_secure_values_reach_both_clis_and_the_web_config_parses(helm, monkeypatch, tmp_path):
    docs = render(helm, *SECURE, "metricsSecurity.tls.minVersion=TLS13", "plugin.enabled=true")
    kinds = _by_kind(docs)
    exporter = _exporter_container(docs)
    args = _parse_with_cli(exporter, monkeypatch)
    assert args.web_config_file == "/etc/otel-dra/web/web-config.yml"
    assert (args.authorization, args.authorization_allow_ttl, args.authorization_deny_ttl) == ("kubernetes", 120, 30)
    assert exporter["livenessProbe"]["httpGet"]["scheme"] == exporter["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    mounts = {m["name"]: m["mountPath"] for m in exporter["volumeMounts"]}
    assert mounts == {"web-config": "/etc/otel-dra/web", "metrics-tls": "/etc/otel-dra/tls"}
    [deployment] = kinds["Deployment"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["metrics-tls"]["secret"] == {"secretName": "metrics-tls"}  # whole directory: renewals show
    plugin = _plugin_container(kinds)
    plugin_args = [a.replace("$(NODE_NAME)", "node-1") for a in plugin["args"]]
    parsed = build_parser().parse_args(plugin_args)
    assert parsed.web_config_file == args.web_config_file and parsed.authorization == "kubernetes"
    assert {m["name"] for m in plugin["volumeMounts"]} >= {"web-config", "metrics-tls"}
    # The rendered file, with the Secret's files put where it points, passes the real parser.
    [web] = [c for c in kinds["ConfigMap"] if c["metadata"]["name"] == "rel-otel-dra-web-config"]
    text = web["data"]["web-config.yml"]
    ca = make_ca(tmp_path, "ca")
    cert, key = ca.issue("tls")
    text = text.replace("/etc/otel-dra/tls/tls.crt", str(cert)).replace("/etc/otel-dra/tls/tls.key", str(key))
    (tmp_path / "web.yml").write_text(text)
    config = load_web_config(tmp_path / "web.yml")
    assert config.tls is not None and config.tls.min_version == ssl.TLSVersion.TLSv1_3
    assert config.headers == {"X-Frame-Options": "deny"}


def test_rbac_follows_the_authorization_mode(helm):
    roles = _roles(_by_kind(render(helm, *SECURE, "plugin.enabled=true")))
    for name in ("rel-otel-dra", "rel-otel-dra-kubeletplugin"):
        assert roles[name]["rules"][-2:] == REVIEW_RULES, name
    assert roles["rel-otel-dra-metrics-reader"]["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    kinds = _by_kind(
        render(
            helm,
            *SECURE,
            "metricsSecurity.scraper.serviceAccounts[0].name=prometheus-k8s",
            "metricsSecurity.scraper.serviceAccounts[0].namespace=monitoring",
        )
    )
    [binding] = [b for b in kinds["ClusterRoleBinding"] if b["metadata"]["name"] == "rel-otel-dra-metrics-reader"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "prometheus-k8s", "namespace": "monitoring"}]
    # TLS alone: no review rules, no reader role.
    roles = _roles(_by_kind(render(helm, *SECURE[:2])))
    assert "rel-otel-dra-metrics-reader" not in roles and roles["rel-otel-dra"]["rules"][-1] != REVIEW_RULES[-1]


def test_monitors_switch_to_https_with_ca_server_name_and_token(helm):
    kinds = _by_kind(render(helm, *SECURE, "plugin.enabled=true", "serviceMonitor.enabled=true"))
    monitors = {m["metadata"]["name"]: m["spec"]["endpoints"][0] for m in kinds["ServiceMonitor"]}
    for name, server in (
        ("rel-otel-dra", "rel-otel-dra.monitoring.svc"),
        ("rel-otel-dra-kubeletplugin", "rel-kubeletplugin-metrics.monitoring.svc"),
    ):
        endpoint = monitors[name]
        assert endpoint["scheme"] == "https"
        assert endpoint["tlsConfig"] == {
            "serverName": server,
            "ca": {"secret": {"name": "metrics-tls", "key": "ca.crt"}},
        }
        assert endpoint["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    kinds = _by_kind(
        render(helm, *SECURE, "podMonitor.enabled=true", "metricsSecurity.scraper.tokenSecret.name=prom-token")
    )
    [pm] = kinds["PodMonitor"]
    endpoint = pm["spec"]["podMetricsEndpoints"][0]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "prom-token", "key": "token"}}
    assert "bearerTokenFile" not in endpoint and endpoint["scheme"] == "https"


def test_cert_manager_certificate_names_every_service(helm):
    kinds = _by_kind(
        render(
            helm,
            "metricsSecurity.tls.enabled=true",
            "metricsSecurity.tls.certManager.enabled=true",
            "metricsSecurity.tls.certManager.issuerRef.name=cluster-ca",
            "metricsSecurity.tls.certManager.issuerRef.kind=ClusterIssuer",
            "plugin.enabled=true",
            "sharding.enabled=true",
        )
    )
    [cert] = kinds["Certificate"]
    assert cert["spec"]["secretName"] == "rel-otel-dra-metrics-tls"
    assert cert["spec"]["issuerRef"] == {"name": "cluster-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}
    for service in ("rel-otel-dra", "rel-otel-dra-shards", "rel-kubeletplugin-metrics"):
        assert f"{service}.monitoring.svc" in cert["spec"]["dnsNames"]
    [sts] = kinds["StatefulSet"]
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    assert volumes["metrics-tls"]["secret"]["secretName"] == "rel-otel-dra-metrics-tls"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["metricsSecurity.tls.enabled=true"], "needs metricsSecurity.tls.existingSecret"),
        (
            ["metricsSecurity.tls.enabled=true", "metricsSecurity.tls.certManager.enabled=true"],
            "needs metricsSecurity.tls.certManager.issuerRef.name",
        ),
        (
            [
                *SECURE,
                "metricsSecurity.tls.certManager.enabled=true",
                "metricsSecurity.tls.certManager.issuerRef.name=x",
            ],
            "mutually exclusive",
        ),
        (["metricsSecurity.tls.certManager.enabled=true"], "needs metricsSecurity.tls.enabled"),
        ([*SECURE, "podMonitor.enabled=true"], "needs metricsSecurity.scraper.tokenSecret.name"),
        (["metricsSecurity.tls.minVersion=TLS10"], "minVersion"),
        (["metricsSecurity.tls.cipherSuites[0]=TLS_RSA_WITH_RC4_128_SHA"], "cipherSuites"),
        (["metricsSecurity.headers.X-Powered-By=otel"], "additional properties"),
        (["metricsSecurity.headers.X-Frame-Options=allow"], "X-Frame-Options"),
        (["metricsSecurity.authorization.mode=rbac"], "mode"),
        (["metricsSecurity.authorization.allowTTL=0"], "allowTTL"),
    ],
)
def test_metrics_security_rejections(helm, sets, message):
    _assert_rejected(helm, sets, message)


@pytest.mark.usefixtures("operator_crds")
def test_server_side_dry_run_with_metrics_security(helm, testbed):
    testbed.kubectl("create", "namespace", "monitoring", check=False)
    docs = render(
        helm,
        *SECURE,
        "plugin.enabled=true",
        "serviceMonitor.enabled=true",
        "metricsSecurity.scraper.serviceAccounts[0].name=prometheus-k8s",
        "metricsSecurity.scraper.serviceAccounts[0].namespace=monitoring",
    )
    _apply(testbed, docs, "--dry-run=server")
    docs = render(helm, *SECURE, "podMonitor.enabled=true", "metricsSecurity.scraper.tokenSecret.name=prom-token")
    _apply(testbed, docs, "--dry-run=server")


def test_the_chart_roles_let_the_exporter_review_and_the_scraper_read(
    helm, testbed, start_exporter_app, monkeypatch, tmp_path
):
    """Applied to the real API server: the exporter's ServiceAccount may create the reviews (only
    with authorization on), the ServiceAccount named in scraper.serviceAccounts may get /metrics,
    and an exporter running as the chart's ServiceAccount lets that scraper in and no one else."""
    ns = "dra-metrics-authz"
    testbed.kubectl("create", "namespace", ns, check=False)
    for account in ("scraper", "stranger"):
        testbed.kubectl("create", "serviceaccount", account, f"--namespace={ns}", check=False)
    docs = render(
        helm,
        *SECURE,
        release="authz",
        namespace=ns,
        values=[_scraper_values(tmp_path, ns)],
    )
    rbac = [d for d in docs if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
    _apply(testbed, rbac)
    exporter_sa = f"system:serviceaccount:{ns}:authz-otel-dra"

    def can(who: str, *what: str) -> bool:
        return testbed.kubectl("auth", "can-i", *what, "--as", who, check=False).stdout.strip() == "yes"

    assert can(exporter_sa, "create", "tokenreviews.authentication.k8s.io")
    assert can(exporter_sa, "create", "subjectaccessreviews.authorization.k8s.io")
    assert not can(exporter_sa, "get", "/metrics")
    assert can(f"system:serviceaccount:{ns}:scraper", "get", "/metrics")
    assert not can(f"system:serviceaccount:{ns}:stranger", "get", "/metrics")

    token = testbed.mint_token(ns, "authz-otel-dra")
    kubeconfig = testbed.write_kubeconfig(tmp_path / "exporter-sa.kubeconfig", token)
    ca = make_ca(tmp_path / "pki", "ca")
    cert, key = ca.issue("exporter")
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}}))
    app = start_exporter_app(str(kubeconfig), web=WebOptions(load_web_config(web), "kubernetes"))
    ctx = ssl.create_default_context(cafile=str(ca.cert))

    def get(path: str, token: str | None = None) -> int:
        request = urllib.request.Request(
            f"https://127.0.0.1:{app.port}{path}", headers={"Authorization": f"Bearer {token}"} if token else {}
        )
        try:
            with urllib.request.urlopen(request, timeout=10, context=ctx) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    wait_until(lambda: get("/readyz") == 200, timeout=30, what="exporter ready as the chart's ServiceAccount")
    assert get("/metrics", testbed.mint_token(ns, "scraper")) == 200
    assert get("/metrics", testbed.mint_token(ns, "stranger")) == 403
    assert get("/metrics") == 401


def _scraper_values(tmp_path: Path, ns: str) -> Path:
    path = tmp_path / "scraper-values.yaml"
    path.write_text(
        yaml.safe_dump({"metricsSecurity": {"scraper": {"serviceAccounts": [{"name": "scraper", "namespace": ns}]}}})
    )
    return path
