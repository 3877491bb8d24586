"""otel_dra.records behaves as dataclasses do for what records support, and refuses the rest."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from dataclasses import field
from typing import Any, ClassVar

import pytest

from otel_dra.records import asdict, fields, record, replace


@record(frozen=True)
class _Point:  # module level: pickle finds classes by name
    x: int
    tags: tuple[str, ...] = ()


def _thing() -> type:
    class Thing:
        name: str
        count: int = 1
        tags: list[str] = field(default_factory=list)
        label: str = "x"
        LIMIT: ClassVar[int] = 3

    return Thing


def _pair(frozen: bool) -> tuple[Any, Any]:
    """The same declaration as a dataclass and as a record."""
    return dataclasses.dataclass(frozen=frozen)(_thing()), record(frozen=frozen)(_thing())


@pytest.mark.parametrize("frozen", [False, True])
def test_construction_equality_and_repr_match_dataclasses(frozen: bool) -> None:
    dc, rec = _pair(frozen)
    for args, kwargs in [(("a",), {}), (("a", 2), {"label": "y"}), ((), {"name": "b", "tags": ["t"]})]:
        d, r = dc(*args, **kwargs), rec(*args, **kwargs)
        assert repr(d) == repr(r)
        assert fields(r) == tuple(f.name for f in dataclasses.fields(d)) == ("name", "count", "tags", "label")
        assert asdict(r) == dataclasses.asdict(d)
        assert r == rec(*args, **kwargs) and r != rec("other")
        assert (r == d) is False  # another class, as between two dataclasses
    assert rec.LIMIT == 3 and "LIMIT" not in fields(rec)
    # Each instance gets its own default_factory value.
    one, two = rec("a"), rec("b")
    assert one.tags == [] and one.tags is not two.tags


@pytest.mark.parametrize("frozen", [False, True])
def test_argument_errors_match_dataclasses(frozen: bool) -> None:
    dc, rec = _pair(frozen)
    for args, kwargs in [
        ((), {}),
        (("a", 1, [], "l", "extra"), {}),
        (("a",), {"name": "again"}),
        (("a",), {"nope": 1}),
    ]:
        with pytest.raises(TypeError):
            dc(*args, **kwargs)
        with pytest.raises(TypeError):
            rec(*args, **kwargs)


def test_frozen_records_are_immutable_and_hashable_mutable_ones_unhashable() -> None:
    _, frozen = _pair(True)
    _, mutable = _pair(False)
    r = frozen("a", tags=("t",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.count = 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        del r.count
    assert hash(r) == hash(frozen("a", tags=("t",))) and len({r, frozen("a", tags=("t",))}) == 1
    m = mutable("a")
    m.count = 5
    assert m.count == 5
    with pytest.raises(TypeError):
        hash(m)


def test_replace_copy_and_pickle() -> None:
    _, frozen = _pair(True)
    r = frozen("a", 2, ("t",))
    assert replace(r, count=3) == frozen("a", 3, ("t",)) and r.count == 2
    with pytest.raises(TypeError, match="no field"):
        replace(r, nope=1)
    assert copy.copy(r) == r and copy.deepcopy(r) == r
    point = _Point(1, tags=("t",))
    assert pickle.loads(pickle.dumps(point)) == point


def test_post_init_runs_and_may_refuse() -> None:
    @record(frozen=True)
    class Positive:
        value: int

        def __post_init__(self) -> None:
            if self.value <= 0:
                raise ValueError("not positive")

    assert Positive(1).value == 1
    with pytest.raises(ValueError, match="not positive"):
        Positive(0)


def test_a_class_of_its_own_methods_keeps_them() -> None:
    @record
    class Named:
        name: str

        def __repr__(self) -> str:
            return f"<{self.name}>"

    assert repr(Named("n")) == "<n>"


def test_what_records_do_not_support_fails_at_class_creation() -> None:
    with pytest.raises(TypeError, match="only a default"):

        @record
        class Hidden:
            secret: str = field(default="", repr=False)

    with pytest.raises(TypeError, match="without a default follows"):

        @record
        class Order:
            first: int = 0
            second: int  # type: ignore[misc]
