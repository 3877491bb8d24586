"""The chart's binding-condition controller (bindingController.enabled) with the real helm CLI and
the real API server: what it renders, that its flags are the CLI's, and that its ServiceAccount can
exactly what the controller does, by running the controller with that ServiceAccount's token."""

from __future__ import annotations

import time
from typing import Any

import pytest
import yaml

from otel_dra.cli import build_parser
from otel_dra.cli.binding_controller import start_binding_controller
from otel_dra.fixtures import create
from otel_dra.kube.client import ApiError, KubeClient, load_credentials
from otel_dra.testbed.build import kubernetes_release, version_key
from tests.helpers import wait_until
from tests.integration.test_chart import _apply, _assert_rejected, _by_kind, render

SETS = ("bindingController.enabled=true",)
NS = "dra-binding"
DRIVER = "chart-binding.example.com"


def _objects(helm, *sets: str, **kwargs: Any) -> dict[str, list[dict]]:
    kinds = _by_kind(render(helm, *SETS, *sets, **kwargs))
    return {
        kind: [d for d in docs if d["metadata"]["name"].endswith("-binding-controller")] for kind, docs in kinds.items()
    }


def _container(kinds: dict[str, list[dict]]) -> dict:
    [deploy] = kinds["Deployment"]
    [container] = deploy["spec"]["template"]["spec"]["containers"]
    return container


def test_off_by_default(helm):
    names = [d["metadata"]["name"] for d in render(helm)]
    assert not [n for n in names if "binding" in n]


def test_the_deployment_is_as_restricted_as_the_exporters(helm):
    kinds = _objects(helm, "otlp.endpoint=http://collector:4318")
    [deploy] = kinds["Deployment"]
    assert deploy["metadata"]["namespace"] == "monitoring"
    # One replica, never two at once: there is no leader election.
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    pod = deploy["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "rel-otel-dra-binding-controller"
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = _container(kinds)
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["resources"]["limits"]["memory"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 8080, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "volumeMounts" not in container and "volumes" not in pod  # nothing writable, nothing mounted
    env = {e["name"]: e for e in container["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://collector:4318"
    assert env["OTEL_SERVICE_NAME"]["value"] == "rel-otel-dra-binding-controller"
    # Its own component label: no Service or NetworkPolicy of the exporter's selects its pods.
    labels = deploy["spec"]["selector"]["matchLabels"]
    assert labels["app.kubernetes.io/component"] == "binding-controller"
    [role] = kinds["ClusterRole"]
    assert role["rules"] == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims"], "verbs": ["list", "watch"]},
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaims/status"], "verbs": ["patch"]},
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceclaims/driver"],
            "resourceNames": ["gpu.example.com"],
            "verbs": ["arbitrary-node:patch"],
        },
    ]
    [binding] = kinds["ClusterRoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-otel-dra-binding-controller", "namespace": "monitoring"}
    ]


def test_values_reach_the_cli_and_the_driver_follows_the_plugin(helm, monkeypatch, tmp_path):
    for name in ("OTEL_DRA_DRIVER_NAME", "OTEL_DRA_ATTACH_DELAY", "OTEL_DRA_FAILURE_FRACTION"):
        monkeypatch.delenv(name, raising=False)

    def parsed(*sets: str, binding: dict[str, Any] | None = None):
        values = tmp_path / "values.yaml"  # numbers with a fraction: --set would make them strings
        values.write_text(yaml.safe_dump({"bindingController": {"enabled": True, **(binding or {})}}))
        container = _container(_objects(helm, *sets, values=[values]))
        return build_parser("binding-controller").parse_args(container["args"])

    defaults = parsed()
    cli = build_parser("binding-controller").parse_args(["binding-controller"])
    # The chart's defaults are the CLI's, but for the port (the CLI's default is off).
    assert (defaults.attach_delay, defaults.failure_fraction, defaults.driver_name) == (
        cli.attach_delay,
        cli.failure_fraction,
        cli.driver_name,
    )
    assert defaults.metrics_port == 8080 and defaults.log_format == "json"
    args = parsed("plugin.driverName=npu.acme.io", binding={"attachDelay": 0.5})
    assert args.driver_name == "npu.acme.io" and args.attach_delay == 0.5
    args = parsed(
        "plugin.driverName=npu.acme.io",
        binding={"driverName": "nic.acme.io", "failureFraction": 0.25, "metricsPort": 9090},
    )
    assert (args.driver_name, args.failure_fraction, args.metrics_port) == ("nic.acme.io", 0.25, 9090)
    [role] = _objects(helm, "bindingController.driverName=nic.acme.io")["ClusterRole"]
    assert role["rules"][2]["resourceNames"] == ["nic.acme.io"]
    # metricsSecurity reaches it as it reaches the exporter and the plugin.
    kinds = _objects(
        helm,
        "metricsSecurity.tls.enabled=true",
        "metricsSecurity.tls.existingSecret=tls",
        "metricsSecurity.authorization.mode=kubernetes",
    )
    container = _container(kinds)
    assert "--authorization=kubernetes" in container["args"]
    assert container["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/etc/otel-dra/web", "/etc/otel-dra/tls"}
    [role] = kinds["ClusterRole"]
    assert {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]} in role["rules"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["bindingController.failureFraction=2"], "failureFraction"),
        (["bindingController.attachDelay=-1"], "attachDelay"),
        (["bindingController.attachDelay=7200"], "attachDelay"),
        (["bindingController.driverName=GPU_Example"], "driverName"),
        (["bindingController.replicas=2"], "additional properties"),
        (["bindingController.metricsPort=0"], "metricsPort"),
    ],
)
def test_rejections(helm, sets, message):
    _assert_rejected(helm, [*SETS, *sets], message)


def test_server_side_dry_run(helm, testbed):
    testbed.kubectl("create", "namespace", "monitoring", check=False)
    _apply(
        testbed, render(helm, *SETS, "plugin.enabled=true", "otlp.endpoint=http://collector:4318"), "--dry-run=server"
    )


def _allocated_claim(admin: KubeClient, name: str) -> dict[str, Any]:
    """A claim whose allocation (of a DRIVER device with binding conditions) the admin writes, as
    the scheduler would: nothing here schedules."""
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": DRIVER,
                            "pool": "node-x",
                            "device": "gpu-0",
                            "bindingConditions": ["Attached"],
                            "bindingFailureConditions": ["AttachFailed"],
                        }
                    ]
                },
                "allocationTimestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        },
    }
    return create(admin, claim)


@pytest.mark.kubernetes(min="1.35", reason="bindingConditions of an allocation result need DRADeviceBindingConditions")
def test_the_serviceaccount_can_exactly_what_the_controller_needs(helm, testbed, tmp_path):
    testbed.kubectl("create", "namespace", NS, check=False)
    docs = render(helm, *SETS, f"bindingController.driverName={DRIVER}", release="bind", namespace=NS)
    _apply(testbed, docs)
    sa_name = "bind-otel-dra-binding-controller"
    sa = f"system:serviceaccount:{NS}:{sa_name}"

    def can(verb: str, resource: str, *extra: str) -> bool:
        result = testbed.kubectl("auth", "can-i", verb, resource, "--as", sa, *extra, check=False)
        return result.stdout.strip() == "yes"

    claims = "resourceclaims.resource.k8s.io"
    assert can("list", claims, "--all-namespaces") and can("watch", claims, "--all-namespaces")
    for verb in ("get", "create", "update", "patch", "delete"):
        assert not can(verb, claims, "-n", "team-a"), verb
    assert can("patch", claims, "--subresource=status", "-n", "team-a")
    assert not can("update", claims, "--subresource=status", "-n", "team-a")
    assert can("arbitrary-node:patch", f"{claims}/{DRIVER}", "--subresource=driver", "-n", "team-a")
    assert not can("arbitrary-node:patch", f"{claims}/other.example.com", "--subresource=driver", "-n", "team-a")
    assert not can("update", claims, "--subresource=binding", "-n", "team-a")  # the scheduler's
    for verb, resource in (
        ("list", "resourceslices.resource.k8s.io"),
        ("list", "pods"),
        ("get", "secrets"),
        ("list", "nodes"),
        ("create", "events"),
    ):
        assert not can(verb, resource, "--all-namespaces"), (verb, resource)

    # And it is enough: the controller, with that ServiceAccount's token and the rendered flags,
    # sets the condition of an allocated claim.
    admin = KubeClient(load_credentials(str(testbed.kubeconfig)))
    claim = _allocated_claim(admin, "chart-rbac")
    [deploy] = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == sa_name]
    args = build_parser("binding-controller").parse_args(deploy["spec"]["template"]["spec"]["containers"][0]["args"])
    kubeconfig = testbed.write_kubeconfig(tmp_path / "binding.kubeconfig", testbed.mint_token(NS, sa_name))
    app = start_binding_controller(
        kubeconfig=str(kubeconfig), driver_name=args.driver_name, attach_delay=0, failure_fraction=args.failure_fraction
    )
    try:

        def attached() -> bool:
            got = admin.get_json(f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/chart-rbac")
            conditions = [c for d in got["status"].get("devices") or [] for c in d.get("conditions") or []]
            return any(c["type"] == "Attached" and c["status"] == "True" for c in conditions)

        wait_until(attached, timeout=30, what="the condition written with the chart's ServiceAccount")
        # Its watch (list and watch are all it may do) shows the claim attached: nothing left.
        wait_until(lambda: app.controller.entries() == {}, what=f"{claim['metadata']['name']} no longer waiting")
    finally:
        app.stop()

    # Without the resourceclaims/driver rule, an API server that checks it (1.36+:
    # DRAResourceClaimGranularStatusAuthorization) refuses the write: the rule is needed, not extra.
    if version_key(kubernetes_release().minor) >= version_key("1.36"):
        role = next(d for d in docs if d["kind"] == "ClusterRole")
        role["rules"] = role["rules"][:2]
        _apply(testbed, [role])
        _allocated_claim(admin, "chart-rbac-no-driver")
        sa_client = KubeClient(load_credentials(str(kubeconfig)))
        body: dict[str, Any] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "chart-rbac-no-driver", "namespace": NS},
            "status": {
                "devices": [
                    {
                        "driver": DRIVER,
                        "pool": "node-x",
                        "device": "gpu-0",
                        "conditions": [
                            {
                                "type": "Attached",
                                "status": "True",
                                "reason": "Test",
                                "message": "",
                                "lastTransitionTime": "2026-01-01T00:00:00Z",
                            }
                        ],
                    }
                ]
            },
        }

        attempts = iter(range(1000))

        def refused() -> ApiError | None:
            # A new message each time: an unchanged entry is not authorized again.
            body["status"]["devices"][0]["conditions"][0]["message"] = f"attempt {next(attempts)}"
            try:
                sa_client.request(
                    "PATCH",
                    f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims/chart-rbac-no-driver/status",
                    query={"fieldManager": "test", "force": "true"},
                    body=body,
                    content_type="application/apply-patch+yaml",
                )
            except ApiError as exc:
                return exc
            return None  # RBAC caches may still hold the old role for a moment

        error = wait_until(refused, timeout=30, what="the write refused without the driver rule")
        assert error.status in (403, 422) and "resourceclaims/driver" in error.message, error
        testbed.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
