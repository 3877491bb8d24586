"""Value records, declared like dataclasses but made without generated code.

Why this exists: ``dataclasses.dataclass`` writes each class's ``__init__``, ``__repr__`` and
``__eq__`` (frozen ones also ``__setattr__``, ``__delattr__`` and ``__hash__``) as source text and
compiles it with ``exec`` when the module is imported: about 2.0 M instructions per class, 3.75 M
when frozen (Python 3.11, counted with valgrind). The plugin imports 25 such classes of ours before
it serves; as dataclasses they were about 85 M instructions, 9% of its start-up CPU
(docs/benchmarks-log.md, "Start-up CPU"). :func:`record` gives them the same behaviour from one
generic implementation of each method, shared by every record, so a class costs what a plain
class costs. The price is a slower ``__init__`` (about a microsecond more per object; records are
made per request at most, never per series).

What is supported is what dataclasses offer and our records use: fields in annotation order,
defaults and ``field(default_factory=...)``, ``__post_init__``, ``frozen=True`` (assignment raises
``dataclasses.FrozenInstanceError``), equality between instances of the same class, a hash from
the fields when frozen (none when not, as dataclasses), and a repr. Anything else a ``field()``
can say (``init=False``, ``repr``/``compare``/``kw_only`` flags) raises ``TypeError`` at class
creation rather than being ignored. Type checkers see records as dataclasses (PEP 681).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, dataclass_transform, overload

_T = TypeVar("_T")
_MISSING = dataclasses.MISSING
_FIELDS = "__record_fields__"


@overload
def record(cls: type[_T], /) -> type[_T]: ...
@overload
def record(*, frozen: bool = False) -> Callable[[type[_T]], type[_T]]: ...


@dataclass_transform(field_specifiers=(dataclasses.field,))
def record(cls: type[_T] | None = None, /, *, frozen: bool = False) -> Any:
    """``@record`` or ``@record(frozen=True)`` on a class with annotated fields."""

    def wrap(cls: type[_T]) -> type[_T]:
        return _make(cls, frozen)

    return wrap if cls is None else wrap(cls)


def fields(obj: Any) -> tuple[str, ...]:
    """The field names of a record (class or instance), in order."""
    names: tuple[str, ...] = getattr(obj, _FIELDS)
    return names


def replace(obj: _T, **changes: Any) -> _T:
    """A copy of record ``obj`` with ``changes`` (as ``dataclasses.replace``)."""
    values = asdict(obj)
    unknown = set(changes) - set(values)
    if unknown:
        raise TypeError(f"{type(obj).__qualname__} has no field(s) {', '.join(sorted(unknown))}")
    values.update(changes)
    return type(obj)(**values)


def asdict(obj: Any) -> dict[str, Any]:
    """The fields of record ``obj`` as a dict, values as they are (not copied, unlike
    ``dataclasses.asdict``, which also recurses)."""
    return {name: getattr(obj, name) for name in fields(obj)}


def _make(cls: type[_T], frozen: bool) -> type[_T]:
    names: list[str] = list(getattr(cls, _FIELDS, ()))  # a record base's fields come first
    defaults: dict[str, Any] = {}
    factories: dict[str, Callable[[], Any]] = {}
    for base in reversed(cls.__mro__[1:]):
        defaults.update(getattr(base, "__record_defaults__", {}))
        factories.update(getattr(base, "__record_factories__", {}))
    for name, annotation in inspect.get_annotations(cls).items():
        if str(annotation).split("[")[0] in ("ClassVar", "typing.ClassVar"):
            continue
        value = cls.__dict__.get(name, _MISSING)
        if isinstance(value, dataclasses.Field):
            flags = (value.init, value.repr, value.compare, value.hash, value.kw_only)
            if flags != (True, True, True, None, _MISSING):
                raise TypeError(f"{cls.__qualname__}.{name}: record fields take only a default or default_factory")
            if value.default_factory is not _MISSING:
                factories[name] = value.default_factory
                delattr(cls, name)
            elif value.default is not _MISSING:
                defaults[name] = value.default
                setattr(cls, name, value.default)
            else:
                delattr(cls, name)
        elif value is not _MISSING:
            defaults[name] = value
        if name not in names:
            names.append(name)
        if name not in defaults and name not in factories and any(n in defaults or n in factories for n in names):
            raise TypeError(f"{cls.__qualname__}: field {name} without a default follows one with a default")
    order = tuple(names)
    known = frozenset(order)
    post_init = getattr(cls, "__post_init__", None)
    setter = object.__setattr__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) > len(order):
            raise TypeError(f"{cls.__qualname__}() takes {len(order)} positional arguments but {len(args)} were given")
        if kwargs and (not known.issuperset(kwargs) or any(name in kwargs for name in order[: len(args)])):
            wrong = [k for k in kwargs if k not in known or k in order[: len(args)]]
            raise TypeError(f"{cls.__qualname__}() got unexpected or repeated argument(s): {', '.join(wrong)}")
        for name, value in zip(order, args, strict=False):  # fewer args than fields
            setter(self, name, value)
        for name in order[len(args) :]:
            if name in kwargs:
                value = kwargs[name]
            elif name in defaults:
                value = defaults[name]
            elif name in factories:
                value = factories[name]()
            else:
                raise TypeError(f"{cls.__qualname__}() missing required argument: {name!r}")
            setter(self, name, value)
        if post_init is not None:
            self.__post_init__()

    def __eq__(self: Any, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in order)

    def __repr__(self: Any) -> str:
        inner = ", ".join(f"{name}={getattr(self, name)!r}" for name in order)
        return f"{type(self).__qualname__}({inner})"

    attrs: dict[str, Any] = {
        "__init__": __init__,
        "__eq__": __eq__,
        "__repr__": __repr__,
        _FIELDS: order,
        "__record_defaults__": defaults,
        "__record_factories__": factories,
        "__match_args__": order,
    }
    if frozen:

        def __setattr__(self: Any, name: str, value: Any) -> None:
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

        def __delattr__(self: Any, name: str) -> None:
            raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")

        def __hash__(self: Any) -> int:
            return hash(tuple(getattr(self, name) for name in order))

        attrs.update(__setattr__=__setattr__, __delattr__=__delattr__, __hash__=__hash__)
    else:
        attrs["__hash__"] = None  # mutable and comparable: unhashable, as a dataclass
    for key, value in attrs.items():
        if key in ("__init__", "__repr__", "__eq__") and key in cls.__dict__:
            continue  # the class's own wins, as with dataclasses
        if callable(value):
            value.__qualname__ = f"{cls.__qualname__}.{key}"
        setattr(cls, key, value)
    return cls
