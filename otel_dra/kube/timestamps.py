"""Kubernetes timestamps (``metav1.Time``: RFC 3339 in UTC, whole seconds, ``2026-11-30T03:26:06Z``)
to and from Unix seconds: one reading and one spelling for the exporter, the plugin, the binding
controller and the kubelet emulator."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def format_time(seconds: float | None = None) -> str:
    """Unix ``seconds`` (default: now) as the API writes a time: UTC, whole seconds."""
    if seconds is None:
        return time.strftime(_FORMAT, time.gmtime())
    return datetime.fromtimestamp(int(seconds), UTC).strftime(_FORMAT)


def parse_time(value: Any) -> float:
    """An RFC 3339 timestamp as Unix seconds; ValueError (saying why) otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"not a timestamp: {value!r}")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"not a timestamp: {value!r}") from None
    if parsed.tzinfo is None:
        raise ValueError(f"timestamp without a time zone: {value!r}")
    return parsed.timestamp()


def time_or_none(value: Any) -> float | None:
    """As :func:`parse_time`, None for anything that is not a timestamp."""
    try:
        return parse_time(value)
    except ValueError:
        return None
