"""Fields that several resources share: timestamps and ``metav1.Condition`` lists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from otel_dra.kube.timestamps import parse_time as parse_time  # the fields' other users import it from here

# The values of a condition's ``status`` label: the API's True/False/Unknown in lower case;
# anything else counts as unknown.
CONDITION_STATUSES = ("true", "false", "unknown")


def optional_time(value: Any, what: str, report: Callable[[str], None]) -> float | None:
    """An optional timestamp field: None when unset; reported and None when it is not a timestamp."""
    if value is None:
        return None
    try:
        return parse_time(value)
    except ValueError as exc:
        report(f"{what}: {exc}; series omitted")
        return None


def conditions(raw: Any, what: str, report: Callable[[str], None]) -> tuple[tuple[str, str], ...]:
    """A list of conditions as (type, status) pairs, status one of CONDITION_STATUSES. A list that
    is not one, or an entry without a type, is reported and skipped; a repeated type keeps its
    last entry (the API keys the list by type)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        report(f"{what} is not a list")
        return ()
    out: dict[str, str] = {}
    for i, condition in enumerate(raw):
        if not isinstance(condition, dict) or not isinstance(condition.get("type"), str):
            report(f"{what}[{i}] has no type; skipped")
            continue
        state = str(condition.get("status", "")).lower()
        out[condition["type"]] = state if state in ("true", "false") else "unknown"
    return tuple(out.items())


def condition_states(status: str) -> tuple[tuple[str, float], ...]:
    """The state set of one condition: (status label, 1.0 for the condition's status else 0.0)."""
    return tuple((state, 1.0 if state == status else 0.0) for state in CONDITION_STATUSES)


# The node operations a device can skip (SkipNodeOperation); "*" stands for all of them.
NODE_OPERATIONS = ("NodePrepareResources", "NodeUnprepareResources")


def skipped_operations(raw: Any) -> tuple[str, ...]:
    """A skipNodeOperations list as operation names: "*" becomes every NODE_OPERATIONS entry, an
    unknown value is kept as it is (the kubelet ignores it; the API may add values), duplicates once."""
    out: dict[str, None] = {}
    for value in raw if isinstance(raw, list) else ():
        if value == "*":
            out.update(dict.fromkeys(NODE_OPERATIONS))
        elif isinstance(value, str) and value:
            out[value] = None
    return tuple(out)


def capacity_name(name: str, driver: str) -> str:
    """A capacity's name as the joins compare it: without its domain when that is the driver's.

    Since Kubernetes 1.38 a capacity in the driver's own domain may be named either way, in a
    slice's ``capacity`` and in a claim's ``consumedCapacity`` and capacity requests alike
    (``gpu.example.com/memory`` and ``memory`` of a device of driver ``gpu.example.com``), so
    consumed and available capacity are matched on this form; a name in another domain is its own
    capacity and stays as written."""
    domain, slash, ident = name.rpartition("/")
    return ident if slash and domain == driver else name
