"""Which cluster-state families the exporter serves: ``--metric-allowlist`` / ``--metric-denylist``.

kube-state-metrics' lists, with one difference. As there, a list is comma-separated, each entry
trimmed of white space (so a YAML block scalar works) and empty entries dropped; an entry is a
regular expression over Prometheus family names (``kube_resourceslice_device_capacity_memory_bytes``,
not the OTel instrument name); an allowlist serves only the families some entry matches, a
denylist every family none matches; the two are mutually exclusive; and they apply to the
cluster-state families only, never to the exporter's own ``otel_dra_*`` metrics or ``target_info``
(which has ``--target-info``). The difference: an entry must match the *whole* name
(``re.fullmatch``), as Prometheus relabelling regexes do, where kube-state-metrics looks for the
pattern anywhere in the name (Go's ``MatchString``), so that ``kube_pod_container_status_terminated``
there also denies ``kube_pod_init_container_status_terminated_reason``. Here the exact name of a
family selects that family alone, and a list written for kube-state-metrics with ``^…$`` anchors
means the same in both.

A list that matches no family at all is refused (kube-state-metrics accepts it silently): an
allowlist would serve nothing and a denylist deny nothing, so it is a typo or a list for another
version. An entry that matches nothing in a list that matches something is reported by the CLI as
a warning.

A family that is off is never built: its store, its rendering and its OTLP points do not exist,
and a resource that no served family needs is not watched (see :class:`ClusterState`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from otel_dra.cluster.families import Family

F = TypeVar("F", bound=Family[Any])


@dataclass(frozen=True)
class FamilySelection:
    """An allowlist or a denylist; the default (an empty denylist) serves every family."""

    entries: tuple[str, ...] = ()
    allow: bool = False
    # Entries that match none of the names the list was parsed against (reported as warnings).
    unmatched: tuple[str, ...] = ()
    _patterns: tuple[re.Pattern[str], ...] = field(default=(), repr=False, compare=False)

    @classmethod
    def parse(cls, text: str, *, allow: bool, names: Iterable[str]) -> FamilySelection | None:
        """The list in ``text`` (None when it has no entries); ValueError when an entry is not a
        regular expression or the list matches none of ``names``."""
        entries = tuple(dict.fromkeys(e.strip() for e in text.split(",") if e.strip()))
        if not entries:
            return None
        patterns = []
        for entry in entries:
            try:
                patterns.append(re.compile(entry))
            except re.error as exc:
                raise ValueError(f"{entry!r} is not a regular expression: {exc}") from None
        known = list(names)
        unmatched = tuple(e for e, p in zip(entries, patterns, strict=True) if not any(p.fullmatch(n) for n in known))
        if len(unmatched) == len(entries):
            raise ValueError(
                f"{','.join(entries)!r} matches no family (entries are regular expressions that must match a whole "
                "Prometheus family name, such as kube_resourceclaim_status_reserved_total; see docs/metrics.md)"
            )
        return cls(entries, allow, unmatched, tuple(patterns))

    def serves(self, prom_name: str) -> bool:
        return any(p.fullmatch(prom_name) for p in self._patterns) is self.allow

    def select(self, families: Sequence[F]) -> tuple[F, ...]:
        """The families of ``families`` that are served, in their order."""
        return tuple(f for f in families if self.serves(f.prom_name))


EVERYTHING = FamilySelection()
