"""Hypothesis strategies that mutate real objects: wrong types, missing and extra fields, huge
strings, odd quantities and timestamps, unicode (quotes, backslashes, newlines, NUL, lone surrogates).

A mutation picks a node of the object (a path of keys and list indexes, the root included) and does
one thing there; an example applies one to four of them to a deep copy of a seed object.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

Path = tuple[str | int, ...]

# Characters that break naive escaping or parsing: exposition label escapes, line ends, NUL, a lone
# surrogate (what json.loads makes of "\ud800"), a BOM, a line separator, combining marks, emoji.
SPECIAL_CHARS = '"\\\n\r\t\x00\x7f\ud800\ufeff\u2028\u0301{}=,# /:é中🙂'
# Without the surrogate: what can travel as protobuf strings (UTF-8) at all.
UTF8_CHARS = SPECIAL_CHARS.replace("\ud800", "")


def odd_text(chars: str = SPECIAL_CHARS) -> st.SearchStrategy[str]:
    return st.text(alphabet=st.sampled_from(chars) | st.characters(), max_size=24)


def huge_text(chars: str = SPECIAL_CHARS) -> st.SearchStrategy[str]:
    """Up to ~100 KB: a short piece repeated (drawing 100 KB of characters one by one would exhaust
    Hypothesis' per-example budget)."""
    return st.builds(
        lambda piece, size: (piece * (size // max(1, len(piece)) + 1))[:size],
        st.text(alphabet=st.sampled_from(chars) | st.characters(), min_size=1, max_size=8),
        st.sampled_from([257, 4097, 65_537, 100_000]),
    )


ODD_TEXT = odd_text()
HUGE_TEXT = huge_text()

# Long digit strings, built when drawn (a sampled_from of them would print them in every report).
_LONG_NUMBERS = (
    st.sampled_from([400, 5000]).map(lambda n: "9" * n)
    | st.just(5000).map(lambda n: "1e" + "9" * n)
    | st.just(400).map(lambda n: "0." + "0" * n + "1")
)
# Integers as large as JSON gives them: json.loads refuses more than 4300 digits (a whole list page
# with one would fail to decode, before any object reaches the exporter's stores).
_BIG = st.sampled_from([20, 400, 4000]).map(lambda digits: 10**digits)

ODD_QUANTITIES = (
    _LONG_NUMBERS
    | _BIG
    | st.sampled_from(
        [
            "1e400",
            "-1e400",
            "1e-400",
            "1e300",
            "1E3",
            "-0",
            "0x10",
            "1.5Ki",
            "",
            " ",
            "+1",
            ".5",
            "1.",
            "5Ei",
            "1Gi\n",
            " 1Gi ",
            "NaN",
            "Inf",
            "-Inf",
            "1Gi1",
            "1 Gi",
            "1,5",
            "٣",  # an Arabic-Indic digit: str.isdigit() says yes
            "²",  # likewise
            "-5",
            "1m",
            "1n",
        ]
    )
    | st.sampled_from([2**64, -(2**64), -1, 0, 1.5, float("nan"), float("inf"), -0.0, True, None, [], {}])
)

ODD_TIMES = (
    st.sampled_from(
        [
            "",
            "yesterday",
            "2026-11-30T03:26:06Z",
            "2026-11-30T03:26:06",
            "2026-11-30",
            "2026-11-30T03:26:06.123456789Z",
            "2026-11-30T03:26:06+25:00",
            "2026-11-30T03:26:06-23:59",
            "0001-01-01T00:00:00Z",
            "0001-01-01T00:00:00+23:59",
            "9999-12-31T23:59:59Z",
            "9999-12-31T23:59:59-23:59",
            "2026-13-40T25:61:61Z",
            "1970-01-01T00:00:00Z",
            "2099-01-01T00:00:00Z",
            "2026-11-30 03:26:06Z",
            "\uff12\uff10\uff12\uff16-11-30T03:26:06Z",  # full-width digits
            "2026-11-30T03:26:06Z\n",
        ]
    )
    | _BIG
    | st.sampled_from([0, -1, 1.8e9, True, None, [], {}])
)

# Names of fields that exist somewhere in the watched kinds, to add where they do not belong.
FIELD_NAMES = st.sampled_from(
    [
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "annotations",
        "status",
        "spec",
        "devices",
        "results",
        "allocation",
        "reservedFor",
        "driver",
        "pool",
        "device",
        "capacity",
        "value",
        "conditions",
        "type",
        "taints",
        "sharedCounters",
        "counters",
        "consumesCounters",
        "nodeName",
        "allowMultipleAllocations",
        "bindingConditions",
        "skipNodeOperations",
        "hourly-cost",
        "resourceClaims",
        "containerStatuses",
        "allocatedResourcesStatus",
        "resourceID",
        "health",
    ]
)

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | _BIG
    | st.sampled_from([-(2**63), 2**64])
    | st.floats()
    | ODD_TEXT
    | ODD_QUANTITIES
    | ODD_TIMES
)
# Any JSON-shaped value (floats include NaN and infinities: json.loads accepts them).
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(FIELD_NAMES | ODD_TEXT, inner, max_size=4),
    max_leaves=8,
)


def paths(node: Any, prefix: Path = ()) -> list[Path]:
    """Every node's path, the root's first."""
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out.extend(paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out.extend(paths(value, (*prefix, i)))
    return out


def at(node: Any, path: Path) -> Any:
    for step in path:
        node = node[step]
    return node


def _fresh(value: Any) -> Any:
    """A drawn value as a copy of its own. Strategies such as ``sampled_from([..., [], {}])`` hand
    out the same list or dict object at every draw; a later mutation that inserts into it in place
    would change what the strategy gives from then on, which Hypothesis reports as a flaky strategy
    definition ("Inconsistent data generation": seen once in CI)."""
    return copy.deepcopy(value)


@st.composite
def _mutate_once(draw: st.DrawFn, obj: dict[str, Any]) -> str:
    """One mutation of ``obj`` in place; returns what it did (for the failure report)."""
    path = draw(st.sampled_from(paths(obj)))
    target = at(obj, path)
    parent = at(obj, path[:-1]) if path else None
    operation = draw(
        st.sampled_from(
            ["replace", "delete", "extra", "text", "huge", "quantity", "time", "duplicate", "wrap", "empty"]
        )
    )
    if operation == "delete" and parent is not None:
        del parent[path[-1]]
        return f"delete {path}"
    if operation == "extra" and isinstance(target, dict):
        key = draw(FIELD_NAMES | ODD_TEXT)
        target[key] = _fresh(draw(VALUES))
        return f"extra {path}[{key!r}]"
    if operation == "extra" and isinstance(target, list):
        target.insert(draw(st.integers(0, len(target))), _fresh(draw(VALUES)))
        return f"insert into {path}"
    if operation == "duplicate" and isinstance(target, list) and target:
        i = draw(st.integers(0, len(target) - 1))
        target.insert(i, copy.deepcopy(target[i]))
        return f"duplicate {path}[{i}]"
    if operation == "duplicate" and isinstance(target, list | dict) and parent is not None:
        # Many copies of one node: a list of hundreds of devices, results, conditions ...
        parent[path[-1]] = [copy.deepcopy(target) for _ in range(draw(st.sampled_from([2, 129, 600])))]
        return f"many copies of {path}"
    if path == ():
        return "nothing (root)"  # the root stays an object: the API server only sends objects
    value: Any
    if operation == "text":
        value = draw(ODD_TEXT)
    elif operation == "huge":
        value = draw(HUGE_TEXT)
    elif operation == "quantity":
        value = draw(ODD_QUANTITIES)
    elif operation == "time":
        value = draw(ODD_TIMES)
    elif operation == "wrap":
        value = draw(st.sampled_from([[target], {"value": target}, str(target)]))
    elif operation == "empty":
        value = draw(st.sampled_from([None, "", [], {}, 0, False]))
    else:
        value = draw(VALUES)
    assert parent is not None
    parent[path[-1]] = _fresh(value)
    return f"{operation} {path} = {value!r:.120}"


@st.composite
def mutated(draw: st.DrawFn, seed: dict[str, Any], max_mutations: int = 4) -> tuple[dict[str, Any], list[str]]:
    """A deep copy of ``seed`` with one to ``max_mutations`` mutations, and what they were."""
    obj = copy.deepcopy(seed)
    done = [draw(_mutate_once(obj)) for _ in range(draw(st.integers(1, max_mutations)))]
    return obj, done
