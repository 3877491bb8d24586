"""Crash-safe replacement of the plugin's files (otel_dra/plugin/files.py)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from otel_dra.plugin.files import write_atomic


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")


@pytest.mark.parametrize("durable", [True, False])
def test_the_file_is_replaced_whole_with_its_mode_and_nothing_left_beside_it(tmp_path: Path, durable: bool) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b"old content that is longer than the new one")
    old_umask = os.umask(0o077)  # a container's: the mode asked for is still what the file gets
    try:
        write_atomic(path, b"new", 0o644, durable=durable)
    finally:
        os.umask(old_umask)
    assert path.read_bytes() == b"new"
    assert path.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json"]


def test_a_leftover_temporary_file_is_truncated_and_replaced(tmp_path: Path) -> None:
    path = tmp_path / "spec.json"
    _tmp_name(path).write_bytes(b"x" * 4096)  # left by a crash of this very process and thread
    write_atomic(path, b"{}")
    assert path.read_bytes() == b"{}" and not _tmp_name(path).exists()


def test_a_link_planted_at_the_temporary_name_is_not_followed(tmp_path: Path) -> None:
    path, victim = tmp_path / "spec.json", tmp_path / "victim"
    victim.write_bytes(b"keep")
    _tmp_name(path).symlink_to(victim)
    with pytest.raises(OSError):
        write_atomic(path, b"{}")
    assert victim.read_bytes() == b"keep" and not path.exists()


def test_a_failed_write_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b"old")
    with pytest.raises(TypeError):
        write_atomic(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json"]
