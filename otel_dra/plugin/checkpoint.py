"""The checkpoint: which claims this plugin has prepared, and what it returned for them.

A JSON file under the plugin's directory, replaced atomically on every change, so that prepare
stays idempotent across plugin restarts (the kubelet repeats NodePrepareResources for running
pods after a restart, and must get the same devices back) and unprepare still knows what to
remove.

A checkpoint that exists but cannot be used (truncated, corrupted, of an unknown version,
unreadable) is never replaced by an empty one, which would forget what was prepared, and never
stops the plugin either (under a DaemonSet that is a crash loop that fixes nothing). The plugin
serves on, and every prepare and unprepare fails for that claim with the reason and the way out;
the kubelet retries them. Each such call reads the file again, so once the operator has fixed it,
or moved it away to start empty (``mv checkpoint.json checkpoint.json.broken``; unprepare removes a
claim's CDI spec by UID even without an entry, so nothing is left behind), the next retry
succeeds without a restart. docs/plugin.md, "The checkpoint, the CDI directory and crashes", says so
for operators.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any

from otel_dra.plugin.files import write_atomic
from otel_dra.records import asdict, record

VERSION = 1


class CheckpointError(RuntimeError):
    """The checkpoint file exists but cannot be used; the message names it."""


@record(frozen=True)
class PreparedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    # What the claim's CDI spec sets for the device (it depends on the claim's configuration, read
    # only at the first prepare), so that a lost spec is written again the same. Empty in entries of
    # older plugin versions: the driver then recomputes the defaults.
    container_env: tuple[str, ...] = ()
    # The allocation's shareID when the device allows several allocations (it keys the device's
    # entry in the claim's status.devices); "" otherwise and in entries of older plugin versions.
    share_id: str = ""


@record(frozen=True)
class PreparedClaim:
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "devices": [
                {
                    **asdict(d),
                    "request_names": list(d.request_names),
                    "cdi_device_ids": list(d.cdi_device_ids),
                    "container_env": list(d.container_env),
                }
                for d in self.devices
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> PreparedClaim:
        if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
            raise ValueError("not a prepared-claim entry")
        devices = []
        for d in data["devices"]:
            devices.append(
                PreparedDevice(
                    request_names=tuple(str(r) for r in d["request_names"]),
                    pool_name=str(d["pool_name"]),
                    device_name=str(d["device_name"]),
                    cdi_device_ids=tuple(str(c) for c in d["cdi_device_ids"]),
                    container_env=tuple(str(e) for e in d.get("container_env") or ()),
                    share_id=str(d.get("share_id") or ""),
                )
            )
        return cls(namespace=str(data["namespace"]), name=str(data["name"]), devices=tuple(devices))


class Checkpoint:
    """Prepared claims by UID, in memory and on disk. Thread-safe.

    ``broken`` is the error of a checkpoint file that could not be loaded (None once loaded);
    while it is set, every method but ``uids`` raises it, after reading the file once more."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._claims: dict[str, PreparedClaim] = {}
        # Each entry's JSON form, made once when the claim is recorded: every change rewrites the
        # whole file, and converting every entry again made a write grow with the prepared claims.
        self._entries: dict[str, dict[str, Any]] = {}
        self.broken: CheckpointError | None = None
        self._dirty = False  # removals made in memory, not written yet (remove(write=False))
        with self._lock, contextlib.suppress(CheckpointError):
            self._reload()  # a broken file is reported by each call (see the module notes)

    def _reload(self) -> None:
        """Load the file if it has not been loaded yet; raise CheckpointError while it is unusable."""
        try:
            claims = self._load()
        except CheckpointError as exc:
            self.broken = exc
            raise
        self._claims = claims
        self._entries = {uid: c.to_json() for uid, c in claims.items()}
        self.broken = None

    def _usable(self) -> None:
        if self.broken is not None:
            self._reload()

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {self.path}: {exc}; {self._way_out()}") from exc
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            if data.get("version") != VERSION:
                raise ValueError(f"unknown format version {data.get('version')!r}")
            claims = data["claims"]
            if not isinstance(claims, dict):
                raise ValueError("'claims' is not an object")
            return {str(uid): PreparedClaim.from_json(entry) for uid, entry in claims.items()}
        except (ValueError, KeyError, TypeError) as exc:
            # Refuse rather than start empty: an empty checkpoint would forget the prepared claims
            # (a restarted kubelet's re-prepare of a claim deleted meanwhile answers from it). The
            # operator decides; the file stays as it is.
            raise CheckpointError(f"checkpoint {self.path} is unreadable ({exc!r}); {self._way_out()}") from exc

    def _way_out(self) -> str:
        return (
            f"no claim is prepared or unprepared until it is fixed or moved away (mv {self.path} "
            f"{self.path}.broken starts an empty one); it is read again at the next call, no restart needed"
        )

    def _save(self, entries: dict[str, dict[str, Any]], *, durable: bool = True) -> None:
        data = {"version": VERSION, "claims": entries}
        write_atomic(self.path, (json.dumps(data, separators=(",", ":")) + "\n").encode(), 0o600, durable=durable)

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            self._usable()
            return self._claims.get(uid)

    def uids(self) -> list[str]:
        with self._lock:
            return sorted(self._claims)

    def put(self, uid: str, claim: PreparedClaim) -> None:
        """Record a prepared claim; on a write error nothing changes (memory follows the disk)."""
        with self._lock:
            self._usable()
            entries = {**self._entries, uid: claim.to_json()}
            self._save(entries)  # the removals not written yet go with it
            self._claims = {**self._claims, uid: claim}
            self._entries = entries
            self._dirty = False

    def remove(self, uid: str, *, write: bool = True) -> bool:
        """Forget a claim; ``write``: rewrite the file now, else at the next :meth:`flush` or
        :meth:`put` (the unprepare's, after the kubelet has its answer: cleanup.py). Readers of
        this object see the claim gone at once either way."""
        with self._lock:
            self._usable()
            if uid not in self._claims:
                return False
            entries = {k: v for k, v in self._entries.items() if k != uid}
            if write:
                # Not fsynced (files.write_atomic): what a machine crash can lose here is the
                # removal, i.e. an entry of a claim unprepared already, never a prepared claim.
                # Such an entry answers nothing (claim UIDs are never reused), and the restarted
                # plugin, which reads every claim of its checkpoint, drops it when the claim is
                # gone (Driver.forget_gone_claim). It saves each unprepare an fsync (issue 29).
                self._save(entries, durable=False)
            self._dirty = not write  # a write now took the earlier removals along
            self._claims = {k: v for k, v in self._claims.items() if k != uid}
            self._entries = entries
            return True

    def flush(self) -> bool:
        """Write the removals not written yet (not fsynced, as :meth:`remove`); whether there
        were any. On a write error they stay to be written."""
        with self._lock:
            self._usable()
            if not self._dirty:
                return False
            self._save(self._entries, durable=False)
            self._dirty = False
            return True
