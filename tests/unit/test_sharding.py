import pytest

from otel_dra.cli import main
from otel_dra.cluster.sharding import Shard, ordinal_from_pod_name


def test_every_object_has_exactly_one_shard():
    shards = [Shard(i, 4) for i in range(4)]
    for n in range(500):
        obj = {"metadata": {"uid": f"00000000-0000-4000-8000-{n:012d}"}}
        assert sum(s.owns(obj) for s in shards) == 1
    counts = [sum(s.owns({"metadata": {"uid": f"u-{n}"}}) for n in range(4000)) for s in shards]
    assert all(800 < c < 1200 for c in counts), counts


def test_validation_and_ordinals():
    with pytest.raises(ValueError):
        Shard(3, 3)
    with pytest.raises(ValueError):
        Shard(0, 0)
    assert ordinal_from_pod_name("otel-dra-exporter-12") == 12
    with pytest.raises(ValueError, match="ordinal"):
        ordinal_from_pod_name("otel-dra-exporter-abc")


def test_cli_rejects_bad_shards(monkeypatch, capsys):
    import logging

    root = logging.getLogger()
    handlers = root.handlers[:]
    try:
        assert main(["exporter", "--shard", "5", "--total-shards", "2"]) == 2
        assert "--shard must be in 0..1" in capsys.readouterr().err
        monkeypatch.delenv("POD_NAME", raising=False)
        assert main(["exporter", "--shard", "auto", "--total-shards", "2"]) == 2
        assert "POD_NAME" in capsys.readouterr().err
    finally:
        root.handlers[:] = handlers
