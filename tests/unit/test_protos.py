"""The kubelet wire contract (shared/reference/dra-api.md §1) and the committed gRPC stubs.

The kubelet only talks to us if package, service, method, message and field names and numbers
match its own protos exactly; these tests read them back from the generated descriptors.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor

from otel_dra._generated.dra.v1 import api_pb2 as dra_v1
from otel_dra._generated.dra.v1 import api_pb2_grpc as dra_v1_grpc
from otel_dra._generated.dra.v1beta1 import api_pb2 as dra_v1beta1
from otel_dra._generated.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from otel_dra._generated.pluginregistration import api_pb2 as reg
from otel_dra._generated.pluginregistration import api_pb2_grpc as reg_grpc

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "otel_dra" / "_generated"

STRING = FieldDescriptor.TYPE_STRING
BOOL = FieldDescriptor.TYPE_BOOL
MESSAGE = FieldDescriptor.TYPE_MESSAGE
OPTIONAL = "optional"
REPEATED = "repeated"

# message -> {field: (number, type, label, message type or None)}; "map" marks a map field.
DRA_MESSAGES: dict[str, dict[str, tuple[int, int, str, str | None]]] = {
    "NodePrepareResourcesRequest": {"claims": (1, MESSAGE, REPEATED, "Claim")},
    "NodePrepareResourcesResponse": {"claims": (1, MESSAGE, "map", "NodePrepareResourceResponse")},
    "NodePrepareResourceResponse": {
        "devices": (1, MESSAGE, REPEATED, "Device"),
        "error": (2, STRING, OPTIONAL, None),
    },
    "Device": {
        "request_names": (1, STRING, REPEATED, None),
        "pool_name": (2, STRING, OPTIONAL, None),
        "device_name": (3, STRING, OPTIONAL, None),
        "cdi_device_ids": (4, STRING, REPEATED, None),
    },
    "NodeUnprepareResourcesRequest": {"claims": (1, MESSAGE, REPEATED, "Claim")},
    "NodeUnprepareResourcesResponse": {"claims": (1, MESSAGE, "map", "NodeUnprepareResourceResponse")},
    "NodeUnprepareResourceResponse": {"error": (1, STRING, OPTIONAL, None)},
    "Claim": {
        "namespace": (1, STRING, OPTIONAL, None),
        "uid": (2, STRING, OPTIONAL, None),
        "name": (3, STRING, OPTIONAL, None),
    },
}

REG_MESSAGES: dict[str, dict[str, tuple[int, int, str, str | None]]] = {
    "InfoRequest": {},
    "PluginInfo": {
        "type": (1, STRING, OPTIONAL, None),
        "name": (2, STRING, OPTIONAL, None),
        "endpoint": (3, STRING, OPTIONAL, None),
        "supported_versions": (4, STRING, REPEATED, None),
    },
    "RegistrationStatus": {
        "plugin_registered": (1, BOOL, OPTIONAL, None),
        "error": (2, STRING, OPTIONAL, None),
    },
    "RegistrationStatusResponse": {},
}


def _label(field: FieldDescriptor) -> str:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return "map"
    return REPEATED if field.is_repeated else OPTIONAL


def _check_messages(
    file: FileDescriptor, package: str, expected: dict[str, dict[str, tuple[int, int, str, str | None]]]
) -> None:
    assert file.package == package
    assert set(file.message_types_by_name) == set(expected)
    for name, fields in expected.items():
        message: Descriptor = file.message_types_by_name[name]
        assert message.full_name == f"{package}.{name}"
        got = {}
        for f in message.fields:
            label = _label(f)
            if label == "map":
                key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                assert (key.number, key.type) == (1, STRING), f"{name}.{f.name}: map key must be string"
                assert value.number == 2
                target = value.message_type.full_name
            else:
                target = f.message_type.full_name if f.message_type is not None else None
            got[f.name] = (f.number, f.type, label, target)
        want = {k: (num, typ, lab, f"{package}.{msg}" if msg else None) for k, (num, typ, lab, msg) in fields.items()}
        assert got == want, name


@pytest.mark.parametrize(
    ("module", "version"),
    [(dra_v1, "v1"), (dra_v1beta1, "v1beta1")],
)
def test_dra_plugin_wire_contract(module, version):
    package = f"k8s.io.kubelet.pkg.apis.dra.{version}"
    _check_messages(module.DESCRIPTOR, package, DRA_MESSAGES)
    service = module.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert service.full_name == f"{package}.DRAPlugin"
    methods = {
        m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming) for m in service.methods
    }
    assert methods == {
        "NodePrepareResources": ("NodePrepareResourcesRequest", "NodePrepareResourcesResponse", False, False),
        "NodeUnprepareResources": ("NodeUnprepareResourcesRequest", "NodeUnprepareResourcesResponse", False, False),
    }


def test_registration_wire_contract():
    _check_messages(reg.DESCRIPTOR, "pluginregistration", REG_MESSAGES)
    service = reg.DESCRIPTOR.services_by_name["Registration"]
    assert service.full_name == "pluginregistration.Registration"
    methods = {m.name: (m.input_type.name, m.output_type.name) for m in service.methods}
    assert methods == {
        "GetInfo": ("InfoRequest", "PluginInfo"),
        "NotifyRegistrationStatus": ("RegistrationStatus", "RegistrationStatusResponse"),
    }


class _Recorder:
    """A grpc.Channel stand-in that records the method paths a stub is built with."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def unary_unary(self, path: str, *args: object, **kwargs: object) -> None:
        self.paths.append(path)


def test_full_method_names_used_by_stubs():
    """The HTTP/2 paths on the wire, as the generated client stubs send them."""
    expected = {
        dra_v1_grpc.DRAPluginStub: [
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        ],
        dra_v1beta1_grpc.DRAPluginStub: [
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        ],
        reg_grpc.RegistrationStub: [
            "/pluginregistration.Registration/GetInfo",
            "/pluginregistration.Registration/NotifyRegistrationStatus",
        ],
    }
    for stub, paths in expected.items():
        channel = _Recorder()
        stub(channel)
        assert channel.paths == paths


def test_wire_bytes_of_a_known_message():
    """Field numbers and wire types, byte for byte: Claim{namespace="a", uid="b", name="c"}."""
    claim = dra_v1.Claim(namespace="a", uid="b", name="c")
    assert claim.SerializeToString() == b"\x0a\x01a\x12\x01b\x1a\x01c"
    info = reg.PluginInfo(type="DRAPlugin", supported_versions=["v1.DRAPlugin"])
    assert info.SerializeToString() == b"\x0a\x09DRAPlugin\x22\x0cv1.DRAPlugin"


def _generated_files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_committed_stubs_match_protos(tmp_path):
    """`make protos` output equals what is committed (regenerate after editing proto/)."""
    subprocess.run([sys.executable, str(REPO / "proto" / "generate.py"), "--out", str(tmp_path)], check=True)
    fresh = _generated_files(tmp_path / "otel_dra" / "_generated")
    committed = _generated_files(GENERATED)
    assert fresh, "the generator wrote nothing"
    assert sorted(fresh) == sorted(committed), "stub files differ from proto/: run `make protos`"
    for name, content in fresh.items():
        assert committed[name] == content, f"{name} is out of date: run `make protos`"


HEALTH_MESSAGES: dict[str, dict[str, tuple[int, int, str, str | None]]] = {
    "NodeWatchResourcesRequest": {},
    "DeviceIdentifier": {"pool_name": (1, STRING, OPTIONAL, None), "device_name": (2, STRING, OPTIONAL, None)},
    "DeviceHealth": {
        "device": (1, MESSAGE, OPTIONAL, "DeviceIdentifier"),
        "health": (2, FieldDescriptor.TYPE_ENUM, OPTIONAL, None),
        "last_updated_time": (3, FieldDescriptor.TYPE_INT64, OPTIONAL, None),
        "health_check_timeout_seconds": (4, FieldDescriptor.TYPE_INT64, OPTIONAL, None),
        "message": (5, STRING, OPTIONAL, None),
    },
    "NodeWatchResourcesResponse": {"devices": (1, MESSAGE, REPEATED, "DeviceHealth")},
}


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_dra_health_wire_contract(version):
    """k8s.io/kubelet/pkg/apis/dra-health/<version>/api.proto of v1.37.2: gRPC package "v1" or
    "v1alpha1" (the names the kubelet looks for in the registration: v1.DRAResourceHealth ...)."""
    import importlib

    module = importlib.import_module(f"otel_dra._generated.drahealth.{version}.api_pb2")
    stubs = importlib.import_module(f"otel_dra._generated.drahealth.{version}.api_pb2_grpc")
    _check_messages(module.DESCRIPTOR, version, HEALTH_MESSAGES)
    status = module.DESCRIPTOR.enum_types_by_name["HealthStatus"]
    assert {v.name: v.number for v in status.values} == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
    assert module.DESCRIPTOR.message_types_by_name["DeviceHealth"].fields_by_name["health"].enum_type is status
    service = module.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert service.full_name == f"{version}.DRAResourceHealth"
    [method] = service.methods
    assert (method.name, method.input_type.name, method.output_type.name) == (
        "NodeWatchResources",
        "NodeWatchResourcesRequest",
        "NodeWatchResourcesResponse",
    )
    assert (method.client_streaming, method.server_streaming) == (False, True)

    class Recorder:
        paths: list[str] = []

        def unary_stream(self, path: str, *args: object, **kwargs: object) -> None:
            self.paths.append(path)

    channel = Recorder()
    stubs.DRAResourceHealthStub(channel)
    assert channel.paths == [f"/{version}.DRAResourceHealth/NodeWatchResources"]
    wire = module.DeviceHealth(device=module.DeviceIdentifier(pool_name="p", device_name="d"), health=2)
    assert wire.SerializeToString() == b"\x0a\x06\x0a\x01p\x12\x01d\x10\x02"
