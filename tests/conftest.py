"""Shared fixtures: a real local control plane (etcd + kube-apiserver, optionally scheduler and
controller-manager) from ``otel_dra.testbed``.

Control planes are session-scoped: starting one takes a few seconds, and tests isolate themselves by
namespace or object name instead. Tests that use them get the ``testbed`` marker automatically, so
``pytest -m "not testbed"`` runs only what needs no binaries.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from otel_dra.testbed import Binaries, BinariesMissingError, Testbed, build, find_binaries, running

TESTBED_FIXTURES = frozenset({"testbed", "testbed_sched", "testbed_binaries"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if TESTBED_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.testbed)


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
