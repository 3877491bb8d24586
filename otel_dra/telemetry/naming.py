"""OpenTelemetry instrument name + unit -> Prometheus metric name.

The rules follow the OTel/Prometheus compatibility specification as implemented by
opentelemetry-exporter-prometheus (and the Collector's prometheus exporter): invalid characters
become ``_``, a unit suffix is appended unless the name already ends with it, and monotonic
counters get ``_total``. We need our own copy because series that we render outside the SDK
(see :mod:`otel_dra.telemetry.exposition`) must carry exactly the names the SDK would give them;
``tests/test_naming.py`` checks both against each other.
"""

from __future__ import annotations

import re

_INVALID_NAME = re.compile(r"[^a-zA-Z0-9:]+")
_INVALID_LABEL = re.compile(r"[^a-zA-Z0-9]+")
_ANNOTATION = re.compile(r"{.*}")

# UCUM units that Prometheus spells out. Units not listed are sanitised and used verbatim.
_UNITS = {
    "d": "days",
    "h": "hours",
    "min": "minutes",
    "s": "seconds",
    "ms": "milliseconds",
    "us": "microseconds",
    "ns": "nanoseconds",
    "By": "bytes",
    "KiBy": "kibibytes",
    "MiBy": "mebibytes",
    "GiBy": "gibibytes",
    "TiBy": "tibibytes",
    "KBy": "kilobytes",
    "MBy": "megabytes",
    "GBy": "gigabytes",
    "TBy": "terabytes",
    "m": "meters",
    "V": "volts",
    "A": "amperes",
    "J": "joules",
    "W": "watts",
    "g": "grams",
    "Cel": "celsius",
    "Hz": "hertz",
    "1": "",
    "%": "percent",
}
_PER_UNITS = {"s": "second", "m": "minute", "h": "hour", "d": "day", "w": "week", "mo": "month", "y": "year"}


def sanitize_name(name: str) -> str:
    if name and name[0].isdigit():
        name = "_" + name[1:]
    return _INVALID_NAME.sub("_", name)


def sanitize_label(key: str) -> str:
    if key and key[0].isdigit():
        key = "_" + key[1:]
    return _INVALID_LABEL.sub("_", key)


def prometheus_unit(unit: str) -> str:
    """The Prometheus spelling of a UCUM unit ("" when the unit adds no suffix)."""
    unit = _ANNOTATION.sub("", unit)
    if unit in _UNITS:
        return _UNITS[unit]
    top, sep, bottom = unit.partition("/")
    if sep:
        bottom = _INVALID_NAME.sub("_", bottom)
        if bottom:
            top = _INVALID_NAME.sub("_", top)
            top = _UNITS.get(top, top)
            bottom = _PER_UNITS.get(bottom, bottom)
            return f"{top}_per_{bottom}" if top else f"per_{bottom}"
    return _INVALID_NAME.sub("_", unit).strip("_")


def prometheus_name(name: str, unit: str, *, counter: bool = False) -> str:
    """The metric name a Prometheus scrape shows for an OTel instrument."""
    full = sanitize_name(name)
    suffix = prometheus_unit(unit)
    if counter and full.endswith("_total"):
        full = full[: -len("_total")]
    if suffix and not full.endswith("_" + suffix):
        full = f"{full}_{suffix}"
    if counter:
        full += "_total"
    return full
