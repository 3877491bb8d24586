"""Pods listed as protobuf, against the real API server of the version under test.

The exporter lists pods as protobuf and decodes only the fields its pod families read
(proto/otel_dra/_generated/k8s/). These tests hold that to the API server's JSON: for pods of every
shape the families care about, what the protobuf list decodes to parses exactly as the JSON list
does; the reflector really gets protobuf pages (and follows their continue tokens); and the
trimmed messages' field numbers and types are those of the upstream ``generated.proto`` of the
Kubernetes version built for the testbed.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from bench.workload import Workload, placement, pod_name
from bench.workload import pod as bench_pod
from otel_dra._generated.k8s import core_pb2, meta_pb2
from otel_dra.cluster import pod as pods
from otel_dra.fixtures import create
from otel_dra.kube import protobuf
from otel_dra.kube.client import KubeClient
from otel_dra.kube.reflector import Reflector
from otel_dra.testbed.build import go_environment, kubernetes_release, version_key
from tests.helpers import wait_until

NS = "pods-protobuf"
WORKLOAD = Workload(claims=4, namespaces=1)


def _pods() -> list[dict[str, Any]]:
    """Bench pods (a template claim with its resourceClaimStatuses, a direct claim, device health
    in allocatedResourcesStatus), plus an init container's device health, a pod with no claims and
    one whose health entries name a device-plugin resource and an unknown health."""
    out = []
    for j in range(WORKLOAD.claims):
        p = bench_pod(j, WORKLOAD)
        p["metadata"]["namespace"] = NS
        p["spec"].pop("nodeName")  # nothing runs these; unbound, they are never scheduled either
        out.append(p)
    init = copy.deepcopy(out[1])
    init["metadata"]["name"] = "with-init"
    # Same requests as the main container: the status's qosClass (Guaranteed) must still hold.
    resources = copy.deepcopy(init["spec"]["containers"][0]["resources"])
    init["spec"]["initContainers"] = [{"name": "setup", "image": "busybox", "resources": resources}]
    status = copy.deepcopy(init["status"]["containerStatuses"][0])
    status["name"] = "setup"
    status["allocatedResourcesStatus"][0]["resources"].append(
        {"resourceID": "gpu.nvidia.com/pool-b/gpu-9", "health": "Unhealthy"}
    )
    init["status"]["initContainerStatuses"] = [status]
    plain = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "no-claims", "namespace": NS},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }
    return [*out, init, plain]


@pytest.fixture(scope="module")
def listed(admin_client: KubeClient) -> KubeClient:
    create(admin_client, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    for p in _pods():
        create(admin_client, p)
    return admin_client


def _json_items(client: KubeClient) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = client.get_json(f"/api/v1/namespaces/{NS}/pods")["items"]
    return items


def _parsed(items: list[dict[str, Any]]) -> dict[str, pods.Pod]:
    problems: list[str] = []
    return {f"{p.namespace}/{p.name}": p for p in (pods.parse(i, problems.append) for i in items)}


def test_protobuf_list_parses_as_the_json_list(listed: KubeClient) -> None:
    raw = listed.get_bytes(f"/api/v1/namespaces/{NS}/pods", headers={"Accept": protobuf.ACCEPT})
    assert protobuf.is_protobuf(raw), raw[:80]
    page = protobuf.list_page(raw)
    decoded = [pods.from_protobuf(item) for item in page.items]
    from_json = _json_items(listed)
    assert len(decoded) == len(from_json) == 6
    assert _parsed(decoded) == _parsed(from_json)
    # The store keys and checks objects by metadata: the same from both.
    assert [d["metadata"] for d in decoded] == [
        {k: j["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion")} for j in from_json
    ]
    # What the families need is really there (not two empty parses that agree).
    parsed = _parsed(decoded)
    assert {r.template for r in parsed[f"{NS}/{pod_name(0)}"].claims} == {"one-gpu"}
    assert parsed[f"{NS}/{pod_name(0)}"].claims[0].resourceclaim == "claim-000000"
    # allocatedResourcesStatus is kept by API servers with ResourceHealthStatus on (beta, on by
    # default, from 1.36; earlier ones drop it, from JSON and protobuf alike).
    pool, device = placement(1, WORKLOAD)
    health = sorted((h.container, h.pool, h.device, h.health) for h in parsed[f"{NS}/with-init"].health)
    if version_key(kubernetes_release().minor) >= (1, 36):
        assert health == [
            ("setup", pool, device, "Healthy"),
            ("setup", "pool-b", "gpu-9", "Unhealthy"),
            ("trainer", pool, device, "Healthy"),
        ]
    else:
        assert health == []
    assert parsed[f"{NS}/no-claims"] == pods.Pod(NS, "no-claims", parsed[f"{NS}/no-claims"].uid)
    # Far fewer bytes than the JSON list.
    assert len(raw) < 0.85 * len(listed.get_bytes(f"/api/v1/namespaces/{NS}/pods"))


class _Recorder:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def replace(self, objects: Any) -> None:
        self.items = list(objects)

    def upsert(self, obj: dict[str, Any]) -> None: ...

    def delete(self, obj: dict[str, Any]) -> None: ...


class _Counting(KubeClient):
    """The real client, recording the list requests and their answers' encodings."""

    def __init__(self, base: KubeClient) -> None:
        super().__init__(base.credentials)
        self.encodings: list[str] = []
        self.queries: list[dict[str, Any]] = []

    def get_bytes(self, path: str, query: Any = None, **kwargs: Any) -> bytes:
        data = super().get_bytes(path, query, **kwargs)
        self.queries.append(dict(query or {}))
        self.encodings.append("protobuf" if protobuf.is_protobuf(data) else "json")
        return data

    def request(self, method: str, path: str, query: Any = None, **kwargs: Any) -> Any:
        resp = super().request(method, path, query=query, **kwargs)
        if method == "GET" and kwargs.get("stream") and "watch" not in (query or {}):  # a list's first answer
            self.queries.append(dict(query or {}))
            kind = resp.headers.get("Content-Type", "")
            self.encodings.append("protobuf" if kind.startswith(protobuf.MEDIA_TYPE) else "json")
        return resp


def test_reflector_lists_pods_as_protobuf_from_the_watch_cache(listed: KubeClient) -> None:
    """The initial list asks for resourceVersion 0, which the API server answers from its watch
    cache in one answer whatever the limit (read as a stream), as protobuf."""
    client = _Counting(listed)
    recorder = _Recorder()
    reflector = Reflector(client, pods.RESOURCE, recorder, page_size=2, field_selector=f"metadata.namespace={NS}")
    reflector.start()
    try:
        wait_until(lambda: reflector.state().has_synced, timeout=30)
    finally:
        reflector.stop()
    assert client.encodings == ["protobuf"], client.encodings
    assert client.queries[0]["resourceVersion"] == "0" and client.queries[0]["limit"] == 2
    assert len(recorder.items) == 6  # 6 pods although the limit is 2: the cache ignores it
    assert _parsed(recorder.items) == _parsed(_json_items(listed))


_FIELD = re.compile(r"^\s*(?:(optional|repeated) (\S+)|map<(\S+), (\S+)>) (\w+) = (\d+);", re.M)
_SCALARS = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BYTES: "bytes",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
}


def _short(type_name: str) -> str:
    return type_name.rsplit(".", 1)[-1]


def _upstream_messages(path: Path) -> dict[str, dict[str, tuple[int, str, str]]]:
    """message -> field -> (number, label, type) from an upstream generated.proto; a map is
    ("map", "key,value")."""
    out: dict[str, dict[str, tuple[int, str, str]]] = {}
    for m in re.finditer(r"^message (\w+) \{\n(.*?)^\}", path.read_text(), re.M | re.S):
        fields = {}
        for f in _FIELD.finditer(m[2]):
            label, kind = (f[1], _short(f[2])) if f[1] else ("map", f"{_short(f[3])},{_short(f[4])}")
            fields[f[5]] = (int(f[6]), label, kind)
        out[m[1]] = fields
    return out


def _type(f: FieldDescriptor) -> str:
    return f.message_type.name if f.message_type is not None else _SCALARS[f.type]


def _ours(message: Descriptor) -> dict[str, tuple[int, str, str]]:
    out = {}
    for f in message.fields:
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
            out[f.name] = (f.number, "map", f"{_type(key)},{_type(value)}")
        else:
            out[f.name] = (f.number, "repeated" if f.is_repeated else "optional", _type(f))
    return out


def test_trimmed_messages_match_the_upstream_protos() -> None:
    release = kubernetes_release()
    minor = release.version.removeprefix("v1.")
    mod = Path(go_environment()["GOMODCACHE"]) / "k8s.io"
    core = _upstream_messages(mod / f"api@v0.{minor}" / "core" / "v1" / "generated.proto")
    machinery = mod / f"apimachinery@v0.{minor}" / "pkg"
    meta = _upstream_messages(machinery / "apis" / "meta" / "v1" / "generated.proto")
    runtime = _upstream_messages(machinery / "runtime" / "generated.proto")
    upstream = {**core, **meta, **runtime}
    checked = 0
    checked = 0
    for module in (core_pb2, meta_pb2):
        for name, message in module.DESCRIPTOR.message_types_by_name.items():
            if name == "List":  # ours: the shape every XList shares
                assert upstream["PodList"]["metadata"][0] == 1 and upstream["PodList"]["items"][:2] == (2, "repeated")
                continue
            theirs = upstream[name]
            for field, want in _ours(message).items():
                if field in theirs:
                    assert theirs[field] == want, f"{name}.{field}"
                    checked += 1
                else:  # a field newer than this version: its number must be free there
                    assert want[0] not in {number for number, _, _ in theirs.values()}, f"{name}.{field}"
    assert checked >= 20
