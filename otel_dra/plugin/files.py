"""Crash-safe file replacement for CDI specs and the checkpoint."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o644, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` so that readers (the container runtime, a restarted plugin)
    see the old or the new content, never a torn file: write a temporary file in the same
    directory, rename it over the target. ``durable`` also fsyncs the file before the rename, so
    that after a crash of the machine the name holds the old or the complete new content, never
    an empty or partial file. Each fsync costs ~0.3-0.7 ms here (a tenth of a prepare or more), so
    only the checkpoint pays it, and only once: the directory is not fsynced after the rename. A
    machine crash can then lose the last rename, i.e. the checkpoint may miss the last claims
    prepared before it; that is harmless because the kubelet prepares the pods' claims again after
    a reboot, and the CDI specs (tmpfs) are gone with the reboot anyway.

    The temporary file's name is the target's with this process and thread in it (a dot first and
    ``.tmp`` last: the CDI registry loads only ``*.json`` and ``*.yaml``): one writer of a name at a
    time, so no random name to draw and try (``tempfile.mkstemp`` and a file object cost a tenth
    of a millisecond more per write, on the kubelet's clock). A file left there by a crash is
    truncated by the next write of the same name; ``O_NOFOLLOW``: never through a planted link."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        try:
            os.fchmod(fd, mode)  # exactly ``mode``, whatever the umask took away at creation
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove_file(path: Path) -> bool:
    """Delete ``path`` (True) or find it already gone (False)."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    return True
