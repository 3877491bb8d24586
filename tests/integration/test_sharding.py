"""N sharded exporters together serve exactly what one unsharded exporter serves: the seed families,
and the families beyond the seed, joins and pool aggregates included."""

from __future__ import annotations

from collections import Counter

from otel_dra.cluster.sharding import Shard
from otel_dra.fixtures import apply_all, sample_objects
from tests.helpers import SEED_FAMILIES, parse_samples, scrape, state_families, wait_until

FAMILIES = set(SEED_FAMILIES) | set(state_families())


def _seed_samples(port: int) -> list[tuple[str, tuple, float]]:
    code, text = scrape(port)
    assert code == 200
    return [(n, tuple(sorted(labels.items())), v) for n, labels, v in parse_samples(text) if n in FAMILIES]


def test_union_of_shards_equals_unsharded(testbed, admin_client, start_exporter_app):
    apply_all(admin_client, sample_objects())
    # A grace period no test session reaches: a claim must not turn leaked between two scrapes.
    grace = 86000.0
    whole = start_exporter_app(str(testbed.kubeconfig), leak_grace=grace)
    shards = [start_exporter_app(str(testbed.kubeconfig), shard=Shard(i, 3), leak_grace=grace) for i in range(3)]
    for app in [whole, *shards]:
        wait_until(lambda app=app: app.state.not_synced() is None, what="sync")

    # Other tests change the same API server; compare once all four agree on the moment.
    def snapshot():
        expected = Counter(_seed_samples(whole.port))
        parts = [Counter(_seed_samples(app.port)) for app in shards]
        again = Counter(_seed_samples(whole.port))
        return (expected, parts) if expected == again else None

    expected, parts = wait_until(snapshot, what="a stable state")
    assert any(name.startswith("kube_resourcepool_") for name, _, _ in expected)
    union = sum(parts, Counter())
    assert union == expected  # as multisets: no series lost, none served twice
    # The split is real: no shard serves everything, and device classes only come from shard 0.
    assert all(len(p) < len(expected) for p in parts)
    assert [sum(1 for s in p if s[0] == "kube_deviceclass_hourly_cost") > 0 for p in parts] == [True, False, False]
    # Each pool's aggregates come from one shard.
    pools = [
        {(dict(lbl)["driver"], dict(lbl)["pool"]) for n, lbl, _ in p if n == "kube_resourcepool_generation"}
        for p in parts
    ]
    assert sum(len(p) for p in pools) == len(set().union(*pools))
    # A claim's series all live on one shard.
    for part in parts:
        claims = {dict(lbl)["resourceclaim_name"] for n, lbl, _ in part if n.startswith("kube_resourceclaim")}
        others = set().union(
            *(
                {dict(lbl)["resourceclaim_name"] for n, lbl, _ in p if n.startswith("kube_resourceclaim")}
                for p in parts
                if p is not part
            )
        )
        assert not claims & others
