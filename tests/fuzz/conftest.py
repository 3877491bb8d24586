"""The fuzz suite (issue 15): property-based tests that feed mutated objects and requests through the
exporter and the plugin. Every module here marks its tests ``fuzz``
(``pytest -m fuzz`` selects them, ``-m 'not fuzz'`` leaves them out).

How many examples each property gets is a Hypothesis profile, chosen with ``HYPOTHESIS_PROFILE``:

- ``ci`` (the default; what ``make test`` and ``make test-unit`` run): 2,000 per watched kind (over
  its two properties) and 500 for the plugin's RPCs, about three minutes on 2 cores, the same
  examples every run;
- ``deep`` (``make fuzz``): 100,000 per kind and property (hours);
- ``dev``: 200 per kind and property, for a quick local run.

A failure prints the shrunk input and a ``@reproduce_failure`` blob; keep the input as a regular unit
test next to the fix.
"""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

import otel_dra

# Hypothesis draws some values from the constants of every local module loaded (its "local constants"
# pool, grown whenever sys.modules grows). So the examples depended on what else pytest had collected
# (test_kubelet_sim.py loads the CLI, the testbed and the emulator: 448 strings in the pool without it,
# 1,169 with it), and a module first imported during an example could change the pool between the
# example and its replay: our reading of the "inconsistent data generation" flake, which we could not
# reproduce (two runs with test_kubelet_sim.py collected passed). Loading every otel_dra module first
# makes the pool the same whatever is collected, and fixed through the run.
for _module in pkgutil.walk_packages(otel_dra.__path__, "otel_dra."):
    if not _module.name.endswith(".__main__"):  # that one runs the CLI
        importlib.import_module(_module.name)

# Per kind of input (a watched resource, the plugin's RPCs): the examples of each profile, in
# total over the properties of that kind in CI (see ``examples``), for each property in a deep run.
EXAMPLES = {"ci": 2000, "deep": 100_000, "dev": 200}

_COMMON = {
    # Timing on shared CI runners is noisy, and huge strings make some examples slow by design.
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    "print_blob": True,
}
for _name, _count in EXAMPLES.items():
    # CI draws the same examples every run (derandomize): a red CI run then means this change broke
    # something, not that the random draw found an old bug. Deep and dev runs explore new inputs.
    settings.register_profile(_name, max_examples=_count, derandomize=_name == "ci", **_COMMON)  # type: ignore[arg-type]

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in EXAMPLES:
    raise pytest.UsageError(f"HYPOTHESIS_PROFILE={PROFILE!r}: one of {', '.join(EXAMPLES)}")
settings.load_profile(PROFILE)


def examples(share: int) -> int:
    """The examples of one property that gets 1/``share`` of its kind's count in CI (a deep or dev
    run gives every property the profile's full count)."""
    return EXAMPLES[PROFILE] // share if PROFILE == "ci" else EXAMPLES[PROFILE]


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    """Each mutated object is logged as invalid, many times per example: kept out of failure reports."""
    logger = logging.getLogger("otel_dra")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)
