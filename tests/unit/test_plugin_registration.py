"""The plugin refuses what the kubelet (1.38) refuses to register: otel_dra/plugin/registration.py,
rule by rule at its limits, the start-up (CLI and PluginServer) that applies it, and the sockets at
the longest path the kubelet takes.

The expectations are the kubelet's answers, read from its code (k8s.io/kubernetes v1.38.0-beta.0,
pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go: validateDriverName, validateEndpoint; Go 1.27.3's
net/url) and checked against that code compiled (a differential run over 120,000 generated names
and paths, no difference). tests/integration/test_node_registration.py proves them on a real kubelet.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from otel_dra._generated.pluginregistration import api_pb2 as reg_pb2
from otel_dra._generated.pluginregistration import api_pb2_grpc as reg_grpc
from otel_dra.cli import main
from otel_dra.cli.plugin import parse_driver_name
from otel_dra.plugin.health import taint_key
from otel_dra.plugin.registration import (
    MAX_SOCKET_PATH_BYTES,
    driver_name_problem,
    endpoint_problem,
    go_to_lower,
    registration_socket_problem,
    startup_problem,
)
from otel_dra.plugin.server import PluginServer, PluginStartError
from otel_dra.plugin.slices import slice_name

PLUGINS = Path("/var/lib/kubelet/plugins")
REGISTRY = Path("/var/lib/kubelet/plugins_registry")


# --- the driver name: ValidateCSIDriverName ----------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "a",
        "gpu.example.com",
        "x" * 63,  # the limit: at most 63 bytes
        "a." * 31 + "a",  # 63 bytes of one-letter labels
        "0gpu.example.com",  # a digit may start it
        "gpu-1.example-2.com",
        # ToLower comes before the DNS-1123 check, so upper case registers (and the API server takes
        # it in a ResourceSlice's spec.driver: the same ValidateCSIDriverName).
        "GPU.Example.COM",
        "G" * 63,
        # Go's ToLower maps these two non-ASCII runes into ASCII (and no other): accepted as 'k', 'i'.
        "\u212a8s.example.com",
        "\u0130o.example.com",
        "\u212a" + "x" * 60,  # 61 characters, 63 bytes: the limit counts bytes
    ],
)
def test_driver_names_the_kubelet_registers(name: str) -> None:
    assert driver_name_problem(name) is None
    assert parse_driver_name(name) == name


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("", "must not be empty"),
        ("x" * 64, "64 bytes long, more than 63"),
        ("G" * 64, "64 bytes long, more than 63"),
        # Bytes, not characters: the Kelvin sign is 3 bytes, so 62 characters are 64 bytes.
        ("\u212a" + "x" * 61, "64 bytes long, more than 63"),
        ("-gpu.example.com", "not a DNS-1123 subdomain"),
        ("gpu.example.com-", "not a DNS-1123 subdomain"),
        (".gpu.example.com", "not a DNS-1123 subdomain"),
        ("gpu.example.com.", "not a DNS-1123 subdomain"),
        ("gpu..example.com", "not a DNS-1123 subdomain"),
        ("gpu-.example.com", "not a DNS-1123 subdomain"),  # each label ends with a letter or digit
        ("gpu_example.com", "not a DNS-1123 subdomain"),
        ("gpu example.com", "not a DNS-1123 subdomain"),
        ("../evil", "not a DNS-1123 subdomain"),
        ("gpu/example", "not a DNS-1123 subdomain"),
        ("gpu.example.com\n", "not a DNS-1123 subdomain"),  # Go's $ is the end of the text
        (" gpu.example.com", "not a DNS-1123 subdomain"),  # nothing is stripped: the kubelet does not
        ("gpü.example.com", "not a DNS-1123 subdomain"),
        ("_" * 64, "64 bytes long, more than 63 and is not a DNS-1123 subdomain"),  # both, as Go lists both
    ],
)
def test_driver_names_the_kubelet_refuses(name: str, rule: str) -> None:
    problem = driver_name_problem(name)
    assert problem is not None and rule in problem and "ValidateCSIDriverName" in problem
    with pytest.raises(argparse.ArgumentTypeError, match="ValidateCSIDriverName") as exc:
        parse_driver_name(name)
    assert repr(name) in str(exc.value)


def test_go_to_lower_is_go_strings_to_lower_for_the_name_rules() -> None:
    assert go_to_lower("GPU.Example.COM") == "gpu.example.com"
    assert go_to_lower("\u212a\u0130") == "ki"  # Python's lower() would give "k" + "i\u0307"
    assert go_to_lower("Ä") == "Ä"  # non-ASCII stays non-ASCII: the rules refuse it either way


# --- the endpoint: validateEndpoint -----------------------------------------------------------------


def _path(size: int, filler: str = "a") -> str:
    """An absolute path of exactly ``size`` UTF-8 bytes."""
    body = filler * ((size - 1) // len(filler.encode()))
    return "/" + body + "a" * (size - 1 - len(body.encode()))


def test_the_endpoint_is_at_most_107_bytes() -> None:
    # The kubelet refuses len(endpoint) >= 108 (unixPathMax, the size of sun_path): the length of
    # the Go string, without a NUL; 107 bytes and the NUL fill sun_path.
    assert MAX_SOCKET_PATH_BYTES == 107
    assert endpoint_problem(_path(107)) is None
    problem = endpoint_problem(_path(108))
    assert problem is not None and "108 bytes long; the kubelet takes at most 107" in problem
    # Bytes, not characters: 'é' is two bytes in UTF-8.
    assert len(_path(107, "é")) == 54 and endpoint_problem(_path(107, "é")) is None
    assert len(_path(108, "é")) == 55 and endpoint_problem(_path(108, "é")) is not None
    assert len("/" + "é" * 54) == 55 and endpoint_problem("/" + "é" * 54) is not None  # 109 bytes


@pytest.mark.parametrize("endpoint", ["dra.sock", "./dra.sock", "plugins/gpu.example.com/dra.sock", "~/dra.sock"])
def test_a_relative_endpoint_is_refused(endpoint: str) -> None:
    problem = endpoint_problem(endpoint)
    assert problem is not None and "must be an absolute path" in problem


def test_an_empty_endpoint_is_refused() -> None:
    assert endpoint_problem("") == "must not be empty (kubelet: validateEndpoint)"


@pytest.mark.parametrize(
    "endpoint",
    [
        "/",
        # url.Parse cleans nothing, and the kubelet compares with what url.Parse gives: '..', a
        # '//' inside and a trailing '/' pass (the kubelet does not call filepath.Clean).
        "/var/lib/kubelet/plugins/../plugins/gpu.example.com/dra.sock",
        "/var/lib/kubelet/plugins/./gpu.example.com/dra.sock",
        "/var/lib/kubelet//plugins/gpu.example.com/dra.sock",
        "/var/lib/kubelet/plugins/gpu.example.com/",
        # Characters that URL parsing leaves alone in a path.
        "/var/lib/kubelet/my plugins/dra.sock",
        "/var/lib/kubelet/a+b/dra.sock",
        "/var/lib/kubelet/a:b@c/dra.sock",
        "/var/lib/kubelet/~a!$&'()*,;=[]/dra.sock",
        "/var/lib/kubelet/pluginé/dra.sock",
        "/var/lib/kubelet/\\/dra.sock",
    ],
)
def test_endpoints_the_kubelet_registers(endpoint: str) -> None:
    assert endpoint_problem(endpoint) is None


@pytest.mark.parametrize(
    ("endpoint", "rule"),
    [
        # url.Parse percent-decodes the path: any '%' either fails (a malformed escape) or changes it.
        ("/plugins/%2e%2e/%2e%2e/run/evil.sock", "'%'"),
        ("/plugins/100%/dra.sock", "'%'"),
        ("/plugins/%25/dra.sock", "'%'"),
        ("/plugins/%zz/dra.sock", "'%'"),
        ("/plugins/x/dra.sock?x=1", "'?', which starts a query"),
        ("/plugins/x/dra.sock?", "'?', which starts a query"),  # an empty query still cuts the path
        ("/plugins/x/dra.sock#frag", "'#', which starts a fragment"),
        ("/plugins/x/dra.sock#", "'#', which starts a fragment"),
        ("//host/path/dra.sock", "starts with '//', which starts a host"),
        ("///path/dra.sock", "starts with '//', which starts a host"),  # an empty host: the path still changes
        ("//", "starts with '//'"),
        ("/plugins/a\nb/dra.sock", "control character '\\n'"),
        ("/plugins/a\tb/dra.sock", "control character '\\t'"),
        ("/plugins/a\x7fb/dra.sock", "control character '\\x7f'"),
        ("/plugins/a\x00b/dra.sock", "control character '\\x00'"),
    ],
)
def test_endpoints_that_url_parsing_changes_are_refused(endpoint: str, rule: str) -> None:
    problem = endpoint_problem(endpoint)
    assert problem is not None and problem.startswith("must be a plain path") and rule in problem, problem
    assert problem.endswith("(kubelet: validateEndpoint)")


# --- the registration socket: how the kubelet dials it ---------------------------------------------


def test_the_registration_socket_is_at_most_107_bytes_and_url_plain() -> None:
    assert registration_socket_problem(_path(107)) is None
    problem = registration_socket_problem(_path(108))
    assert problem is not None and "108 bytes long" in problem
    for bad in ("/reg?istry/x-reg.sock", "/reg#istry/x-reg.sock", "/reg%41/x-reg.sock", "/reg\n/x-reg.sock"):
        assert registration_socket_problem(bad) is not None, bad
    # grpc-go dials passthrough:///<path>: a leading '//' still names the same file there.
    assert registration_socket_problem("//var/lib/kubelet/plugins_registry/x-reg.sock") is None


# --- at start-up: the flags and the paths they make ---------------------------------------------------


def test_the_default_directories_take_a_63_byte_driver_name() -> None:
    # /var/lib/kubelet/plugins/<63>/dra.sock is 97 bytes, /var/lib/kubelet/plugins_registry/<63>-reg.sock 106.
    assert startup_problem("x" * 63, PLUGINS, REGISTRY) is None
    assert startup_problem("gpu.example.com", PLUGINS, REGISTRY) is None


def test_startup_names_the_flag_the_value_and_the_rule() -> None:
    assert startup_problem("gpu_example", PLUGINS, REGISTRY) == (
        "--driver-name 'gpu_example' is not a DNS-1123 subdomain, case aside: letters, digits, '-' and '.', "
        "starting and ending with a letter or digit, no '..' (and no '_') (kubelet: ValidateCSIDriverName)"
    )
    assert startup_problem("gpu.example.com", Path("/var/lib/kube?let/plugins"), REGISTRY) == (
        "--kubelet-plugins-directory-path '/var/lib/kube?let/plugins': the DRA endpoint "
        "'/var/lib/kube?let/plugins/gpu.example.com/dra.sock' must be a plain path: it contains '?', "
        "which starts a query in a URL (kubelet: validateEndpoint)"
    )
    # pathlib keeps exactly two leading slashes (POSIX leaves their meaning open): the endpoint
    # would start a URL's host.
    problem = startup_problem("gpu.example.com", Path("//var/lib/kubelet/plugins"), REGISTRY)
    assert (
        problem is not None and "'//var/lib/kubelet/plugins/gpu.example.com/dra.sock' must be a plain path" in problem
    )
    long_dir = Path(_path(107 - len("/gpu.example.com/dra.sock") + 1))
    problem = startup_problem("gpu.example.com", long_dir, REGISTRY)
    assert problem is not None and "108 bytes long; the kubelet takes at most 107" in problem
    problem = startup_problem("gpu.example.com", PLUGINS, Path("/var/lib/kubelet/plugins%registry"))
    assert problem is not None and problem.startswith(
        "--kubelet-registrar-directory-path '/var/lib/kubelet/plugins%registry'"
    )
    # A directory name that is not UTF-8 cannot travel in the registration (a protobuf string).
    problem = startup_problem("gpu.example.com", Path(os.fsdecode(b"/var/lib/\xff/plugins")), REGISTRY)
    assert problem is not None and "not valid UTF-8" in problem


def test_the_driver_name_is_checked_first() -> None:
    # The paths are made from it: "../x" would put dra.sock elsewhere, and that is not the reason.
    problem = startup_problem("../x", Path("/a?b"), REGISTRY)
    assert problem is not None and problem.startswith("--driver-name '../x'")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--driver-name", "gpu_example.com"], "argument --driver-name: 'gpu_example.com' is not a DNS-1123 subdomain"),
        (["--driver-name", "x" * 64], "is 64 bytes long, more than 63 (kubelet: ValidateCSIDriverName)"),
        (["--driver-name=-gpu"], "'-gpu' is not a DNS-1123 subdomain"),  # "=": argparse takes "-gpu" for a flag
    ],
)
def test_the_cli_refuses_a_bad_driver_name_with_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plugin", "--node-name", "n1", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_the_cli_refuses_a_bad_driver_name_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DRIVER_NAME", "Gpu_Example")
    assert main(["plugin", "--node-name", "n1"]) == 2
    err = capsys.readouterr().err
    assert "environment variable DRIVER_NAME: 'Gpu_Example' is not a DNS-1123 subdomain" in err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--kubelet-plugins-directory-path", "/tmp/a#b"],
            "--kubelet-plugins-directory-path '/tmp/a#b': the DRA endpoint '/tmp/a#b/gpu.example.com/dra.sock' "
            "must be a plain path: it contains '#', which starts a fragment in a URL (kubelet: validateEndpoint)",
        ),
        (
            ["--kubelet-plugins-directory-path", "/tmp/" + "d" * 100],
            "is 130 bytes long; the kubelet takes at most 107",
        ),
        (
            ["--kubelet-registrar-directory-path", "/tmp/r%2e"],
            "--kubelet-registrar-directory-path '/tmp/r%2e': the registration socket '/tmp/r%2e/gpu.example.com-reg.sock' "
            "contains '%', which the kubelet's gRPC dial parses as URL syntax",
        ),
    ],
)
def test_the_cli_refuses_bad_directories_before_starting(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Exit 2 before anything starts: no credentials read (there are none here), no file written.
    assert main(["plugin", "--node-name", "n1", "--cdi-root", str(tmp_path / "cdi"), *argv]) == 2
    err = capsys.readouterr().err
    assert "otel-dra: error: --kubelet-" in err and expected in err and "Traceback" not in err
    assert not (tmp_path / "cdi").exists()


# --- the plugin's sockets -------------------------------------------------------------------------


class _NoApi:
    host = "https://127.0.0.1:1"  # never asked: no claim is prepared


def _driver(root: Path) -> Any:
    """A Driver that no RPC reaches: registration is all these tests do."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.trace import NoOpTracerProvider

    from otel_dra.plugin.cdi import CdiWriter
    from otel_dra.plugin.checkpoint import Checkpoint
    from otel_dra.plugin.devices import simulated_devices
    from otel_dra.plugin.driver import Driver, Inventory
    from otel_dra.plugin.metrics import PluginMetrics

    return Driver(
        client=_NoApi(),
        driver_name="gpu.example.com",
        node_name="node-a",
        inventory=Inventory(simulated_devices("node-a", 1)),
        cdi=CdiWriter(root / "cdi", "gpu.example.com", "node-a"),
        checkpoint=Checkpoint(root / "checkpoint.json"),
        metrics=PluginMetrics(MeterProvider(shutdown_on_exit=False)),
        tracer_provider=NoOpTracerProvider(),
    )


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="reg-", dir="/tmp"))  # room to pad socket paths up to 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_plugin_server_refuses_before_it_creates_anything(short_dir: Path) -> None:
    driver = _driver(short_dir)
    with pytest.raises(PluginStartError, match=r"--driver-name 'gpu_x' .*ValidateCSIDriverName"):
        PluginServer(driver, driver_name="gpu_x", plugins_dir=short_dir / "p", registrar_dir=short_dir / "r")
    with pytest.raises(PluginStartError, match=r"--kubelet-plugins-directory-path .* must be a plain path"):
        PluginServer(driver, driver_name="gpu.example.com", plugins_dir=short_dir / "p?", registrar_dir=short_dir / "r")
    assert not any(p.name.startswith(("p", "r")) for p in short_dir.iterdir())


def _padded(base: Path, size: int, tail: str) -> Path:
    """A directory under ``base`` such that ``<dir><tail>`` is ``size`` bytes."""
    pad = size - len(str(base).encode()) - 1 - len(tail.encode())
    assert pad > 0
    return base / ("d" * pad)


def test_the_plugin_serves_sockets_of_107_bytes(short_dir: Path) -> None:
    """The longest paths the kubelet takes, bound and answering: gRPC's "unix://" form would make
    them two bytes too long for sun_path (it binds "///..."), hence "unix:<path>"."""
    driver = "gpu.example.com"
    plugins = _padded(short_dir, MAX_SOCKET_PATH_BYTES, f"/{driver}/dra.sock")
    registry = _padded(short_dir / "r", MAX_SOCKET_PATH_BYTES, f"/{driver}-reg.sock")
    server = PluginServer(_driver(short_dir), driver_name=driver, plugins_dir=plugins, registrar_dir=registry)
    assert len(str(server.dra_socket).encode()) == len(str(server.registration_socket).encode()) == 107
    server.start()
    try:
        assert server.dra_socket.is_socket() and server.registration_socket.is_socket()
        with grpc.insecure_channel(f"unix://{server.registration_socket}") as channel:
            info = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb2.InfoRequest(), timeout=10)
        assert info.name == driver and info.endpoint == str(server.dra_socket)
        assert endpoint_problem(info.endpoint) is None  # what the kubelet gets, it takes
    finally:
        server.stop(grace=1)
    # One byte more is refused up front, not by a failing bind.
    with pytest.raises(PluginStartError, match="108 bytes long"):
        PluginServer(
            _driver(short_dir),
            driver_name=driver,
            plugins_dir=plugins.with_name(plugins.name + "d"),
            registrar_dir=registry,
        )
    with pytest.raises(PluginStartError, match="108 bytes long"):
        PluginServer(
            _driver(short_dir),
            driver_name=driver,
            plugins_dir=plugins,
            registrar_dir=registry.with_name(registry.name + "d"),
        )


# --- what else an upper case driver name touches -------------------------------------------------------


def test_an_upper_case_driver_name_makes_valid_object_names() -> None:
    name = slice_name("node-a", "GPU.Example.com", 0)
    assert name == go_to_lower(name) and name.endswith("-0")
    assert name != slice_name("node-a", "gpu.example.com", 0) == "node-a-gpu.example.com-0"
    assert taint_key("GPU.Example.com") == "gpu.example.com/unhealthy"
