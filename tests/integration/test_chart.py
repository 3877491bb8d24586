"""The Helm chart with the real helm CLI and the real API server (server-side dry-run, RBAC)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from opentelemetry.sdk.metrics import MeterProvider

from otel_dra.cli import build_parser
from otel_dra.cluster.exporter import ClusterState
from otel_dra.cluster.resourceslice import DEFAULT_DEVICE_ATTRIBUTES, MAX_DEVICE_ATTRIBUTES
from otel_dra.cluster.selection import EVERYTHING
from otel_dra.testbed.build import prometheus_operator_crds
from tests.helpers import SEED_FAMILIES, scrape, wait_until

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "otel-dra"
KUBE_VERSION = "1.34.0"
PROD_VALUES = CHART / "prod-values.yaml"
# The seven seed families only, as docs/metrics.md ("Choosing families") writes the allowlist.
SEED_ONLY = [
    "kube_resourceclaim_status_(allocated_device|reserved_for_pod|reserved_total)",
    "kube_resourceslice_device_capacity_(memory_bytes|multiprocessors|decoders)",
    "kube_deviceclass_hourly_cost",
]


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
    dra_rule = {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceclaims", "resourceslices", "deviceclasses", "devicetaintrules"],
        "verbs": ["list", "watch"],
    }
    assert role["rules"] == [dra_rule, {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    # Without the pod watch, the role does not ask for pods.
    [no_pods] = _by_kind(render(helm, "exporter.watchPods=false"))["ClusterRole"]
    assert no_pods["rules"] == [dra_rule]
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
        (["exporter.staleAfter=86400"], "staleAfter"),  # the CLI wants < 86400
        (
            ["exporter.deviceAttributes={" + ",".join(f"a{i}" for i in range(MAX_DEVICE_ATTRIBUTES + 1)) + "}"],
            "maxItems",
        ),
        (["exporter.deviceAttributes={type,1bad}"], "'1bad' does not match pattern"),
        (["exporter.deviceAttributes={type,gpu.nvidia.com/product-name}"], "does not match pattern"),
        (["exporter.deviceAttributes={type,type}"], "deviceAttributes"),
        (
            ["exporter.deviceAttributes={productName,gpu.nvidia.com/productName}"],
            "both become the label attribute_product_name",
        ),
        (["exporter.deviceAttributes=type"], "deviceAttributes"),  # a string, not a list
        (["exporter.leakGracePeriod=0"], "leakGracePeriod"),
        (["exporter.leakGracePeriod=-5"], "leakGracePeriod"),
        (["exporter.leakGracePeriod=86400"], "leakGracePeriod"),
        (["exporter.leakGracePeriod=10m"], "leakGracePeriod"),
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
        {"sets": ["namespace=dra-elsewhere", "networkPolicy.enabled=true", "podDisruptionBudget.enabled=true"]},
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
    testbed.kubectl("create", "namespace", "dra-elsewhere", check=False)
    docs = render(helm, *profile.get("sets", []), values=[PROD_VALUES] if profile.get("values") else None)
    _apply(testbed, docs, "--dry-run=server")


@pytest.mark.parametrize(
    ("release", "exporter", "watches_pods"),
    [("rbac", {}, True), ("rbac-seed", {"metricAllowlist": SEED_ONLY}, False)],
    ids=["defaults", "seed-only"],
)
def test_chart_serviceaccount_can_exactly_what_the_exporter_needs(
    helm, testbed, start_exporter_app, monkeypatch, tmp_path, caplog, release, exporter, watches_pods
):
    testbed.kubectl("create", "namespace", "dra-monitoring", check=False)
    docs = render(helm, release=release, namespace="dra-monitoring", values=[_values_file(tmp_path, exporter)])
    _apply(testbed, docs)
    sa = f"system:serviceaccount:dra-monitoring:{release}-otel-dra"

    def can(verb: str, resource: str) -> bool:
        result = testbed.kubectl("auth", "can-i", verb, resource, "--as", sa, "--all-namespaces", check=False)
        return result.stdout.strip() == "yes"

    for resource in (
        "resourceclaims.resource.k8s.io",
        "resourceslices.resource.k8s.io",
        "deviceclasses.resource.k8s.io",
        # devicetaintrules: not served by this API server (alpha, needs the scheduler's testbed),
        # so `can-i` cannot resolve it; the rendered rule is checked in the render test.
    ):
        assert can("list", resource) and can("watch", resource)
        assert not can("get", resource) and not can("create", resource) and not can("delete", resource)
    # Pods: list and watch only, and only when the exporter watches them (exporter.watchPods, on by
    # default, and a served kube_pod_* family: the seed families read no pods).
    assert can("list", "pods") is can("watch", "pods") is watches_pods
    assert not can("get", "pods") and not can("delete", "pods")
    assert not can("list", "secrets") and not can("list", "resourceclaimtemplates.resource.k8s.io")
    # And it is enough: the exporter runs with that ServiceAccount's token and the rendered flags.
    args = _parse_with_cli(_exporter_container(docs), monkeypatch)
    token = testbed.mint_token("dra-monitoring", f"{release}-otel-dra")
    kubeconfig = testbed.write_kubeconfig(testbed.dir / f"{release}-sa.kubeconfig", token)
    caplog.set_level(logging.INFO)
    app = start_exporter_app(
        str(kubeconfig),
        families=args.metric_allowlist or args.metric_denylist,
        watch_pods=args.watch_pods,
        device_attributes=args.device_attributes,
        leak_grace=args.leak_grace_period,
    )
    wait_until(lambda: app.state.not_synced() is None, what="sync as the chart's ServiceAccount")
    pods = [r for r in app.state.reflectors if r.resource.plural == "pods"]
    if watches_pods:
        assert [r.state().unavailable for r in pods] == [None]  # watched, not forbidden
    else:
        assert pods == [] and app.state.pods is None  # not even tried
    assert not [r.getMessage() for r in caplog.records if "forbidden" in r.getMessage()]
    code, body = scrape(app.port)
    assert code == 200, body
    served = set(re.findall(r"^# TYPE (kube_\w+) ", body, re.MULTILINE))
    if not watches_pods:
        assert served == set(SEED_FAMILIES)


@pytest.mark.parametrize(
    ("exporter", "pods"),
    [
        ({}, True),
        ({"metricAllowlist": SEED_ONLY}, False),
        ({"metricAllowlist": [*SEED_ONLY, "kube_pod_.*"]}, True),
        ({"metricAllowlist": ["kube_pod_resourceclaim_device_health"]}, True),
        ({"metricAllowlist": ["  kube_pod_resourceclaim_info "]}, True),  # trimmed, as the exporter does
        ({"metricAllowlist": [*SEED_ONLY, "kube_pod_resourceclaim"]}, False),  # full match: not a prefix
        ({"metricAllowlist": ["kube_pod_(?=resourceclaim_info).+"]}, True),  # not RE2: granted, not missed
        ({"metricDenylist": ["kube_pod_.*"]}, False),
        ({"metricDenylist": ["kube_pod_resourceclaim_(info|device_health)"]}, False),
        ({"metricDenylist": ["kube_pod_resourceclaim_info"]}, True),
        ({"metricDenylist": ["kube_pod_resourceclaim", "kube_deviceclass_info"]}, True),
        ({"watchPods": False}, False),
        ({"watchPods": False, "metricAllowlist": ["kube_pod_.*"]}, False),
    ],
)
def test_the_role_asks_for_pods_only_when_the_exporter_watches_them(helm, monkeypatch, tmp_path, exporter, pods):
    docs = render(helm, values=[_values_file(tmp_path, exporter)])
    [role] = _by_kind(docs)["ClusterRole"]
    pod_rules = [r for r in role["rules"] if "pods" in r["resources"]]
    assert pod_rules == ([{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}] if pods else [])
    # The exporter decides the same from the rendered flags (--watch-pods stays exporter.watchPods:
    # with no pod family served the exporter does not watch pods whatever it says).
    args = _parse_with_cli(_exporter_container(docs), monkeypatch)
    assert args.watch_pods is exporter.get("watchPods", True)
    families = args.metric_allowlist or args.metric_denylist or EVERYTHING
    state = ClusterState(object(), MeterProvider(), families=families, pods=args.watch_pods)  # type: ignore[arg-type]
    assert (state.pods is not None) is pods


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
        "DRADeviceUnhealthyWhileAllocated",
        "DRAPodSeesUnhealthyDevice",
        "OtelDraTracingSpansDropped",
        "DRAClaimAllocationSlow",
        "DRAPodStartupSlow",
        "DRAClaimBindingFailures",
        "DRAClaimAllocationToPreparedSlow",
    }
    [device_alert] = [
        r for g in rule["spec"]["groups"] for r in g["rules"] if r.get("alert") == "DRADeviceUnhealthyWhileAllocated"
    ]
    assert device_alert["for"] == "10m"  # prometheusRule.thresholds.unhealthyDeviceMinutes
    # Every %PLACEHOLDER% of files/alerts.yaml is substituted, and a threshold set is the one used.
    assert not re.search(r"%[A-Z0-9_]+%", yaml.safe_dump(rule["spec"]))
    [tuned] = _render_with(
        helm,
        "prometheusRule.enabled=true",
        "prometheusRule.thresholds.claimAllocationP90Seconds=90",
        "prometheusRule.thresholds.latencyMinSamples=3",
    )["PrometheusRule"]
    [allocation] = [
        r for g in tuned["spec"]["groups"] for r in g["rules"] if r.get("alert") == "DRAClaimAllocationSlow"
    ]
    assert allocation["expr"].rstrip().endswith(") > 90") and ">= 3\n" in allocation["expr"]
    [np] = kinds["NetworkPolicy"]
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    # As the kube-dra-exporter chart: only Prometheus pods of the exporter's own namespace (a peer
    # with a podSelector and no namespaceSelector selects pods in the policy's namespace).
    assert np["spec"]["ingress"] == [
        {
            "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
            "ports": [{"port": "http", "protocol": "TCP"}],
        }
    ]
    assert np["metadata"]["namespace"] == "monitoring"
    egress_ports = {(p["port"], p["protocol"]) for r in np["spec"]["egress"] for p in r["ports"]}
    assert egress_ports == {(443, "TCP"), (6443, "TCP"), (53, "UDP"), (53, "TCP")}
    assert all("to" not in r for r in np["spec"]["egress"])  # any destination
    [pdb] = kinds["PodDisruptionBudget"]
    assert pdb["spec"] == {"minAvailable": 1, "selector": pdb["spec"]["selector"]}  # the seed's default
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
        ([], {"minAvailable": 1}),
        (["podDisruptionBudget.minAvailable=0"], {"minAvailable": 0}),
        (["podDisruptionBudget.minAvailable=2"], {"minAvailable": 2}),
        (["podDisruptionBudget.minAvailable=50%"], {"minAvailable": "50%"}),
        (["podDisruptionBudget.maxUnavailable=50%"], {"maxUnavailable": "50%"}),
        (["podDisruptionBudget.maxUnavailable=0"], {"maxUnavailable": 0}),
        (["podDisruptionBudget.maxUnavailable=1"], {"maxUnavailable": 1}),
    ],
)
def test_pdb_forms(helm, sets, expected):
    [pdb] = _render_with(helm, "podDisruptionBudget.enabled=true", *sets)["PodDisruptionBudget"]
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == expected


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["serviceMonitor.enabled=true", "podMonitor.enabled=true"], "mutually exclusive"),
        (
            [
                "podDisruptionBudget.enabled=true",
                "podDisruptionBudget.minAvailable=1",
                "podDisruptionBudget.maxUnavailable=1",
            ],
            "not both",
        ),
        (["rbac.useExistingRole=true"], "needs rbac.existingRoleName"),
        (["rbac.useExistingRole=a", "rbac.existingRoleName=b"], "name different ClusterRoles"),
        (["rbac.useExistingRole=a/b"], "useExistingRole"),
        (["namespace=Not_A_Namespace"], "namespace"),
        (["extraArgs={--port=9090}"], "extraArgs is not supported"),
        (["featureGates.Foo=true"], "featureGates is not supported"),
        (["maxConcurrentChallenges=60"], "maxConcurrentChallenges is an obsolete option"),
        (["extraVolumeMounts[0].name=x"], "mountPath"),
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
    # The production profile opens the policy to Prometheus pods of the monitoring namespace, in
    # one `from` item (both selectors must match), whatever namespace the exporter runs in.
    [np] = _by_kind(render(helm, namespace="exporter", values=[PROD_VALUES]))["NetworkPolicy"]
    assert np["metadata"]["namespace"] == "exporter"
    assert np["spec"]["ingress"] == [
        {
            "from": [
                {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                }
            ],
            "ports": [{"port": "http", "protocol": "TCP"}],
        }
    ]
    # Shipped profiles leave the image tag to appVersion and pin no digest (the seed's release rule).
    assert _exporter_container(render(helm, values=[PROD_VALUES]))["image"] == "ghcr.io/otel-dra/otel-dra:0.1.0"
    [plugin] = kinds["DaemonSet"]
    assert plugin["spec"]["template"]["spec"]["priorityClassName"] == "system-node-critical"
    assert len(kinds["ServiceMonitor"]) == 2  # the exporter's and the plugins'
    [dashboards] = kinds["ConfigMap"]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"


# --- the kube-dra-exporter chart's values (the seed chart): same names, same effect ---------------

# Objects the chart renders that have no namespace.
CLUSTER_SCOPED = {
    "ClusterRole",
    "ClusterRoleBinding",
    "DeviceClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
EVERYTHING_ON = [
    "plugin.enabled=true",
    "dashboards.enabled=true",
    "serviceMonitor.enabled=true",
    "prometheusRule.enabled=true",
    "networkPolicy.enabled=true",
    "podDisruptionBudget.enabled=true",
    "metricsSecurity.tls.enabled=true",
    "metricsSecurity.tls.certManager.enabled=true",
    "metricsSecurity.tls.certManager.issuerRef.name=ca",
    "metricsSecurity.authorization.mode=kubernetes",
    "metricsSecurity.scraper.serviceAccounts[0].name=prometheus",
    "metricsSecurity.scraper.serviceAccounts[0].namespace=monitoring",
]


@pytest.mark.parametrize("sharded", [False, True], ids=["deployment", "sharded"])
def test_namespace_value_moves_every_namespaced_object(helm, sharded):
    sets = [*EVERYTHING_ON, "namespace=dra-elsewhere"] + (["sharding.enabled=true"] if sharded else [])
    docs = render(helm, *sets, namespace="monitoring")  # the release namespace stays monitoring
    kinds = _by_kind(docs)
    assert {"Deployment" if not sharded else "StatefulSet", "DaemonSet", "Certificate", "ConfigMap"} <= set(kinds)
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in doc["metadata"], where
        else:
            assert doc["metadata"].get("namespace") == "dra-elsewhere", where
    # Everything that names the namespace follows it.
    for binding in kinds["ClusterRoleBinding"]:
        for subject in binding["subjects"]:
            expected = "monitoring" if binding["metadata"]["name"].endswith("-metrics-reader") else "dra-elsewhere"
            assert subject["namespace"] == expected, binding["metadata"]["name"]
    [vap] = kinds["ValidatingAdmissionPolicy"]
    assert (
        "system:serviceaccount:dra-elsewhere:rel-otel-dra-kubeletplugin"
        in vap["spec"]["matchConditions"][0]["expression"]
    )
    for monitor in kinds["ServiceMonitor"]:
        assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["dra-elsewhere"]}
        assert monitor["spec"]["endpoints"][0]["tlsConfig"]["serverName"].endswith(".dra-elsewhere.svc")
    [cert] = kinds["Certificate"]
    assert "rel-otel-dra.dra-elsewhere.svc" in cert["spec"]["dnsNames"]
    assert not [n for n in cert["spec"]["dnsNames"] if "monitoring" in n]
    # dashboards.namespace still wins for the dashboard ConfigMap.
    [dash] = _by_kind(render(helm, "dashboards.enabled=true", "namespace=a", "dashboards.namespace=grafana"))[
        "ConfigMap"
    ]
    assert dash["metadata"]["namespace"] == "grafana"


@pytest.mark.parametrize(
    "sets",
    [
        ["rbac.useExistingRole=my-dra-reader"],  # the kube-dra-exporter chart's form
        ["rbac.useExistingRole=true", "rbac.existingRoleName=my-dra-reader"],  # ours, kept
        ["rbac.useExistingRole=my-dra-reader", "rbac.existingRoleName=my-dra-reader"],
    ],
)
def test_use_existing_role_binds_it_and_creates_no_role(helm, sets):
    kinds = _by_kind(render(helm, *sets))
    assert "ClusterRole" not in kinds
    [binding] = kinds["ClusterRoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "my-dra-reader",
    }
    # rbac.create=false: no role and no binding either.
    assert not {"ClusterRole", "ClusterRoleBinding"} & set(_by_kind(render(helm, *sets, "rbac.create=false")))
    # useExistingRole false or empty: the chart's own role.
    for off in ("rbac.useExistingRole=false", "rbac.useExistingRole="):
        [binding] = _by_kind(render(helm, off))["ClusterRoleBinding"]
        assert binding["roleRef"]["name"] == "rel-otel-dra"


# A values file written for the kube-dra-exporter chart, in the names its README documents.
SEED_VALUES = {
    "namespace": "dra-seed",
    "replicaCount": 2,
    "rbac": {"create": True, "useClusterRole": True, "useExistingRole": "kube-dra-exporter-role"},
    "podDisruptionBudget": {"enabled": True},
    "networkPolicy": {"enabled": True},
    "extraArgs": [],
    "featureGates": {},
    "extraEnv": [{"name": "KUBECONFIG", "value": "/etc/kube/a:/etc/kube/b"}],
    "image": {"tag": ""},
}


def test_kube_dra_exporter_values_keep_working(helm, testbed, tmp_path):
    values = tmp_path / "kube-dra-exporter-values.yaml"
    values.write_text(yaml.safe_dump(SEED_VALUES))
    docs = render(helm, release="kube-dra-exporter", namespace="default", values=[values])
    kinds = _by_kind(docs)
    # namespace: every namespaced object moves there.
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] not in CLUSTER_SCOPED} == {"dra-seed"}
    # rbac.useExistingRole=<name>: that role is bound, none of ours is created.
    assert "ClusterRole" not in kinds
    [binding] = kinds["ClusterRoleBinding"]
    assert binding["roleRef"]["name"] == "kube-dra-exporter-role"
    # podDisruptionBudget.enabled: minAvailable 1.
    [pdb] = kinds["PodDisruptionBudget"]
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == {"minAvailable": 1}
    # networkPolicy.enabled: Prometheus pods of the exporter's namespace only, on TCP http.
    [np] = kinds["NetworkPolicy"]
    assert np["spec"]["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    ]
    assert np["spec"]["ingress"][0]["ports"] == [{"port": "http", "protocol": "TCP"}]
    [deploy] = kinds["Deployment"]
    assert deploy["spec"]["replicas"] == 2 and deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    container = _exporter_container(docs)
    assert {"name": "KUBECONFIG", "value": "/etc/kube/a:/etc/kube/b"} in container["env"]
    assert container["image"].endswith(":0.1.0")
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    # On a real API server: the ServiceAccount gets exactly the existing role's permissions.
    testbed.kubectl("create", "namespace", "dra-seed", check=False)
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": "kube-dra-exporter-role"},
        "rules": [
            {
                "apiGroups": ["resource.k8s.io"],
                "resources": ["resourceclaims", "resourceslices", "deviceclasses"],
                "verbs": ["list", "watch"],
            }
        ],
    }
    _apply(testbed, [role, *docs])
    sa = "system:serviceaccount:dra-seed:kube-dra-exporter-otel-dra"

    def can(verb: str, resource: str) -> bool:
        result = testbed.kubectl("auth", "can-i", verb, resource, "--as", sa, "--all-namespaces", check=False)
        return result.stdout.strip() == "yes"

    for resource in (
        "resourceclaims.resource.k8s.io",
        "resourceslices.resource.k8s.io",
        "deviceclasses.resource.k8s.io",
    ):
        assert can("list", resource) and can("watch", resource)
    assert not can("list", "pods")  # not in the existing role, and no role of ours adds it
    assert testbed.kubectl("get", "clusterrole", "kube-dra-exporter-otel-dra", check=False).returncode != 0


def test_extra_volumes_and_mounts(helm, tmp_path):
    values = tmp_path / "v.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "extraVolumes": [{"name": "kube", "secret": {"secretName": "kubeconfig"}}],
                "extraVolumeMounts": [{"name": "kube", "mountPath": "/etc/kube", "readOnly": True}],
                "extraEnv": [{"name": "KUBECONFIG", "value": "/etc/kube/config"}],
            }
        )
    )
    for sets in ([], ["metricsSecurity.tls.enabled=true", "metricsSecurity.tls.existingSecret=tls"]):
        docs = render(helm, *sets, values=[values])
        [deploy] = _by_kind(docs)["Deployment"]
        pod = deploy["spec"]["template"]["spec"]
        assert {"name": "kube", "secret": {"secretName": "kubeconfig"}} in pod["volumes"]
        mounts = _exporter_container(docs)["volumeMounts"]
        assert {"name": "kube", "mountPath": "/etc/kube", "readOnly": True} in mounts
        assert len(mounts) == (3 if sets else 1)  # web config and TLS mounts kept
    [deploy] = _by_kind(render(helm))["Deployment"]
    assert "volumes" not in deploy["spec"]["template"]["spec"]
    assert "volumeMounts" not in _exporter_container(render(helm))


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


# --- exporter flags: the chart renders only what the exporter's CLI accepts -------------------------


def _exporter_container(docs: list[dict]) -> dict:
    kinds = _by_kind(docs)
    [workload] = kinds.get("Deployment", []) + kinds.get("StatefulSet", [])
    [container] = workload["spec"]["template"]["spec"]["containers"]
    return container


def _parse_with_cli(container: dict, monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The rendered container's args, with its literal environment, through the real CLI parser
    (which exits on a value it rejects, as the container would at start-up)."""
    for name in [n for n in os.environ if n.startswith("OTEL_DRA_")]:
        monkeypatch.delenv(name)
    for var in container["env"]:
        if "value" in var:
            monkeypatch.setenv(var["name"], var["value"])
    args = build_parser().parse_args(container["args"])
    assert args.command == "exporter"
    assert not getattr(args, "env_errors", None), args.env_errors
    return args


def _values_file(tmp_path: Path, exporter: dict) -> Path:
    path = tmp_path / "exporter-values.yaml"
    path.write_text(yaml.safe_dump({"exporter": exporter}))
    return path


def test_schema_device_attribute_limit_is_the_codes():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["exporter"]["properties"]["deviceAttributes"]["maxItems"] == MAX_DEVICE_ATTRIBUTES


def test_exporter_flag_defaults_are_the_clis(helm, monkeypatch):
    container = _exporter_container(render(helm))
    assert f"--device-attributes={DEFAULT_DEVICE_ATTRIBUTES}" in container["args"]
    assert "--leak-grace-period=600" in container["args"]
    assert not [a for a in container["args"] if a.startswith("--metric-")]
    rendered = _parse_with_cli(container, monkeypatch)
    defaults = build_parser().parse_args(["exporter"])
    assert rendered.device_attributes == defaults.device_attributes
    assert rendered.leak_grace_period == defaults.leak_grace_period == 600.0
    assert rendered.metric_allowlist is rendered.metric_denylist is defaults.metric_allowlist is None


@pytest.mark.parametrize("sets", [[], ["sharding.enabled=true", "sharding.shards=3"]], ids=["deployment", "sharded"])
@pytest.mark.parametrize(
    ("names", "grace"),
    [
        (["gpu.nvidia.com/productName", "memoryBandwidth", "index"], 90.5),
        ([], 3600),
        ([f"attr{i}" for i in range(MAX_DEVICE_ATTRIBUTES)], 0.25),
    ],
)
def test_exporter_values_reach_the_cli(helm, monkeypatch, tmp_path, sets, names, grace):
    values = _values_file(tmp_path, {"deviceAttributes": names, "leakGracePeriod": grace})
    container = _exporter_container(render(helm, *sets, values=[values]))
    assert f"--device-attributes={','.join(names)}" in container["args"]
    assert f"--leak-grace-period={grace}" in container["args"]
    args = _parse_with_cli(container, monkeypatch)
    assert args.device_attributes.names == tuple(names)
    assert args.leak_grace_period == grace


@pytest.mark.parametrize("sets", [[], ["sharding.enabled=true", "sharding.shards=3"]], ids=["deployment", "sharded"])
@pytest.mark.parametrize("key", ["metricAllowlist", "metricDenylist"])
def test_metric_lists_reach_the_cli(helm, monkeypatch, tmp_path, sets, key):
    # Regex syntax that YAML or a shell would mangle unquoted survives as written.
    entries = ["kube_resourcepool_.+", "kube_resourceclaim_status_(phase|reserved_total)", r"kube_deviceclass_\w+ ?#?"]
    container = _exporter_container(render(helm, *sets, values=[_values_file(tmp_path, {key: entries})]))
    flag = "--metric-allowlist" if key == "metricAllowlist" else "--metric-denylist"
    assert f"{flag}={','.join(entries)}" in container["args"]
    args = _parse_with_cli(container, monkeypatch)
    selection = args.metric_allowlist if key == "metricAllowlist" else args.metric_denylist
    assert selection.entries == tuple(entries)
    assert selection.allow is (key == "metricAllowlist")
    assert (args.metric_denylist if key == "metricAllowlist" else args.metric_allowlist) is None


@pytest.mark.parametrize(
    ("exporter", "message"),
    [
        (
            {"metricAllowlist": ["kube_deviceclass_info"], "metricDenylist": ["kube_deviceclass_hourly_cost"]},
            "mutually exclusive",
        ),
        ({"metricAllowlist": ["kube_deviceclass_info,kube_deviceclass_hourly_cost"]}, "does not match pattern"),
        ({"metricDenylist": [" "]}, "does not match pattern"),
        ({"metricDenylist": [""]}, "does not match pattern"),
        ({"metricAllowlist": "kube_deviceclass_info"}, "metricAllowlist"),  # a string, not a list
        ({"metricAllowlist": ["kube_deviceclass_info", "kube_deviceclass_info"]}, "metricAllowlist"),
    ],
)
def test_metric_list_rejections(helm, tmp_path, exporter, message):
    values = _values_file(tmp_path, exporter)
    chart = _helm(helm, "template", "rel", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(values), check=False)
    assert chart.returncode != 0, "helm accepted values it should reject"
    assert message.lower() in chart.stderr.lower(), chart.stderr


@pytest.mark.parametrize(
    ("names", "accepted"),
    [
        (DEFAULT_DEVICE_ATTRIBUTES.split(","), True),
        (["x" * 32, "a/b", "example.com/UUID"], True),
        (["productName", "productname"], True),  # attribute_product_name, attribute_productname
        ([f"a{i}" for i in range(MAX_DEVICE_ATTRIBUTES + 1)], False),
        (["x" * 33], False),
        (["1bad"], False),
        (["_x"], False),
        (["bad-name"], False),
        (["Gpu.com/x"], False),
        (["a./x"], False),
        (["a/b/c"], False),
        (["gpu.nvidia.com/"], False),
        (["type", "type"], False),
        (["productName", "gpu.nvidia.com/productName"], False),
        (["productName", "product_name"], False),
        (["ABCDef", "abc_def"], False),
        (["uuid", "example.com/UUID"], False),
        (["a1B2", "a1_b2"], False),
        (["x__y", "x_y"], False),
    ],
)
def test_chart_accepts_exactly_the_device_attributes_the_cli_accepts(helm, tmp_path, capsys, names, accepted):
    values = _values_file(tmp_path, {"deviceAttributes": names})
    chart = _helm(helm, "template", "rel", str(CHART), "--kube-version", KUBE_VERSION, "-f", str(values), check=False)
    assert (chart.returncode == 0) is accepted, chart.stderr
    try:
        build_parser().parse_args(["exporter", "--device-attributes=" + ",".join(names)])
        cli_accepted = True
    except SystemExit:
        cli_accepted = False
    assert cli_accepted is accepted, capsys.readouterr().err


# --- the kubelet plugin (plugin.enabled) -------------------------------------------------------------

PLUGIN_SETS = ("plugin.enabled=true",)


def test_plugin_device_profile_values_reach_the_plugin_and_its_device_class(helm):
    sets = (
        *PLUGIN_SETS,
        "plugin.deviceProfile=gpu-partitionable",
        "plugin.partitions=4",
        "plugin.bindingConditions.enabled=true",
        "plugin.deviceClass.extendedResourceName=example.com/gpu",
    )
    kinds = _by_kind(render(helm, *sets))
    [ds] = kinds["DaemonSet"]
    [container] = ds["spec"]["template"]["spec"]["containers"]
    args = [a.replace("$(NODE_NAME)", "n1") for a in container["args"]]
    from otel_dra.cli import build_parser

    parsed = build_parser("plugin").parse_args(args)
    assert (parsed.device_profile, parsed.partitions, parsed.binding_conditions) == ("gpu-partitionable", 4, True)
    assert parsed.gpu_allow_multiple_allocations is False
    [device_class] = kinds["DeviceClass"]
    assert device_class["spec"]["extendedResourceName"] == "example.com/gpu"
    # Not offered unless asked for.
    [plain] = _by_kind(render(helm, *PLUGIN_SETS))["DeviceClass"]
    assert "extendedResourceName" not in plain["spec"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["plugin.deviceProfile=tpu"], "deviceProfile"),
        (["plugin.partitions=9"], "partitions"),
        (["plugin.bindingConditions=true"], "bindingConditions"),
        (["plugin.deviceClass.extendedResourceName=gpu"], "extendedResourceName"),
    ],
)
def test_plugin_profile_values_refused_by_the_schema(helm, sets, message):
    _assert_rejected(helm, [*PLUGIN_SETS, *sets], message)


def test_plugin_daemonset_is_as_restricted_as_it_can_be(helm):
    kinds = _by_kind(render(helm, *PLUGIN_SETS, "otlp.endpoint=http://collector:4318"))
    [ds] = kinds["DaemonSet"]
    assert ds["metadata"]["name"] == "rel-otel-dra-kubeletplugin"
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "rel-otel-dra-kubeletplugin"
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [container] = pod["containers"]
    assert container["args"] == [
        "plugin",
        "--node-name=$(NODE_NAME)",
        "--driver-name=gpu.example.com",
        "--num-devices=8",
        "--device-profile=gpu",
        "--partitions=2",
        "--cpus-per-numa-node=16",
        "--gpu-allow-multiple-allocations=false",
        "--binding-conditions=false",
        "--cdi-root=/var/run/cdi",
        "--kubelet-plugins-directory-path=/var/lib/kubelet/plugins",
        "--kubelet-registrar-directory-path=/var/lib/kubelet/plugins_registry",
        "--metrics-port=8080",
        "--healthcheck-port=51515",
        "--device-health=true",
        "--unhealthy-device-taint=NoSchedule",
    ]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector:4318"
    assert "k8s.pod.uid=$(POD_UID)" in env["OTEL_RESOURCE_ATTRIBUTES"]["value"]
    sc = container["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert not sc.get("privileged")
    assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in container["ports"]
    assert container["livenessProbe"]["grpc"] == {"port": 51515, "service": "liveness"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {
        # Its own directory only, not other drivers' sockets (the flag names the parent).
        "plugins": "/var/lib/kubelet/plugins/gpu.example.com",
        "plugins-registry": "/var/lib/kubelet/plugins_registry",
        "cdi": "/var/run/cdi",
    }
    assert all(mounts[name] == path for name, path in host_paths.items())
    assert container["resources"]["limits"]["memory"]

    svc = next(s for s in kinds["Service"] if s["metadata"]["name"] == "rel-kubeletplugin-metrics")
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}]
    assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "kubeletplugin"
    # The exporter's Service does not select plugin pods, nor the other way round.
    exporter_svc = next(s for s in kinds["Service"] if s["metadata"]["name"] == "rel-otel-dra")
    assert exporter_svc["spec"]["selector"]["app.kubernetes.io/component"] == "exporter"

    [dc] = kinds["DeviceClass"]
    assert dc["metadata"]["name"] == "gpu.example.com"
    assert dc["spec"]["selectors"] == [{"cel": {"expression": "device.driver == 'gpu.example.com'"}}]

    [role] = [r for r in kinds["ClusterRole"] if r["metadata"]["name"] == "rel-otel-dra-kubeletplugin"]
    assert role["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceslices"],
            "verbs": ["list", "create", "update", "delete"],
        },
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["get"]},
        # The devices' status in the claims it prepares: of its own driver only.
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"], "verbs": ["patch"]},
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceclaims/driver"],
            "resourceNames": ["gpu.example.com"],
            "verbs": ["associated-node:patch"],
        },
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},  # the Node's UID: slice owner
    ]
    [policy] = kinds["ValidatingAdmissionPolicy"]
    assert (
        "system:serviceaccount:monitoring:rel-otel-dra-kubeletplugin"
        in policy["spec"]["matchConditions"][0]["expression"]
    )


def test_plugin_driver_name_flows_everywhere(helm):
    kinds = _by_kind(render(helm, *PLUGIN_SETS, "plugin.driverName=npu.acme.io", "plugin.numDevices=2"))
    [ds] = kinds["DaemonSet"]
    args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--driver-name=npu.acme.io" in args and "--num-devices=2" in args
    [dc] = kinds["DeviceClass"]
    assert dc["metadata"]["name"] == "npu.acme.io"
    assert dc["spec"]["selectors"][0]["cel"]["expression"] == "device.driver == 'npu.acme.io'"
    [policy] = kinds["ValidatingAdmissionPolicy"]
    assert any("'npu.acme.io'" in v["expression"] for v in policy["spec"]["validations"])


def test_plugin_monitors_follow_the_exporter_monitor_kind(helm):
    for monitor, endpoints in (("serviceMonitor", "endpoints"), ("podMonitor", "podMetricsEndpoints")):
        kinds = _by_kind(render(helm, *PLUGIN_SETS, f"{monitor}.enabled=true"))
        kind = monitor[0].upper() + monitor[1:]
        plugin = [m for m in kinds[kind] if m["metadata"]["name"] == "rel-otel-dra-kubeletplugin"]
        assert len(plugin) == 1 and len(kinds[kind]) == 2
        assert plugin[0]["spec"][endpoints][0]["port"] == "metrics"
        assert plugin[0]["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "kubeletplugin"


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar(helm):
    [cm] = _by_kind(render(helm, "dashboards.enabled=true"))["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["otel-dra.json"])
    assert dashboard["uid"] == "otel-dra-overview"
    assert (CHART / "files" / "dashboards" / "otel-dra.json").read_text().strip() == cm["data"]["otel-dra.json"]
    [cm] = _by_kind(render(helm, "dashboards.enabled=true", "dashboards.namespace=grafana"))["ConfigMap"]
    assert cm["metadata"]["namespace"] == "grafana"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["plugin.enabled=true", "plugin.driverName=GPU_Example"], "driverName"),
        (["plugin.enabled=true", "plugin.metricsPort=51515"], "must differ"),
        (["plugin.enabled=true", "plugin.cdiRoot=var/run/cdi"], "cdiRoot"),
        (["plugin.enabled=true", "plugin.hostNetwork=true"], "additional properties"),
        (["plugin.metricsPort=0"], "metricsPort"),
        (["dashboards.enabled=yes"], "dashboards"),
    ],
)
def test_plugin_and_dashboard_rejections(helm, sets, message):
    _assert_rejected(helm, sets, message)


@pytest.mark.parametrize(
    "sets",
    [
        ["plugin.enabled=true", "dashboards.enabled=true", "otlp.endpoint=http://collector:4318"],
        ["plugin.enabled=true", "podMonitor.enabled=true", "plugin.deviceClass.create=false"],
    ],
)
def test_server_side_dry_run_with_plugin(helm, testbed, operator_crds, sets):
    testbed.kubectl("create", "namespace", "monitoring", check=False)
    _apply(testbed, render(helm, *sets), "--dry-run=server")


PLUGIN_TEST_DRIVER = "chart-test.example.com"


@pytest.fixture(scope="module")
def plugin_release(helm, testbed):
    """The chart with the plugin, applied for real into namespace dra-plugin (nothing runs the pods:
    the testbed has no kubelet; RBAC and the admission policy are what is tested)."""
    testbed.kubectl("create", "namespace", "dra-plugin", check=False)
    # A driver name of its own: the DeviceClass it creates must not replace the sample objects'
    # gpu.example.com class that other tests load into the same API server.
    docs = render(
        helm, "plugin.enabled=true", f"plugin.driverName={PLUGIN_TEST_DRIVER}", release="plug", namespace="dra-plugin"
    )
    _apply(testbed, docs)
    return "system:serviceaccount:dra-plugin:plug-otel-dra-kubeletplugin"


def test_plugin_serviceaccount_can_exactly_what_the_plugin_needs(testbed, plugin_release):
    sa = plugin_release

    def can(verb: str, resource: str, *extra: str) -> bool:
        result = testbed.kubectl("auth", "can-i", verb, resource, "--as", sa, *extra, check=False)
        return result.stdout.strip() == "yes"

    for verb in ("list", "create", "update", "delete"):
        assert can(verb, "resourceslices.resource.k8s.io"), verb
    for verb in ("get", "watch", "patch", "deletecollection"):
        assert not can(verb, "resourceslices.resource.k8s.io"), verb
    assert can("get", "resourceclaims.resource.k8s.io", "-n", "team-a")
    for verb in ("list", "watch", "update", "patch", "delete", "create"):
        assert not can(verb, "resourceclaims.resource.k8s.io", "-n", "team-a"), verb
    # The devices' status in a claim: patch (server-side apply) of the status, nothing more, and
    # the API server's per-driver check (resourceclaims/driver) for its own driver on its own node.
    claims, status, driver = "resourceclaims.resource.k8s.io", ("--subresource=status",), ("--subresource=driver",)
    assert can("patch", claims, "-n", "team-a", *status)
    for verb in ("update", "get", "create", "delete"):
        assert not can(verb, claims, "-n", "team-a", *status), verb
    assert can("associated-node:patch", f"{claims}/{PLUGIN_TEST_DRIVER}", "-n", "team-a", *driver)
    assert not can("associated-node:patch", f"{claims}/gpu.example.com", "-n", "team-a", *driver)
    for verb in ("arbitrary-node:patch", "associated-node:update", "arbitrary-node:update"):
        assert not can(verb, f"{claims}/{PLUGIN_TEST_DRIVER}", "-n", "team-a", *driver), verb
    assert can("get", "nodes")  # its Node's UID, for the ResourceSlices' owner reference
    assert not can("list", "nodes") and not can("patch", "nodes/status") and not can("update", "nodes")
    for verb, resource in (
        ("list", "deviceclasses.resource.k8s.io"),
        ("create", "deviceclasses.resource.k8s.io"),
        ("get", "secrets"),
        ("list", "pods"),
        ("create", "pods"),
        ("get", "configmaps"),
        ("create", "resourceclaimtemplates.resource.k8s.io"),
    ):
        assert not can(verb, resource, "--all-namespaces"), (verb, resource)
    # The exporter's ServiceAccount gained nothing from the plugin.
    exporter = "system:serviceaccount:dra-plugin:plug-otel-dra"
    result = testbed.kubectl("auth", "can-i", "create", "resourceslices.resource.k8s.io", "--as", exporter, check=False)
    assert result.stdout.strip() == "no"


def _slice(name: str, node: str | None, driver: str = PLUGIN_TEST_DRIVER) -> dict:
    spec: dict = {"driver": driver, "pool": {"name": node or "shared", "generation": 1, "resourceSliceCount": 1}}
    if node:
        spec["nodeName"] = node
    else:
        spec["allNodes"] = True
    spec["devices"] = [{"name": "gpu-0"}]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": name}, "spec": spec}


def test_admission_policy_keeps_the_plugin_to_its_own_node_and_driver(testbed, plugin_release, tmp_path):
    """RBAC allows every ResourceSlice; the chart's ValidatingAdmissionPolicy narrows the plugin's
    ServiceAccount to slices of its driver on the node of the pod its token is bound to."""
    ns, sa = "dra-plugin", "plug-otel-dra-kubeletplugin"
    node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "vap-node-a"}}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "plugin-on-a", "namespace": ns},
        "spec": {
            "nodeName": "vap-node-a",
            "serviceAccountName": sa,
            "automountServiceAccountToken": False,
            "containers": [{"name": "plugin", "image": "example.invalid/plugin:0"}],
        },
    }
    testbed.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([node, pod]))
    bound = testbed.kubectl(
        "create", "token", sa, "-n", ns, "--bound-object-kind=Pod", "--bound-object-name=plugin-on-a"
    ).stdout.strip()
    as_plugin = testbed.write_kubeconfig(tmp_path / "plugin.kubeconfig", bound)
    unbound = testbed.write_kubeconfig(tmp_path / "unbound.kubeconfig", testbed.mint_token(ns, sa))

    def create(obj: dict, kubeconfig: Path):
        return testbed.kubectl("create", "-f", "-", input=yaml.safe_dump(obj), kubeconfig=kubeconfig, check=False)

    # The policy is enforced once the API server has loaded it (shortly after it was created).
    denied = wait_until(
        lambda: (lambda r: r if r.returncode != 0 else None)(create(_slice("vap-b", "vap-node-b"), as_plugin)),
        timeout=30,
        what="the admission policy to deny a slice of another node",
    )
    assert "may not change ResourceSlices of node 'vap-node-b'" in denied.stderr
    ok = create(_slice("vap-a", "vap-node-a"), as_plugin)
    assert ok.returncode == 0, ok.stderr
    other_driver = create(_slice("vap-a-other", "vap-node-a", driver="other.example.com"), as_plugin)
    assert (
        other_driver.returncode != 0
        and f"only change ResourceSlices of driver {PLUGIN_TEST_DRIVER}" in other_driver.stderr
    )
    cluster_wide = create(_slice("vap-all", None), as_plugin)
    assert cluster_wide.returncode != 0 and "without spec.nodeName" in cluster_wide.stderr
    no_node = create(_slice("vap-a2", "vap-node-a"), unbound)
    assert no_node.returncode != 0 and "token bound to a pod on a node" in no_node.stderr
    # Deleting is covered too: its own slice yes; the admin's slice on another node no.
    testbed.kubectl("create", "-f", "-", input=yaml.safe_dump(_slice("vap-admin-b", "vap-node-b")))
    assert testbed.kubectl("delete", "resourceslice", "vap-admin-b", kubeconfig=as_plugin, check=False).returncode != 0
    assert testbed.kubectl("delete", "resourceslice", "vap-a", kubeconfig=as_plugin, check=False).returncode == 0
    testbed.kubectl("delete", "resourceslice", "vap-admin-b")
