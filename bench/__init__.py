"""The benchmarks (docs/benchmarks.md). A harness writes its raw results with ``--json PATH``; the
results the docs cite live in bench/results/<benchmark>/ (docs/benchmarks-log.md says which run
each file is)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_json(path: Path, results: Any, indent: int = 2) -> None:
    """Write a harness's results to ``path``, creating its folder (a new bench/results/<benchmark>/)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=indent) + "\n")
