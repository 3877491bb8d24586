"""`otel-dra webhook` against the real API server: the webhook runs in-process on 127.0.0.1 with a
certificate for that IP, a ValidatingWebhookConfiguration with the chart's rules sends it the
reviews, and what the API server answers a client that creates or changes a ResourceClaim, a
ResourceClaimTemplate or a DeviceClass is asserted.

The testbed is shared by the whole session: the configuration only selects objects with this
module's label (objectSelector: a namespaceSelector would not keep cluster-scoped DeviceClasses
out), fails open (failurePolicy Ignore), and is deleted at the end of the module.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_dra.cli.webhook import WebhookApp, start_webhook
from otel_dra.kube.client import ApiError, KubeClient
from tests.helpers import parse_samples, scrape, wait_until
from tests.integration.plugin_helpers import ensure_namespace
from tests.integration.test_chart import render
from tests.pki import make_ca

NS = "config-webhook"
DRIVER = "gpu.example.com"
WEBHOOK = "config.gpu.example.com"
CONFIGURATION = "otel-dra-test-config-webhook"
LABEL = {"otel-dra.test/config-webhook": "true"}
VWC_PATH = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
CLAIMS = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"
TEMPLATES = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates"
CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"

GOOD = {"apiVersion": "gpu.resource.example.com/v1alpha1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}}
PARTITIONED = {**GOOD, "sharing": {"strategy": "SpacePartitioning", "spacePartitioningConfig": {"partitionCount": 2}}}
BAD = {
    "unknown strategy": (
        {**GOOD, "sharing": {"strategy": "MPS"}},
        "unknown GPU sharing strategy: 'MPS' (one of TimeSlicing, SpacePartitioning)",
    ),
    "unknown field": ({**GOOD, "sharingStrategy": "TimeSlicing"}, "unknown field(s) in GpuConfig: sharingStrategy"),
    "wrong kind": (
        {**GOOD, "kind": "GPUConfig"},
        "parameters are 'gpu.resource.example.com/v1alpha1'/'GPUConfig', this driver decodes only "
        "gpu.resource.example.com/v1alpha1/GpuConfig",
    ),
}
_names = itertools.count()


def name(prefix: str) -> str:
    return f"{prefix}-{next(_names)}"


def config_entry(parameters: dict[str, Any], driver: str = DRIVER) -> dict[str, Any]:
    return {"requests": ["gpu"], "opaque": {"driver": driver, "parameters": parameters}}


def devices(*config: dict[str, Any]) -> dict[str, Any]:
    return {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}], "config": list(config)}


def claim(claim_name: str, *config: dict[str, Any], labelled: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": claim_name, "namespace": NS, "labels": LABEL if labelled else {}},
        "spec": {"devices": devices(*config)},
    }


def template(template_name: str, *config: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": template_name, "namespace": NS, "labels": LABEL},
        "spec": {"spec": {"devices": devices(*config)}},
    }


def device_class(class_name: str, *config: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": class_name, "labels": LABEL},
        "spec": {
            "selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}],
            # Entries of a class are not tied to requests.
            "config": [{"opaque": entry["opaque"]} for entry in config],
        },
    }


def rejection(client: KubeClient, path: str, obj: dict[str, Any], method: str = "POST") -> ApiError:
    with pytest.raises(ApiError) as err:
        client.send_json(method, path, obj)
    return err.value


def denied(where: str, reason: str) -> str:
    """The message the API server gives the client: the webhook's, after its own prefix."""
    return f'admission webhook "{WEBHOOK}" denied the request: {where}.opaque.parameters (driver {DRIVER}): {reason}'


@pytest.fixture(scope="module")
def webhook(admin_client: KubeClient, helm: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebhookApp]:
    pki = tmp_path_factory.mktemp("webhook-pki")
    ca = make_ca(pki)
    cert, key = ca.issue("webhook", san="IP:127.0.0.1")
    app = start_webhook(
        cert_file=str(cert),
        key_file=str(key),
        driver_name=DRIVER,
        address="127.0.0.1",
        port=0,
        metrics_port=0,
        metrics_address="127.0.0.1",
    )
    ensure_namespace(admin_client, NS)
    configuration = webhook_configuration(helm, app.port, ca.cert)
    try:
        admin_client.send_json("POST", VWC_PATH, configuration)
        try:
            wait_for_the_api_server(admin_client)
            yield app
        finally:
            admin_client.request("DELETE", f"{VWC_PATH}/{CONFIGURATION}")
    finally:
        app.stop()


def webhook_configuration(helm: Path, port: int, ca_cert: Path) -> dict[str, Any]:
    """The chart's ValidatingWebhookConfiguration (its rules, match policy, review versions), sent to
    the webhook here, for this module's objects only, failing open."""
    [chart] = [
        d for d in render(helm, "plugin.configWebhook.enabled=true") if d["kind"] == "ValidatingWebhookConfiguration"
    ]
    [webhook] = chart["webhooks"]
    assert webhook["name"] == WEBHOOK
    webhook["clientConfig"] = {
        "url": f"https://127.0.0.1:{port}/validate",
        "caBundle": base64.b64encode(ca_cert.read_bytes()).decode(),
    }
    # Other tests share this API server: only this module's objects, and never a refusal because
    # the webhook is not there.
    webhook["objectSelector"] = {"matchLabels": LABEL}
    webhook["failurePolicy"] = "Ignore"
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": CONFIGURATION},
        "webhooks": [webhook],
    }


def wait_for_the_api_server(client: KubeClient) -> None:
    """The API server picks a new webhook configuration up from its informer, shortly after the
    create: until then a bad claim is stored (and deleted here again)."""
    bad, _ = BAD["unknown strategy"]

    def rejected() -> bool:
        probe = name("probe")
        try:
            client.send_json("POST", CLAIMS, claim(probe, config_entry(bad)))
        except ApiError as exc:
            assert exc.status == 422, exc
            return True
        client.request("DELETE", f"{CLAIMS}/{probe}")
        return False

    wait_until(rejected, timeout=30, interval=0.2, what="the API server to call the webhook")


def test_a_claim_with_a_good_config_is_created(admin_client: KubeClient, webhook: WebhookApp) -> None:
    created = admin_client.send_json(
        "POST", CLAIMS, claim(name("good"), config_entry(GOOD), config_entry(PARTITIONED, driver="nic.example.com"))
    )
    assert created["metadata"]["uid"]
    assert created["spec"]["devices"]["config"][0]["opaque"]["parameters"] == GOOD


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_claim_with_a_bad_config_is_refused_with_the_reason(
    admin_client: KubeClient, webhook: WebhookApp, case: str
) -> None:
    parameters, reason = BAD[case]
    claim_name = name("bad")
    err = rejection(admin_client, CLAIMS, claim(claim_name, config_entry(GOOD), config_entry(parameters)))
    assert err.status == 422
    assert err.message == denied("spec.devices.config[1]", reason)
    assert json.loads(err.body)["reason"] == "Invalid"
    with pytest.raises(ApiError) as gone:  # nothing stored
        admin_client.get_json(f"{CLAIMS}/{claim_name}")
    assert gone.value.status == 404


def test_what_the_webhook_adds_the_api_server_alone_accepts(admin_client: KubeClient, webhook: WebhookApp) -> None:
    """Without the label the webhook is not asked: the same bad config is stored (the API server
    cannot validate opaque parameters), which is why the plugin refuses it again at prepare."""
    parameters, _ = BAD["unknown strategy"]
    claim_name = name("unlabelled")
    admin_client.send_json("POST", CLAIMS, claim(claim_name, config_entry(parameters), labelled=False))
    admin_client.request("DELETE", f"{CLAIMS}/{claim_name}")


def test_a_claims_config_cannot_change_after_creation(admin_client: KubeClient, webhook: WebhookApp) -> None:
    """Why the chart sends claims and templates at creation only: the API server itself refuses a
    change of their spec, before any admission webhook."""
    created = admin_client.send_json("POST", CLAIMS, claim(name("immutable"), config_entry(GOOD)))
    created["spec"]["devices"]["config"][0]["opaque"]["parameters"] = BAD["unknown strategy"][0]
    err = rejection(admin_client, f"{CLAIMS}/{created['metadata']['name']}", created, method="PUT")
    assert err.status == 422 and "field is immutable" in err.message and "admission webhook" not in err.message


def test_another_drivers_config_passes(admin_client: KubeClient, webhook: WebhookApp) -> None:
    parameters, _ = BAD["unknown strategy"]
    admin_client.send_json("POST", CLAIMS, claim(name("other-driver"), config_entry(parameters, "nic.example.com")))


def test_a_template_is_judged_as_its_claims(admin_client: KubeClient, webhook: WebhookApp) -> None:
    admin_client.send_json("POST", TEMPLATES, template(name("template-good"), config_entry(GOOD)))
    for parameters, reason in BAD.values():
        err = rejection(admin_client, TEMPLATES, template(name("template-bad"), config_entry(parameters)))
        assert err.status == 422 and err.message == denied("spec.spec.devices.config[0]", reason)


def test_a_device_class_is_judged_at_creation_and_at_update(admin_client: KubeClient, webhook: WebhookApp) -> None:
    class_name = name("config-webhook-class")
    created = admin_client.send_json("POST", CLASSES, device_class(class_name, config_entry(GOOD)))
    try:
        for parameters, reason in BAD.values():
            err = rejection(admin_client, CLASSES, device_class(name("config-webhook-bad"), config_entry(parameters)))
            assert err.status == 422 and err.message == denied("spec.config[0]", reason)
        # An update that breaks the config is refused; the stored class keeps its good config.
        broken = copy.deepcopy(created)
        broken["spec"]["config"][0]["opaque"]["parameters"] = BAD["unknown strategy"][0]
        err = rejection(admin_client, f"{CLASSES}/{class_name}", broken, method="PUT")
        assert err.status == 422 and err.message == denied("spec.config[0]", BAD["unknown strategy"][1])
        stored = admin_client.get_json(f"{CLASSES}/{class_name}")
        assert stored["spec"]["config"][0]["opaque"]["parameters"] == GOOD
        # An update that keeps the config (a label) passes, as does one to another good config.
        stored["metadata"]["labels"]["team"] = "a"
        stored = admin_client.send_json("PUT", f"{CLASSES}/{class_name}", stored)
        stored["spec"]["config"][0]["opaque"]["parameters"] = PARTITIONED
        admin_client.send_json("PUT", f"{CLASSES}/{class_name}", stored)
    finally:
        admin_client.request("DELETE", f"{CLASSES}/{class_name}")


def test_a_class_stored_with_a_bad_config_can_still_be_relabelled(
    admin_client: KubeClient, webhook: WebhookApp
) -> None:
    """A class created before the webhook (or while it failed open): a change that leaves its
    config alone passes, a change of its config is judged."""
    class_name = name("config-webhook-old")
    unlabelled = device_class(class_name, config_entry(BAD["unknown field"][0]))
    unlabelled["metadata"]["labels"] = {}
    stored = admin_client.send_json("POST", CLASSES, unlabelled)  # the webhook is not asked
    try:
        stored["metadata"]["labels"] = dict(LABEL)  # now it is (objectSelector: old or new object)
        stored = admin_client.send_json("PUT", f"{CLASSES}/{class_name}", stored)
        stored["spec"]["config"].append({"opaque": config_entry(BAD["wrong kind"][0])["opaque"]})
        err = rejection(admin_client, f"{CLASSES}/{class_name}", stored, method="PUT")
        assert err.message == denied("spec.config[1]", BAD["wrong kind"][1])
    finally:
        admin_client.request("DELETE", f"{CLASSES}/{class_name}")


def test_the_reviews_are_counted(admin_client: KubeClient, webhook: WebhookApp) -> None:
    def reviews() -> dict[tuple[str, str], float]:
        code, text = scrape(webhook.metrics_port)  # type: ignore[arg-type]
        assert code == 200
        return {
            (labels["kind"], labels["verdict"]): value
            for family, labels, value in parse_samples(text)
            if family == "otel_dra_webhook_reviews_total"
        }

    before = reviews()
    parameters, _ = BAD["wrong kind"]
    rejection(admin_client, TEMPLATES, template(name("counted"), config_entry(parameters)))
    admin_client.send_json("POST", CLAIMS, claim(name("counted"), config_entry(GOOD)))
    after = reviews()
    assert after[("ResourceClaimTemplate", "denied")] == before[("ResourceClaimTemplate", "denied")] + 1
    assert after[("ResourceClaim", "allowed")] == before[("ResourceClaim", "allowed")] + 1
    assert after[("DeviceClass", "allowed")] >= 1 and after[("DeviceClass", "denied")] >= 3
