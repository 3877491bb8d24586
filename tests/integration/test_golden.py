"""Golden exposition of the seven seed families for the sample fixture set, from a real API server."""

from __future__ import annotations

from pathlib import Path

import pytest

from otel_dra.fixtures import apply_all, sample_objects
from tests.helpers import SEED_FAMILIES, check_golden, family_block, scrape, wait_until

GOLDEN = Path(__file__).parent.parent / "golden" / "sample_seed_families.prom"

# Only series of the fixture's own objects: other tests add objects to the same API server.
_FIXTURE = sample_objects()
_NAMESPACES = {o["metadata"]["namespace"] for o in _FIXTURE if o["kind"] == "ResourceClaim"}
_NAMES = {o["metadata"]["name"] for o in _FIXTURE if o["kind"] in ("ResourceSlice", "DeviceClass")}


def _owned(line: str) -> bool:
    if line.startswith("#"):
        return True
    return any(f'namespace="{ns}"' in line for ns in _NAMESPACES) or any(
        f'resourceslice_name="{n}"' in line or f'deviceclass_name="{n}"' in line for n in _NAMES
    )


def _seed_exposition(text: str) -> str:
    blocks = []
    for name in SEED_FAMILIES:
        block = family_block(text, name)
        blocks.append("\n".join(line for line in block.splitlines() if _owned(line)) + "\n")
    return "".join(blocks)


@pytest.fixture(scope="module")
def loaded(testbed, admin_client):
    apply_all(admin_client, _FIXTURE)
    return testbed


def test_golden_text_exposition(loaded, start_exporter_app):
    app = start_exporter_app(str(loaded.kubeconfig))
    wait_until(lambda: app.state.not_synced() is None, what="caches to sync")
    code, text = scrape(app.port)
    assert code == 200
    check_golden(GOLDEN, _seed_exposition(text))
    # The default output carries no per-series OTel scope labels.
    assert "otel_scope_name" not in text


def test_golden_openmetrics(loaded, start_exporter_app):
    app = start_exporter_app(str(loaded.kubeconfig))
    wait_until(lambda: app.state.not_synced() is None, what="caches to sync")
    code, text = scrape(app.port, {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert code == 200 and text.endswith("# EOF\n")
    golden = GOLDEN.read_text()
    # Same samples; OpenMetrics adds a UNIT line for the one family with a unit.
    got = _seed_exposition(text).replace("# UNIT kube_resourceslice_device_capacity_memory_bytes bytes\n", "")
    assert got == golden
    assert "# UNIT kube_resourceslice_device_capacity_memory_bytes bytes" in text
