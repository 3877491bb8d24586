"""The layer rules are enforced, not conventions: no private names across modules, and the
import-linter contracts of pyproject.toml really fail when a layer is crossed."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "otel_dra"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private_imports(path: Path, root: Path = ROOT) -> list[str]:
    """``from otel_dra.x import _name`` where otel_dra.x is not the importing module itself."""
    found = []
    own = _module_name(path, root)
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        if not node.module.startswith("otel_dra") or node.module == own:
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{path.relative_to(root)}:{node.lineno}: from {node.module} import {alias.name}")
    return found


def test_no_module_imports_another_modules_private_names() -> None:
    offenders = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        if "_generated" not in path.parts
        for line in _private_imports(path)
    ]
    assert offenders == []


def test_the_private_name_check_sees_one(tmp_path: Path) -> None:
    module = tmp_path / "otel_dra" / "cli" / "probe.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "from otel_dra.cli.probe import _own\n"  # its own private names are fine
        "from otel_dra import __version__\n"
        "def f():\n    from otel_dra.cli.flags import _DNS_SUBDOMAIN\n"
    )
    assert _private_imports(module, tmp_path) == [
        "otel_dra/cli/probe.py:4: from otel_dra.cli.flags import _DNS_SUBDOMAIN"
    ]


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (pip install -e '.[dev]')")
@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("plugin/driver.py", "from otel_dra.cluster import families", "know nothing of each other"),
        ("binding/controller.py", "from otel_dra.plugin import devices", "know nothing of each other"),
        ("telemetry/http.py", "from otel_dra.kube import client", "telemetry knows nothing of Kubernetes"),
        ("kube/client.py", "from otel_dra.cli import flags", "the Kubernetes client knows none of its users"),
        ("kubeletsim/sim.py", "from otel_dra.plugin import checkpoint", "only otel_dra.cli wires the layers"),
        # The webhook may import the plugin's config decoder (pyproject.toml's one ignored import), nothing else.
        ("admission/review.py", "from otel_dra.plugin import devices", "only otel_dra.cli wires the layers"),
        ("admission/review.py", "from otel_dra.telemetry import spans", "the admission webhook's verdicts are pure"),
    ],
)
def test_crossing_a_layer_breaks_a_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    """A copy of the package with one forbidden import, placed inside a function (import-linter
    sees those too): `lint-imports` exits non-zero and names the contract."""
    shutil.copytree(PACKAGE, tmp_path / "otel_dra", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "otel_dra" / module
    target.write_text(target.read_text() + f"\n\ndef _layer_probe() -> None:\n    {line}  # noqa\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0, result.stdout
    # The report wraps long contract names; "<name> BROKEN" once whitespace is collapsed.
    report = " ".join(result.stdout.split())
    broken = [entry.rsplit(" KEPT ", 1)[-1] for entry in report.split(" BROKEN")[:-1]]
    assert any(contract in name for name in broken), result.stdout


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (pip install -e '.[dev]')")
def test_the_package_keeps_its_contracts() -> None:
    result = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout
