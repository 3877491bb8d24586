"""The list-per-scrape baseline: what the seed's Go exporter does, in our code.

Every "scrape" lists the three resources (paginated, raw JSON, our fastest path) and renders the
seven families from scratch. Nothing is cached between scrapes."""

from __future__ import annotations

import time
from typing import Any

from otel_dra.cluster import deviceclass, resourceclaim, resourceslice
from otel_dra.kube.client import KubeClient


def _list(client: KubeClient, path: str, page_size: int = 500) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    token = None
    while True:
        query: dict[str, str | int] = {"limit": page_size}
        if token:
            query["continue"] = token
        page = client.get_json(path, query)
        items.extend(page.get("items") or [])
        token = (page.get("metadata") or {}).get("continue")
        if not token:
            return items


def scrape_once(client: KubeClient) -> tuple[float, int]:
    """Seconds and body bytes for one list-and-render scrape."""
    start = time.perf_counter()
    parts: list[bytes] = []
    for module in (resourceclaim, resourceslice, deviceclass):
        objects = _list(client, module.RESOURCE.path)
        parsed = [module.parse(o, lambda problem: None) for o in objects]
        for fam in module.FAMILIES:
            parts.append(fam.gauge.header(False))
            parts.extend(fam.gauge.render(fam.samples(p)) for p in parsed)
    body = b"".join(parts)
    return time.perf_counter() - start, len(body)
