from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_dra.cli.exporter import ExporterApp, start_exporter
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed.build import BinariesMissingError, build_helm, find_helm


@pytest.fixture(scope="session")
def helm() -> Path:
    """The real helm CLI, built from Go modules (`otel-dra testbed build --helm`)."""
    try:
        return find_helm()
    except BinariesMissingError:
        return build_helm()


def _exporter_starter() -> Iterator[Callable[..., ExporterApp]]:
    apps: list[ExporterApp] = []

    def start(kubeconfig: str, **kwargs: Any) -> ExporterApp:
        kwargs.setdefault("address", "127.0.0.1")
        kwargs.setdefault("port", 0)
        app = start_exporter(kubeconfig=kubeconfig, **kwargs)
        apps.append(app)
        return app

    yield start
    for app in apps:
        app.stop()


@pytest.fixture
def start_exporter_app() -> Iterator[Callable[..., ExporterApp]]:
    """Start in-process exporters (on free ports) that are stopped after the test."""
    yield from _exporter_starter()


@pytest.fixture(scope="module")
def start_exporter_app_module() -> Iterator[Callable[..., ExporterApp]]:
    """As start_exporter_app, for module-scoped fixtures: stopped after the module."""
    yield from _exporter_starter()


@pytest.fixture(scope="session")
def admin_client(testbed: Any) -> KubeClient:
    return KubeClient(load_credentials(str(testbed.kubeconfig)))
