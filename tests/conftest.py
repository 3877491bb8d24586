"""Shared fixtures: a real local control plane (etcd + kube-apiserver, optionally scheduler and
controller-manager) from ``otel_dra.testbed``.

Control planes are session-scoped: starting one takes a few seconds, and tests isolate themselves by
namespace or object name instead. Tests that use them get the ``testbed`` marker automatically, so
``pytest -m "not testbed"`` runs only what needs no binaries.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from otel_dra.testbed import Binaries, BinariesMissingError, Testbed, build, find_binaries, running
from otel_dra.testbed.build import (
    build_jaeger,
    build_otelcol,
    find_jaeger,
    find_otelcol,
    kubernetes_release,
    version_key,
)
from tests import peers

# tests/thread_leaks.py: a test, or a wider-scoped fixture, that leaves a thread running fails.
pytest_plugins = ["tests.thread_leaks"]

# Fixtures that need binaries built by `otel-dra testbed build` (`make peers`): tests using them are
# marked `testbed`, so `pytest -m "not testbed"` runs only what needs nothing built.
TESTBED_FIXTURES = frozenset(
    {
        "testbed",
        "testbed_sched",
        "testbed_binaries",
        "otelcol_binary",
        "jaeger_binary",
        "jaeger",
        "otelcol_gateway",
        "prometheus",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if TESTBED_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.testbed)
        _skip_outside_kubernetes_range(item)


def _skip_outside_kubernetes_range(item: pytest.Item) -> None:
    """``@pytest.mark.kubernetes(min="1.35", max="1.36", reason=...)``: the test needs a testbed of
    those minors (OTEL_DRA_KUBERNETES_VERSION, see otel_dra.testbed.build.kubernetes_release) and is
    skipped, with its reason, on the others."""
    marker = item.get_closest_marker("kubernetes")
    if marker is None:
        return
    minor = kubernetes_release().minor
    low, high = marker.kwargs.get("min"), marker.kwargs.get("max")
    if (low and version_key(minor) < version_key(low)) or (high and version_key(minor) > version_key(high)):
        reason = marker.kwargs.get("reason", "")
        item.add_marker(
            pytest.mark.skip(reason=f"not on Kubernetes {minor} (needs {low or ''}..{high or ''}): {reason}")
        )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, object, object]:
    """A failing test's report carries the log tails of the peers (Collector, Jaeger, Prometheus)
    running at that moment."""
    report = yield
    if isinstance(report, pytest.TestReport) and report.failed:
        for peer in list(peers.RUNNING):
            report.sections.append((f"{peer.name} log ({peer.log})", peer.log_tail()))
    return report


@pytest.fixture(scope="session")
def testbed_binaries() -> Binaries:
    """The built binaries; builds them if missing (CI runs `otel-dra testbed build` beforehand)."""
    try:
        return find_binaries()
    except BinariesMissingError:
        return build()


@pytest.fixture(scope="session")
def testbed(tmp_path_factory: pytest.TempPathFactory, testbed_binaries: Binaries) -> Iterator[Testbed]:
    """etcd + kube-apiserver only: nothing schedules Pods or creates claims from templates."""
    with running(tmp_path_factory.mktemp("testbed"), binaries=testbed_binaries) as tb:
        yield tb


@pytest.fixture(scope="session")
def testbed_sched(tmp_path_factory: pytest.TempPathFactory, testbed_binaries: Binaries) -> Iterator[Testbed]:
    """A separate control plane that also runs kube-scheduler and kube-controller-manager.

    Separate from ``testbed`` so that tests there never see Pods scheduled or claims generated
    behind their back; started only when a test asks for it.
    """
    with running(
        tmp_path_factory.mktemp("testbed-sched"),
        scheduler=True,
        controller_manager=True,
        binaries=testbed_binaries,
    ) as tb:
        yield tb


# --- observability peers (tests/peers.py) ----------------------------------------------------------


@pytest.fixture(scope="session")
def otelcol_binary() -> Path:
    """The OpenTelemetry Collector distribution built with ocb (CI builds it in `make peers`)."""
    try:
        return find_otelcol()
    except BinariesMissingError:
        return build_otelcol()


@pytest.fixture(scope="session")
def jaeger_binary() -> Path:
    try:
        return find_jaeger()
    except BinariesMissingError:
        return build_jaeger()


@pytest.fixture(scope="session")
def jaeger(tmp_path_factory: pytest.TempPathFactory, jaeger_binary: Path) -> Iterator[peers.Jaeger]:
    """Jaeger v2 with memory storage: OTLP in on ``jaeger.otlp_grpc``, query API on ``jaeger.url("query")``."""
    peer = peers.start_jaeger(jaeger_binary, tmp_path_factory.mktemp("jaeger"))
    yield peer
    peer.stop()


@pytest.fixture(scope="session")
def otelcol_gateway(
    tmp_path_factory: pytest.TempPathFactory, otelcol_binary: Path, jaeger: peers.Jaeger
) -> Iterator[peers.Collector]:
    """The Collector running collector-config/gateway.yaml (ports moved to free loopback ports),
    sending traces to ``jaeger``. ``.endpoint(4317)`` / ``.endpoint(4318)``: its OTLP gRPC / HTTP
    receiver; ``.endpoint(8889)``: its prometheus exporter."""
    collector = peers.start_collector(
        otelcol_binary,
        tmp_path_factory.mktemp("otelcol-gateway"),
        peers.load_collector_config("gateway.yaml"),
        env={"JAEGER_OTLP_ENDPOINT": jaeger.otlp_grpc},
    )
    yield collector
    collector.stop()


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[peers.Prometheus]:
    """A real Prometheus (Debian's) with no scrape jobs; tests set theirs with ``set_jobs``."""
    peer = peers.start_prometheus(tmp_path_factory.mktemp("prometheus"))
    yield peer
    peer.stop()
