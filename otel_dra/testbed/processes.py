"""The testbed's processes: started in a session of their own, told apart by pid *and* start time,
stopped by process group.

Nothing here knows what a process is for: the control plane's components, a node's daemons and
its API server forwarder all go through :func:`spawn` and :func:`stop_group`, and their records
(``argv``, ``pid``, ``start_time``, ``log``) are what ``DIR/state.json`` keeps
(:mod:`otel_dra.testbed.state`).

Linux /proc is used where available: it tells a zombie from a live process and a reused pid from
the one we started; elsewhere signal 0 is the (coarser) fallback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_POLL_SECONDS = 0.1

# Popen handles of the processes this Python process started, by pid. Kept module-wide (not per
# testbed) so that stopping them through any handle, e.g. `down(dir)` which reads state.json, reaps
# them instead of leaving zombies behind.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def spawn(
    argv: Sequence[str],
    *,
    cwd: Path,
    log_path: Path,
    append_log: bool = False,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Start ``argv`` with its output in ``log_path``; return its record (argv, pid, start_time, log)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab" if append_log else "wb") as log:
        # A new session: the child survives the `testbed up` command and shares nothing (signals
        # from the terminal, process group) with it, and its pid is its process group id.
        proc = subprocess.Popen(
            list(argv),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=None if env is None else dict(env),
        )
    _CHILDREN[proc.pid] = proc
    return {"argv": list(argv), "pid": proc.pid, "start_time": process_start_time(proc.pid), "log": str(log_path)}


def stop_group(pgid: int, start_time: int | None, timeout: float) -> bool:
    """SIGTERM the process group ``pgid`` and wait, SIGKILL it if it stays longer than ``timeout``.
    False only when it survived SIGKILL; a group whose leader is gone, or whose pid now belongs to
    another process (``start_time`` differs), is left alone."""
    proc = _CHILDREN.pop(pgid, None)
    if not process_alive(pgid, start_time):
        # Already gone, or the pid now belongs to someone else: signal nothing.
        if proc is not None:
            proc.poll()
        return True
    signal_group(pgid, signal.SIGTERM)
    if _wait_group_gone(pgid, proc, timeout):
        return True
    signal_group(pgid, signal.SIGKILL)
    return _wait_group_gone(pgid, proc, timeout)


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat from field 3 (state) on, or None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or parentheses.
    return raw[raw.rfind(")") + 2 :].split()


def process_start_time(pid: int) -> int | None:
    stat = _proc_stat(pid)
    return int(stat[19]) if stat else None  # field 22: start time in clock ticks since boot


def process_alive(pid: int, start_time: int | None) -> bool:
    """Whether ``pid`` is a live (non-zombie) process and, if known, the one started at ``start_time``."""
    if Path("/proc/self/stat").exists():
        stat = _proc_stat(pid)
        if stat is None or stat[0] == "Z":
            return False
        return start_time is None or int(stat[19]) == start_time
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def component_exited(pid: int, start_time: int | None) -> bool:
    """Whether a process started by any handle has exited (reaping it if this process started it)."""
    proc = _CHILDREN.get(pid)
    return proc.poll() is not None if proc is not None else not process_alive(pid, start_time)


def exit_code(pid: int) -> int | None:
    """The exit code of a process this Python process started and that has exited; None otherwise
    (still running, or started by another process: its code is not ours to know)."""
    proc = _CHILDREN.get(pid)
    return None if proc is None else proc.returncode


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is left in process group ``pgid``."""
    proc_root = Path("/proc")
    if not (proc_root / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        stat = _proc_stat(int(entry.name))
        if stat is not None and int(stat[2]) == pgid and stat[0] != "Z":
            return True
    return False


def _wait_group_gone(pgid: int, proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None:
            proc.poll()  # reap our own child so it does not linger as a zombie
        if not _group_alive(pgid):
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1)
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_SECONDS)


def processes_of(dir: Path) -> list[int]:
    """Pids whose command line mentions ``dir`` (a check that nothing of a node is left running)."""
    needle = str(dir).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found
