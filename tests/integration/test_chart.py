"""The Helm chart with the real helm CLI and the real API server (server-side dry-run, RBAC)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from otel_dra.testbed.build import BinariesMissingError, build_helm, find_helm, prometheus_operator_crds
from tests.helpers import wait_until

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "otel-dra"
KUBE_VERSION = "1.34.0"
PROD_VALUES = CHART / "prod-values.yaml"


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return find_helm()
    except BinariesMissingError:
        return build_helm()


def _helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, check=check)


def render(
    helm: Path, *sets: str, release: str = "rel", namespace: str = "monitoring", values: list[Path] | None = None
) -> list[dict]:
    args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
    for file in values or []:
        args += ["-f", str(file)]
    for s in sets:
        args += ["--set", s]
    out = _helm(helm, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _by_kind(docs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for d in docs:
        out.setdefault(d["kind"], []).append(d)
    return out


def test_lint_strict(helm):
    result = _helm(helm, "lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_default_render_is_secure_and_least_privilege(helm):
    kinds = _by_kind(render(helm))
    assert set(kinds) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service"}
    [role] = kinds["ClusterRole"]
    assert role["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceclaims", "resourceslices", "deviceclasses"],
            "verbs": ["list", "watch"],
        }
    ]
    [deploy] = kinds["Deployment"]
    assert deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = deploy["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [container] = pod["containers"]
    assert container["image"] == "ghcr.io/otel-dra/otel-dra:0.1.0"  # empty tag -> appVersion
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["limits"]["memory"]
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    [svc] = kinds["Service"]
    assert svc["spec"]["ports"][0]["name"] == "http" and svc["spec"]["ports"][0]["port"] == 8080


def test_sharded_mode_is_a_statefulset_whose_ordinal_picks_the_shard(helm):
    kinds = _by_kind(render(helm, "sharding.enabled=true", "sharding.shards=3"))
    assert "Deployment" not in kinds
    [sts] = kinds["StatefulSet"]
    assert sts["spec"]["replicas"] == 3
    [container] = sts["spec"]["template"]["spec"]["containers"]
    assert "--shard=auto" in container["args"] and "--total-shards=3" in container["args"]
    pod_name = next(e for e in container["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    headless = [s for s in kinds["Service"] if s["spec"].get("clusterIP") == "None"]
    assert headless and sts["spec"]["serviceName"] == headless[0]["metadata"]["name"]


def test_otlp_values_become_otel_env(helm):
    [deploy] = _by_kind(
        render(helm, "otlp.endpoint=http://collector:4317", "otlp.protocol=grpc", "image.digest=sha256:" + "a" * 64)
    )["Deployment"]
    [container] = deploy["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert container["image"] == "ghcr.io/otel-dra/otel-dra@sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["unknownKey=1"], "additional properties"),
        (["rbac.useClusterRole=false"], "useClusterRole=false is not supported"),
        (["image.digest=latest"], "digest"),
        (["sharding.shards=0"], "shards"),
        (["exporter.logFormat=xml"], "logFormat"),
    ],
)
def test_schema_rejections(helm, sets, message):
    _assert_rejected(helm, sets, message)


def _assert_rejected(helm: Path, sets: list[str], message: str) -> None:
    args = ["template", "rel", str(CHART), "--kube-version", KUBE_VERSION]
    for s in sets:
        args += ["--set", s]
    result = _helm(helm, *args, check=False)
    assert result.returncode != 0, "helm accepted values it should reject"
    assert message.lower() in result.stderr.lower(), result.stderr


def _apply(testbed, docs: list[dict], *extra: str):
    return testbed.kubectl("apply", *extra, "-f", "-", input=yaml.safe_dump_all(docs))


@pytest.fixture(scope="module")
def operator_crds(testbed):
    """The prometheus-operator CRDs (ServiceMonitor, PodMonitor, PrometheusRule) in the testbed."""
    for crd in prometheus_operator_crds():
        testbed.kubectl("apply", "--server-side", "-f", str(crd))
    testbed.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/servicemonitors.monitoring.coreos.com",
        "crd/podmonitors.monitoring.coreos.com",
        "crd/prometheusrules.monitoring.coreos.com",
    )


@pytest.mark.parametrize(
    "profile",
    [
        {"sets": []},
        {"sets": ["sharding.enabled=true", "sharding.shards=4", "podMonitor.enabled=true"]},
        {"values": True},
        {
            "sets": [
                "serviceMonitor.enabled=true",
                "prometheusRule.enabled=true",
                "networkPolicy.enabled=true",
                "podDisruptionBudget.enabled=true",
                "otlp.endpoint=http://collector:4318",
            ]
        },
    ],
)
def test_server_side_dry_run(helm, testbed, operator_crds, profile):
    testbed.kubectl("create", "namespace", "monitoring", check=False)
    docs = render(helm, *profile.get("sets", []), values=[PROD_VALUES] if profile.get("values") else None)
    _apply(testbed, docs, "--dry-run=server")


def test_chart_serviceaccount_can_exactly_what_the_exporter_needs(helm, testbed, start_exporter_app):
    testbed.kubectl("create", "namespace", "dra-monitoring", check=False)
    _apply(testbed, render(helm, release="rbac", namespace="dra-monitoring"))
    sa = "system:serviceaccount:dra-monitoring:rbac-otel-dra"

    def can(verb: str, resource: str) -> bool:
        result = testbed.kubectl("auth", "can-i", verb, resource, "--as", sa, "--all-namespaces", check=False)
        return result.stdout.strip() == "yes"

    for resource in (
        "resourceclaims.resource.k8s.io",
        "resourceslices.resource.k8s.io",
        "deviceclasses.resource.k8s.io",
    ):
        assert can("list", resource) and can("watch", resource)
        assert not can("get", resource) and not can("create", resource) and not can("delete", resource)
    assert (
        not can("list", "pods")
        and not can("list", "secrets")
        and not can("list", "resourceclaimtemplates.resource.k8s.io")
    )
    # And it is enough: the exporter runs with that ServiceAccount's token.
    token = testbed.mint_token("dra-monitoring", "rbac-otel-dra")
    kubeconfig = testbed.write_kubeconfig(testbed.dir / "chart-sa.kubeconfig", token)
    app = start_exporter_app(str(kubeconfig))
    wait_until(lambda: app.state.not_synced() is None, what="sync as the chart's ServiceAccount")


def _render_with(helm: Path, *sets: str) -> dict[str, list[dict]]:
    return _by_kind(render(helm, *sets))


def test_monitors_rules_networkpolicy_pdb(helm):
    kinds = _render_with(
        helm,
        "serviceMonitor.enabled=true",
        "prometheusRule.enabled=true",
        "networkPolicy.enabled=true",
        "podDisruptionBudget.enabled=true",
    )
    [sm] = kinds["ServiceMonitor"]
    assert sm["spec"]["endpoints"][0]["port"] == "http"
    [rule] = kinds["PrometheusRule"]
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    records = {r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}
    assert records == {
        "namespace:kube_resourceclaim_hourly_cost:sum",
        "deviceclass:kube_resourceclaim_hourly_cost:sum",
        "namespace:kube_resourceclaim_unpriced_devices:sum",
    }
    assert alerts == {
        "OtelDraExporterNotSynced",
        "DRADriverPrepareErrors",
        "DRADriverPrepareLatencyHigh",
        "DRADriverKubeAPIServerErrors",
        "DRADriverFatalBackgroundErrors",
    }
    [np] = kinds["NetworkPolicy"]
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert np["spec"]["ingress"][0]["ports"] == [{"port": "http", "protocol": "TCP"}]
    egress_ports = {(p["port"], p["protocol"]) for r in np["spec"]["egress"] for p in r["ports"]}
    assert egress_ports == {(443, "TCP"), (6443, "TCP"), (53, "UDP"), (53, "TCP")}
    [pdb] = kinds["PodDisruptionBudget"]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": pdb["spec"]["selector"]}
    assert "PodMonitor" not in _render_with(helm, "serviceMonitor.enabled=true")
    [pm] = _render_with(helm, "podMonitor.enabled=true")["PodMonitor"]
    assert pm["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["replacement"] == "rel-otel-dra"


def test_networkpolicy_empty_lists_deny(helm):
    [np] = _render_with(helm, "networkPolicy.enabled=true", "networkPolicy.ingress=null", "networkPolicy.egress=null")[
        "NetworkPolicy"
    ]
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert not np["spec"].get("ingress") and not np["spec"].get("egress")


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        (["podDisruptionBudget.minAvailable=0", "podDisruptionBudget.maxUnavailable=null"], {"minAvailable": 0}),
        (["podDisruptionBudget.maxUnavailable=50%"], {"maxUnavailable": "50%"}),
        (["podDisruptionBudget.maxUnavailable=0"], {"maxUnavailable": 0}),
    ],
)
def test_pdb_forms(helm, sets, expected):
    [pdb] = _render_with(helm, "podDisruptionBudget.enabled=true", *sets)["PodDisruptionBudget"]
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == expected


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["serviceMonitor.enabled=true", "podMonitor.enabled=true"], "mutually exclusive"),
        (["podDisruptionBudget.enabled=true", "podDisruptionBudget.minAvailable=1"], "exactly one"),
        (["podDisruptionBudget.maxUnavailable=150%"], "maxUnavailable"),
        (["serviceMonitor.interval=often"], "interval"),
    ],
)
def test_more_rejections(helm, sets, message):
    _assert_rejected(helm, sets, message)


def test_prod_values_profile(helm):
    kinds = _by_kind(render(helm, values=[PROD_VALUES]))
    assert {"ServiceMonitor", "PrometheusRule", "NetworkPolicy", "PodDisruptionBudget", "Deployment"} <= set(kinds)
    [deploy] = kinds["Deployment"]
    assert deploy["spec"]["replicas"] == 2
    assert kinds["PodDisruptionBudget"][0]["spec"]["minAvailable"] == 1


def test_alert_rules_pass_promtool(helm, tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is needed (Debian package `prometheus`; .ci/run installs it)"
    [rule] = _render_with(helm, "prometheusRule.enabled=true")["PrometheusRule"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
    check = subprocess.run([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    # The alerts, and the recording rules for cost attribution.
    for name in ("alerts_test.yaml", "recording_test.yaml"):
        shutil.copy(Path(__file__).parents[1] / "promtool" / name, tmp_path / name)
        test = subprocess.run([promtool, "test", "rules", name], cwd=tmp_path, capture_output=True, text=True)
        assert test.returncode == 0, name + ": " + test.stdout + test.stderr


def test_plain_manifests_match_the_chart(helm):
    from tests.render_manifests import OUT, PROFILES
    from tests.render_manifests import render as render_profile

    for name, extra in PROFILES.items():
        assert (OUT / name).read_text() == render_profile(helm, extra), (
            f"deploy/manifests/{name} is stale: make manifests"
        )
