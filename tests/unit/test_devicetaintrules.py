"""DeviceTaintRules and device taints as Kubernetes 1.34-1.38 serve them: one parser for every
version's shape (objects written from k8s.io/api's resource/{v1alpha3,v1beta2,v1}/types.go of
v0.34.4 and v0.37.2), the families they give, and malformed fields counted, never fatal; what a
rule without a device selector matches on each release (every device before v1.37.1, none since),
and how the exporter learns the release."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from otel_dra.cluster import devicetaintrule, resourceslice
from otel_dra.cluster.store import ObjectStore
from otel_dra.kube.client import ApiError
from otel_dra.kube.version import KubeVersion, parse_git_version
from tests.unit.test_joins import World, _meta, slice_obj

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


# --- a rule without spec.deviceSelector: every device before v1.37.1, none since -------------------
ABSENT = "kube_devicetaintrule_device_selector_absent"


def _rule(name: str, selector: dict[str, Any] | None, effect: str = "NoSchedule") -> dict[str, Any]:
    """A v1 rule; ``selector`` None leaves spec.deviceSelector out (kubectl only warns)."""
    spec: dict[str, Any] = {"taint": {"key": "example.com/firmware", "effect": effect, "timeAdded": ADDED}}
    if selector is not None:
        spec["deviceSelector"] = selector
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": _meta(name), "spec": spec}


def test_the_parser_tells_an_absent_selector_from_an_empty_one():
    problems: list[str] = []
    absent = devicetaintrule.parse(_rule("absent", None), problems.append)
    empty = devicetaintrule.parse(_rule("empty", {}), problems.append)
    null = _rule("null", None)
    null["spec"]["deviceSelector"] = None  # JSON null: as absent
    by_fields = devicetaintrule.parse(_rule("fields", {"driver": "d", "pool": "p", "device": "x"}), problems.append)
    assert problems == []
    assert (absent.selector_present, empty.selector_present, by_fields.selector_present) == (False, True, True)
    assert devicetaintrule.parse(null, problems.append).selector_present is False
    # Both are evaluable (no class, no CEL) and look the same in the info family: the new family tells.
    assert absent.evaluable and empty.evaluable
    families = {f.prom_name: f for f in devicetaintrule.STATE_FAMILIES}
    info = families[INFO]
    assert [labels[1:] for labels, _ in info.samples(absent)] == [labels[1:] for labels, _ in info.samples(empty)]
    assert list(families[ABSENT].samples(absent)) == [(("absent",), 1.0)]
    assert list(families[ABSENT].samples(empty)) == [(("empty",), 0.0)]
    assert list(families[ABSENT].samples(by_fields)) == [(("fields",), 0.0)]
    # A selector that is not an object is counted and read as {} (present), as before.
    bad = devicetaintrule.parse(_rule("bad", "gpu-3"), problems.append)  # type: ignore[arg-type]
    assert len(problems) == 1 and bad.selector_present and bad.driver == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("v1.37.2", KubeVersion(1, 37, 2)),
        ("v1.38.0-beta.0", KubeVersion(1, 38, 0, 1, 0)),
        ("v1.38.0-rc.1", KubeVersion(1, 38, 0, 2, 1)),
        ("v1.38.0-alpha.3.512+0123456789abcd", KubeVersion(1, 38, 0, 0, 3)),  # a build between tags
        ("v1.37.2-gke.1100", KubeVersion(1, 37, 2)),  # vendors' suffixes are the release itself
        ("v1.37.1-eks-0123456", KubeVersion(1, 37, 1)),
        ("v1.37.1+k3s1", KubeVersion(1, 37, 1)),
        ("1.36.6", KubeVersion(1, 36, 6)),
    ],
)
def test_git_versions_parse_with_kubernetes_pre_releases_only(text, expected):
    version = parse_git_version(text)
    assert version == expected and str(version) == text


@pytest.mark.parametrize("text", ["", "garbage", "v1.37", "v1.x.2", "v0.0.0-master+$Format:%H$", 137, None])
def test_what_is_not_a_version_is_refused_with_the_reason(text):
    with pytest.raises(ValueError, match="gitVersion"):
        parse_git_version(text)


def test_kubernetes_release_order():
    ordered = [
        "v1.34.3",
        "v1.36.6",
        "v1.37.0",
        "v1.37.1-rc.0",
        "v1.37.1",
        "v1.37.1-gke.200",
        "v1.37.2",
        "v1.38.0-alpha.1",
        "v1.38.0-beta.0",
        "v1.38.0-rc.0",
        "v1.38.0",
    ]
    versions = [parse_git_version(v) for v in ordered]
    assert sorted(versions) == versions
    assert versions[4] == versions[5]  # a vendor's v1.37.1 is v1.37.1


@pytest.mark.parametrize(
    ("text", "all_devices"),
    [
        ("v1.34.3", True),
        ("v1.35.4", True),
        ("v1.36.6", True),
        ("v1.37.0", True),
        ("v1.37.1-rc.0", True),  # a build before v1.37.1: the release is what has the change
        ("v1.37.1", False),
        ("v1.37.2", False),
        ("v1.37.1-gke.1100", False),
        ("v1.38.0-alpha.1", False),
        ("v1.38.0-beta.0", False),
        ("v1.38.0", False),
    ],
)
def test_what_an_absent_selector_matches_by_release(text, all_devices):
    assert devicetaintrule.absent_selector_matches_all(parse_git_version(text)) is all_devices


def test_an_unknown_version_gets_the_newest_semantics():
    assert devicetaintrule.absent_selector_matches_all(None) is False


# The pool of the join tests: four devices of driver d in pool p, two of driver e in pool q (so
# that "every device" is seen to cross drivers and pools), nothing allocated.
def _world_with_rules(*rules: dict[str, Any]) -> World:
    w = World()
    w.slices.upsert(slice_obj("s-d", "d", "p", [{"name": f"x{i}"} for i in range(4)]))
    w.slices.upsert(slice_obj("s-e", "e", "q", [{"name": "y0"}, {"name": "y1"}]))
    for rule in rules:
        w.rules.upsert(rule)
    return w


def _free(w: World) -> dict[str, float]:
    return {s.split('pool="')[1].split('"')[0]: v for s, v in w.samples("kube_resourcepool_devices_free").items()}


ALL_FREE = {"p": 4.0, "q": 2.0}
NONE_FREE = {"p": 0.0, "q": 0.0}


@pytest.mark.parametrize(
    ("text", "free"),
    [
        ("v1.36.6", NONE_FREE),
        ("v1.37.0", NONE_FREE),
        ("v1.37.1", ALL_FREE),
        ("v1.37.2", ALL_FREE),
        ("v1.38.0-beta.0", ALL_FREE),
    ],
)
def test_a_rule_without_a_selector_blocks_every_device_before_1_37_1_and_none_since(text, free):
    w = _world_with_rules(_rule("absent", None))
    w.joins.set_server_version(parse_git_version(text))
    assert _free(w) == free
    # Whichever comes first, the version or the rule: the same figures.
    w2 = World()
    w2.joins.set_server_version(parse_git_version(text))
    w2.rules.upsert(_rule("absent", None))
    w2.slices.upsert(slice_obj("s-d", "d", "p", [{"name": f"x{i}"} for i in range(4)]))
    w2.slices.upsert(slice_obj("s-e", "e", "q", [{"name": "y0"}, {"name": "y1"}]))
    assert _free(w2) == free


@pytest.mark.parametrize("text", ["v1.34.3", "v1.36.6", "v1.37.0", "v1.37.1", "v1.37.2", "v1.38.0-beta.0"])
def test_an_empty_selector_blocks_every_device_on_every_release(text):
    w = _world_with_rules(_rule("empty", {}))
    w.joins.set_server_version(parse_git_version(text))
    assert _free(w) == NONE_FREE


@pytest.mark.parametrize("text", ["v1.36.6", "v1.37.0", "v1.37.2", "v1.38.0-beta.0"])
def test_a_selector_by_driver_pool_and_device_blocks_what_it_names_on_every_release(text):
    w = _world_with_rules(
        _rule("device", {"driver": "d", "pool": "p", "device": "x1"}),
        _rule("pool", {"driver": "e", "pool": "q"}),
        _rule("no-effect", {"driver": "d"}, effect="None"),  # informational: blocks nothing
    )
    w.joins.set_server_version(parse_git_version(text))
    assert _free(w) == {"p": 3.0, "q": 0.0}
    w.rules.delete(_rule("pool", {}))
    assert _free(w) == {"p": 3.0, "q": 2.0}


def test_an_upgrade_across_1_37_1_re_evaluates_once_and_equals_a_fresh_computation():
    w = _world_with_rules(_rule("absent", None), _rule("device", {"driver": "d", "device": "x0"}))
    assert _free(w) == {"p": 3.0, "q": 2.0}  # version not read yet: the newest semantics
    w.joins.set_server_version(parse_git_version("v1.37.0"))
    assert _free(w) == NONE_FREE
    w.joins.set_server_version(parse_git_version("v1.37.2"))  # upgraded in place
    assert _free(w) == {"p": 3.0, "q": 2.0}
    fresh = _world_with_rules(_rule("absent", None), _rule("device", {"driver": "d", "device": "x0"}))
    fresh.joins.set_server_version(parse_git_version("v1.37.2"))
    assert fresh.joined() == w.joined()
    # The rule going away on an old release frees what it blocked.
    w.joins.set_server_version(parse_git_version("v1.36.6"))
    w.rules.delete(_rule("absent", None))
    assert _free(w) == {"p": 3.0, "q": 2.0}


def test_a_version_change_without_absent_selector_rules_evaluates_nothing(monkeypatch):
    from otel_dra.cluster import joins

    w = _world_with_rules(_rule("empty", {}))
    evaluated: list[str] = []
    real = joins.evaluate
    monkeypatch.setattr(joins, "evaluate", lambda s, *a: evaluated.append(s.name) or real(s, *a))
    w.joins.set_server_version(parse_git_version("v1.36.6"))
    w.joins.set_server_version(parse_git_version("v1.38.0-beta.0"))
    assert evaluated == []
    w.rules.upsert(_rule("absent", None))  # matches nothing on 1.38: no slice to evaluate either
    assert evaluated == []
    w.joins.set_server_version(parse_git_version("v1.37.0"))
    assert sorted(evaluated) == ["s-d", "s-e"]  # each slice once


class _VersionClient:
    """Answers GET /version from a script of answers (a dict, or an exception to raise)."""

    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.paths: list[str] = []

    def get_json(self, path: str, query: Any = None, *, timeout: Any = None) -> Any:
        self.paths.append(path)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def _version_doc(git_version: str) -> dict[str, str]:
    major, minor = git_version.lstrip("v").split(".")[:2]
    return {"major": major, "minor": minor, "gitVersion": git_version, "platform": "linux/amd64"}


def test_server_version_is_read_and_a_change_is_handed_on(caplog):
    heard: list[KubeVersion | None] = []
    client = _VersionClient(_version_doc("v1.37.0"), _version_doc("v1.37.0"), _version_doc("v1.37.2"))
    tracker = devicetaintrule.ServerVersion(client, heard.append)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="otel_dra.cluster.devicetaintrule"):
        for _ in range(3):
            tracker.refresh()
    assert client.paths == ["/version"] * 3
    assert heard == [KubeVersion(1, 37, 0), KubeVersion(1, 37, 2)]  # the same version again: nothing
    assert tracker.version == KubeVersion(1, 37, 2)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "API server v1.37.0: DeviceTaintRules without spec.deviceSelector match every device",
        "API server v1.37.2: DeviceTaintRules without spec.deviceSelector match no device",
    ]


@pytest.mark.parametrize(
    "answer",
    [
        ApiError(403, "Forbidden", '{"message": "forbidden: User cannot get path \\"/version\\""}'),
        ValueError("Expecting value: line 1 column 1 (char 0)"),  # what json.loads raises for garbage
        {"gitVersion": "v0.0.0-master+$Format:%H$"},
        {"major": "1"},
        ["not", "an", "object"],
    ],
)
def test_an_unreadable_version_warns_once_and_falls_back_to_the_newest_semantics(answer, caplog):
    heard: list[KubeVersion | None] = []
    tracker = devicetaintrule.ServerVersion(_VersionClient(answer, answer, answer), heard.append)  # type: ignore[arg-type]
    w = _world_with_rules(_rule("absent", None))
    with caplog.at_level(logging.INFO, logger="otel_dra.cluster.devicetaintrule"):
        for _ in range(3):
            tracker.refresh()  # never raises
    assert tracker.version is None and heard == []
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and len(caplog.records) == 1
    assert "cannot read the API server's version" in warnings[0].getMessage()
    assert "taken to match no device" in warnings[0].getMessage()
    # The joins, never told a version, apply the newest releases' rule: nothing blocked.
    assert _free(w) == ALL_FREE


def test_an_unanswered_version_is_logged_at_info_and_a_failed_re_read_keeps_the_last(caplog):
    heard: list[KubeVersion | None] = []
    client = _VersionClient(
        ApiError(0, "connection refused"),
        ApiError(503, "Service Unavailable"),
        _version_doc("v1.36.6"),
        ApiError(0, "connection refused"),  # an outage later: the version stays
    )
    tracker = devicetaintrule.ServerVersion(client, heard.append)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="otel_dra.cluster.devicetaintrule"):
        for _ in range(4):
            tracker.refresh()
    assert heard == [KubeVersion(1, 36, 6)] and tracker.version == KubeVersion(1, 36, 6)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3  # the first transient failure only, the version, the kept version
    assert "reading it again when the connection is back" in messages[0]
    assert "keeping v1.36.6" in messages[2]


def test_the_exporter_reads_the_version_on_the_rules_reflector_only_when_a_join_needs_rules():
    from opentelemetry.sdk.metrics import MeterProvider

    from otel_dra.cluster.exporter import ClusterState
    from otel_dra.cluster.selection import FamilySelection

    client = _VersionClient(_version_doc("v1.36.6"))
    state = ClusterState(client, MeterProvider())  # type: ignore[arg-type]
    [rules] = [r for r in state.reflectors if r.resource.plural == "devicetaintrules"]
    assert state.server_version is not None and rules.on_connect == state.server_version.refresh
    assert all(r.on_connect is None for r in state.reflectors if r is not rules)
    rules.on_connect()
    assert state.server_version.version == KubeVersion(1, 36, 6)
    # Only the rules' own families (no free-device count): the version changes nothing, is not read.
    names = [f.prom_name for f in devicetaintrule.STATE_FAMILIES]
    own_only = ClusterState(
        client,  # type: ignore[arg-type]
        MeterProvider(),
        families=FamilySelection.parse(",".join(names), allow=True, names=names),
    )
    assert own_only.server_version is None and all(r.on_connect is None for r in own_only.reflectors)
