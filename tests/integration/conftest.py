from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from otel_dra.cli.exporter import ExporterApp
from otel_dra.kube.client import KubeClient, load_credentials
from otel_dra.testbed.build import BinariesMissingError, build_helm, find_helm
from tests.helpers import exporter_starter


@pytest.fixture(scope="session")
def helm() -> Path:
    """The real helm CLI, built from Go modules (`otel-dra testbed build --helm`)."""
    try:
        return find_helm()
    except BinariesMissingError:
        return build_helm()


@pytest.fixture
def start_exporter_app() -> Iterator[Callable[..., ExporterApp]]:
    """Start in-process exporters (on free ports) that are stopped after the test."""
    yield from exporter_starter()


@pytest.fixture(scope="module")
def start_exporter_app_module() -> Iterator[Callable[..., ExporterApp]]:
    """As start_exporter_app, for module-scoped fixtures: stopped after the module."""
    yield from exporter_starter()


@pytest.fixture(scope="session")
def admin_client(testbed: Any) -> KubeClient:
    return KubeClient(load_credentials(str(testbed.kubeconfig)))
