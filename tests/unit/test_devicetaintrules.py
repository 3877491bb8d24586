"""DeviceTaintRules and device taints as Kubernetes 1.34-1.37 serve them: one parser for every
version's shape (objects written from k8s.io/api's resource/{v1alpha3,v1beta2,v1}/types.go of
v0.34.4 and v0.37.2), the families they give, and malformed fields counted, never fatal."""

from __future__ import annotations

import copy
from typing import Any

from otel_dra.cluster import devicetaintrule, resourceslice
from otel_dra.cluster.store import ObjectStore

ADDED = "2026-11-30T08:00:00Z"
ADDED_S = 1_796_025_600.0
CHANGED = "2026-11-30T09:30:00Z"
CHANGED_S = 1_796_031_000.0

# 1.34, resource.k8s.io/v1alpha3: the selector still has deviceClassName and CEL selectors; there
# is no status. The API server defaulted timeAdded.
V1ALPHA3_134: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1alpha3",
    "kind": "DeviceTaintRule",
    "metadata": {
        "name": "firmware-outdated",
        "uid": "4f1c7c2e-2a4b-4d0e-9a51-0c8f6a1e2b3c",
        "resourceVersion": "812",
        "generation": 1,
        "creationTimestamp": ADDED,
    },
    "spec": {
        "deviceSelector": {
            "deviceClassName": "gpu.example.com",
            "driver": "gpu.example.com",
            "pool": "node-1",
            "selectors": [{"cel": {"expression": "device.attributes['gpu.example.com'].model == 'LATEST-GPU-MODEL'"}}],
        },
        "taint": {"key": "example.com/firmware", "value": "outdated", "effect": "NoSchedule", "timeAdded": ADDED},
    },
}

# 1.36, resource.k8s.io/v1beta2: deviceClassName and selectors are gone (removed in 1.35); the
# rule has a status; effect None gets EvictionInProgress False once, with what NoExecute would do.
V1BETA2_136: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1beta2",
    "kind": "DeviceTaintRule",
    "metadata": {
        "name": "dry-run",
        "uid": "0d9b3e71-6c55-4a8e-b1f2-7e0a9c4d5f61",
        "resourceVersion": "1204",
        "generation": 1,
        "creationTimestamp": ADDED,
    },
    "spec": {
        "deviceSelector": {"driver": "gpu.example.com", "pool": "node-1", "device": "gpu-3"},
        "taint": {"key": "example.com/maintenance", "effect": "None", "timeAdded": ADDED},
    },
    "status": {
        "conditions": [
            {
                "type": "EvictionInProgress",
                "status": "False",
                "observedGeneration": 1,
                "lastTransitionTime": ADDED,
                "reason": "NoEffect",
                "message": "1 published device selected. 1 allocated device selected. 1 pod would be evicted in "
                "1 namespace if the effect was NoExecute. This information will not be updated again. Recreate "
                "the DeviceTaintRule to trigger an update.",
            }
        ]
    },
}

# 1.37, resource.k8s.io/v1 (GA): a NoExecute rule whose pods are still being evicted; changing the
# effect to NoExecute moved timeAdded.
V1_137: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "DeviceTaintRule",
    "metadata": {
        "name": "drain-gpu-3",
        "uid": "a3e5f0c2-9d14-4b7a-8c6e-2f1d0b9a7e54",
        "resourceVersion": "2301",
        "generation": 2,
        "creationTimestamp": ADDED,
    },
    "spec": {
        "deviceSelector": {"driver": "gpu.example.com", "pool": "node-1", "device": "gpu-3"},
        "taint": {"key": "example.com/maintenance", "value": "drain", "effect": "NoExecute", "timeAdded": CHANGED},
    },
    "status": {
        "conditions": [
            {
                "type": "EvictionInProgress",
                "status": "True",
                "observedGeneration": 2,
                "lastTransitionTime": CHANGED,
                "reason": "PodsPendingEviction",
                "message": "1 pod needs to be evicted in 1 namespace.",
            }
        ]
    },
}

CONDITION = "kube_devicetaintrule_status_condition"
RULE_ADDED = "kube_devicetaintrule_taint_added_timestamp_seconds"
INFO = "kube_devicetaintrule_info"


def _samples(obj: dict[str, Any]) -> tuple[dict[str, list[Any]], list[str]]:
    problems: list[str] = []
    rule = devicetaintrule.parse(obj, problems.append)
    return {f.prom_name: list(f.samples(rule)) for f in devicetaintrule.STATE_FAMILIES}, problems


def test_v1alpha3_of_134_keeps_the_class_and_cel_selectors_and_has_no_status():
    out, problems = _samples(V1ALPHA3_134)
    assert problems == []
    assert out[INFO] == [
        (
            (
                "firmware-outdated",
                "example.com/firmware",
                "outdated",
                "NoSchedule",
                "gpu.example.com",
                "gpu.example.com",
                "node-1",
                "",
            ),
            1.0,
        )
    ]
    assert out[RULE_ADDED] == [(("firmware-outdated",), ADDED_S)]
    assert out[CONDITION] == []
    assert not devicetaintrule.parse(V1ALPHA3_134, print).evaluable  # a class and CEL: not evaluated


def test_v1beta2_of_136_has_no_class_selector_and_reports_its_conditions():
    out, problems = _samples(V1BETA2_136)
    assert problems == []
    [(labels, _)] = out[INFO]
    assert labels == ("dry-run", "example.com/maintenance", "", "None", "", "gpu.example.com", "node-1", "gpu-3")
    assert devicetaintrule.parse(V1BETA2_136, print).evaluable
    assert out[CONDITION] == [
        (("dry-run", "EvictionInProgress", "true"), 0.0),
        (("dry-run", "EvictionInProgress", "false"), 1.0),
        (("dry-run", "EvictionInProgress", "unknown"), 0.0),
    ]


def test_v1_of_137_reports_eviction_in_progress_and_the_time_the_effect_changed():
    out, problems = _samples(V1_137)
    assert problems == []
    assert out[CONDITION] == [
        (("drain-gpu-3", "EvictionInProgress", "true"), 1.0),
        (("drain-gpu-3", "EvictionInProgress", "false"), 0.0),
        (("drain-gpu-3", "EvictionInProgress", "unknown"), 0.0),
    ]
    assert out[RULE_ADDED] == [(("drain-gpu-3",), CHANGED_S)]
    [(labels, _)] = out[INFO]
    assert labels[3] == "NoExecute" and labels[4] == ""


def test_every_version_renders_in_one_store_and_the_same_info_labels():
    store = ObjectStore("devicetaintrules", devicetaintrule.parse, devicetaintrule.STATE_FAMILIES)
    store.replace([V1ALPHA3_134, V1BETA2_136, V1_137])
    text = {f.prom_name: b"".join(c.data for c in chunks).decode() for f, chunks in store.blocks()}
    assert text[INFO].count("\n") == 3
    assert (
        'kube_devicetaintrule_status_condition{condition="EvictionInProgress",devicetaintrule_name="drain-gpu-3",'
        'status="true"} 1.0\n'
    ) in text[CONDITION]
    assert f'{RULE_ADDED}{{devicetaintrule_name="firmware-outdated"}} 1.7960256e+09\n' in text[RULE_ADDED]


def test_malformed_fields_are_counted_and_the_rest_is_served():
    problems: list[str] = []
    store = ObjectStore(
        "devicetaintrules", devicetaintrule.parse, devicetaintrule.STATE_FAMILIES, on_problem=problems.append
    )
    bad_time = copy.deepcopy(V1_137)
    bad_time["metadata"].update(name="bad-time", resourceVersion="1")
    bad_time["spec"]["taint"]["timeAdded"] = "half past nine"
    bad_conditions = copy.deepcopy(V1_137)
    bad_conditions["metadata"].update(name="bad-conditions", resourceVersion="2")
    bad_conditions["status"]["conditions"] = [{"status": "True"}, "junk", {"type": "Odd", "status": "Maybe"}]
    bad_status = copy.deepcopy(V1_137)
    bad_status["metadata"].update(name="bad-status", resourceVersion="3")
    bad_status["status"] = ["not", "an", "object"]
    bad_list = copy.deepcopy(V1_137)
    bad_list["metadata"].update(name="bad-list", resourceVersion="4")
    bad_list["status"]["conditions"] = {"type": "EvictionInProgress"}
    bad_selector = copy.deepcopy(V1_137)
    bad_selector["metadata"].update(name="bad-selector", resourceVersion="5")
    bad_selector["spec"]["deviceSelector"] = "gpu-3"
    no_spec = {"metadata": {"name": "no-spec", "resourceVersion": "6"}}
    store.replace([bad_time, bad_conditions, bad_status, bad_list, bad_selector, no_spec, V1_137])
    # One problem per bad field: the time, two condition entries, the status, the list, the selector,
    # and the missing spec (that object has no series).
    assert len(problems) == 7 and set(problems) == {"devicetaintrules"}
    rules = {r.name: r for r in store.objects()}
    assert "no-spec" not in rules and rules["drain-gpu-3"].conditions == (("EvictionInProgress", "true"),)
    assert rules["bad-time"].time_added is None and rules["bad-time"].conditions
    assert rules["bad-conditions"].conditions == (("Odd", "unknown"),)
    assert rules["bad-status"].conditions == () and rules["bad-list"].conditions == ()
    assert rules["bad-selector"].driver == "" and rules["bad-selector"].time_added == CHANGED_S


def test_device_taints_in_slices_of_134_and_137_carry_time_added():
    problems: list[str] = []
    obj = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "node-1-gpu.example.com-x7k2p", "resourceVersion": "77"},
        "spec": {
            "driver": "gpu.example.com",
            "nodeName": "node-1",
            "pool": {"name": "node-1", "generation": 1, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "taints": [
                        {"key": "example.com/ecc", "value": "uncorrectable", "effect": "NoExecute", "timeAdded": ADDED},
                        {
                            "key": "example.com/ecc",
                            "value": "uncorrectable",
                            "effect": "NoExecute",
                            "timeAdded": CHANGED,
                        },
                        {"key": "example.com/old", "effect": "None"},  # as a 1.33 slice could hold it
                        {"key": "example.com/bad", "effect": "NoSchedule", "timeAdded": 17},
                    ],
                },
                {"name": "gpu-1"},
            ],
        },
    }
    s = resourceslice.parse(obj, problems.append)
    assert len(problems) == 1 and "example.com/bad" in problems[0] and "timeAdded" in problems[0]
    families = {f.prom_name: f for f in resourceslice.STATE_FAMILIES}
    where = ("node-1-gpu.example.com-x7k2p", "gpu.example.com", "node-1", "node-1", "gpu-0")
    assert list(families["kube_resourceslice_device_taint_added_timestamp_seconds"].samples(s)) == [
        ((*where, "example.com/ecc", "uncorrectable", "NoExecute"), ADDED_S)  # identical taints: the earliest
    ]
    # The taint family itself is unchanged: every taint, times or not.
    assert len(list(families["kube_resourceslice_device_taint"].samples(s))) == 3
    assert s.devices[1].taints_added == ()
