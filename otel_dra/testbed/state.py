"""A testbed as ``DIR/state.json`` records it: its API server and credentials, its ports and
binaries, and every process it started (the control plane's components, a node's daemons), so that
another process (``otel-dra testbed down``) can find and stop them later.

Below both the control plane (:mod:`otel_dra.testbed.controlplane`) and the node
(:mod:`otel_dra.testbed.node`): each starts, stops and records its processes through
:class:`TestbedState`, and neither imports the other. The control plane stops what is attached to
it before itself without knowing what that is: a part registers its teardown with
:func:`before_down` (the package does it for the nodes, in ``otel_dra/testbed/__init__.py``).
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import yaml

from otel_dra.testbed.build import Binaries
from otel_dra.testbed.processes import process_alive, spawn, stop_group

_STATE_VERSION = 1
_LOG_TAIL_LINES = 40
# How long a process gets between SIGTERM and SIGKILL, and after SIGKILL.
STOP_TIMEOUT = 20.0


class TestbedError(RuntimeError):
    """The testbed could not be started, reached or stopped."""

    __test__ = False  # not a pytest test class despite the name


class KubectlError(subprocess.CalledProcessError):
    """A kubectl call failed; unlike CalledProcessError its message includes kubectl's stderr."""

    def __str__(self) -> str:
        stderr = self.stderr.strip() if isinstance(self.stderr, str) else ""
        return f"{super().__str__()}\n{stderr}" if stderr else super().__str__()


@dataclass
class TestbedState:
    """A testbed's recorded state, its processes and how to use its API server as administrator or
    as other identities. The control plane's :class:`~otel_dra.testbed.controlplane.Testbed` adds
    starting, stopping and outages of its own components."""

    __test__ = False  # keeps pytest from collecting this class in modules that import it

    dir: Path
    kubeconfig: Path
    server: str
    token: str = field(repr=False)  # admin bearer token: never shown in logs or reprs
    ca_file: Path
    ports: dict[str, int]
    binaries: Binaries
    # Per component: argv, pid, start_time (to detect pid reuse) and log path, as in state.json.
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Real nodes (otel_dra.testbed.node), by node name: their directory and ports.
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)

    # --- state -----------------------------------------------------------------------------------

    @property
    def state_file(self) -> Path:
        return self.dir / "state.json"

    @property
    def pids(self) -> dict[str, int]:
        """Process ids (and process group ids) of the components that are currently started."""
        return {name: int(comp["pid"]) for name, comp in self.components.items() if comp.get("pid")}

    def save_state(self) -> None:
        state = {
            "version": _STATE_VERSION,
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "ca_file": str(self.ca_file),
            "token": self.token,
            "ports": self.ports,
            "binaries": self.binaries.as_dict(),
            "components": self.components,
            "nodes": self.nodes,
        }
        write_private(self.state_file, json.dumps(state, indent=2) + "\n")

    @classmethod
    def load(cls, dir: Path) -> Self:
        """The testbed described by ``DIR/state.json`` (started by this or another process)."""
        state_file = dir / "state.json"
        try:
            state = json.loads(state_file.read_text())
        except FileNotFoundError:
            raise TestbedError(f"no testbed state in {dir} (not started, or already down)") from None
        if state.get("version") != _STATE_VERSION:
            raise TestbedError(f"{state_file} has an unknown format version {state.get('version')!r}")
        return cls(
            dir=dir.resolve(),
            kubeconfig=Path(state["kubeconfig"]),
            server=state["server"],
            token=state["token"],
            ca_file=Path(state["ca_file"]),
            ports={k: int(v) for k, v in state["ports"].items()},
            binaries=Binaries.from_dict(state["binaries"]),
            components=state["components"],
            nodes=state.get("nodes", {}),
        )

    # --- using the cluster -----------------------------------------------------------------------

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run the built kubectl against this testbed (as admin unless ``kubeconfig`` is given)."""
        cmd = [str(self.binaries.kubectl), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, cmd, result.stdout, result.stderr)
        return result

    def mint_token(self, namespace: str, serviceaccount: str, *, duration: str | None = None) -> str:
        """A bound ServiceAccount token from the TokenRequest API; the ServiceAccount must exist."""
        args = ["create", "token", serviceaccount, f"--namespace={namespace}"]
        if duration:
            args.append(f"--duration={duration}")
        return self.kubectl(*args).stdout.strip()

    def write_kubeconfig(self, path: Path, token: str, *, user: str = "user") -> Path:
        """Write a kubeconfig for another identity (bearer ``token``) against this API server."""
        write_token_kubeconfig(path, server=self.server, ca_pem=self.ca_file.read_bytes(), user=user, token=token)
        return path

    def api_ssl_context(self) -> ssl.SSLContext:
        """TLS settings that trust the testbed CA, for HTTP clients that talk to the API server."""
        return ssl.create_default_context(cafile=str(self.ca_file))

    # --- its processes ---------------------------------------------------------------------------

    def spawn(
        self, name: str, argv: Sequence[str], *, append_log: bool = False, env: Mapping[str, str] | None = None
    ) -> None:
        """Start component ``name`` (its log: ``DIR/logs/NAME.log``) and record it."""
        self.components[name] = spawn(
            argv, cwd=self.dir, log_path=self.dir / "logs" / f"{name}.log", append_log=append_log, env=env
        )
        # Saved before waiting for readiness so that `down` can stop it even if we die meanwhile.
        self.save_state()

    def stop_component(self, name: str, timeout: float = STOP_TIMEOUT) -> None:
        """Stop component ``name``'s process group, if it runs (the caller saves the state)."""
        comp = self.components.get(name)
        if not comp or not comp.get("pid"):
            return
        pgid = int(comp["pid"])
        comp["pid"] = None
        if not stop_group(pgid, comp.get("start_time"), timeout):
            raise TestbedError(f"{name} (process group {pgid}) survived SIGKILL")

    def component_alive(self, name: str) -> bool:
        """Whether component ``name`` was started and its process (that very one) still runs."""
        comp = self.components.get(name)
        return bool(comp and comp.get("pid") and process_alive(int(comp["pid"]), comp.get("start_time")))

    def log_tail(self, name: str) -> str:
        """The last lines of component ``name``'s log, for error messages."""
        log_path = self.dir / "logs" / f"{name}.log"
        try:
            lines = log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"(no log at {log_path})"
        tail = "\n".join(lines[-_LOG_TAIL_LINES:])
        return f"--- last {min(len(lines), _LOG_TAIL_LINES)} lines of {log_path} ---\n{tail}"


# --- what stops before the control plane ---------------------------------------------------------

# Teardowns of the parts attached to a testbed (its nodes), run by the control plane's `down`
# before it stops itself, while its API server still answers.
_BEFORE_DOWN: list[Callable[[TestbedState], None]] = []


def before_down(hook: Callable[[TestbedState], None]) -> Callable[[TestbedState], None]:
    """Register ``hook`` to run, with the testbed, before its control plane stops (once per hook)."""
    if hook not in _BEFORE_DOWN:
        _BEFORE_DOWN.append(hook)
    return hook


def stop_attached(testbed: TestbedState) -> None:
    """Run every :func:`before_down` hook. Each runs even if another failed; their
    :class:`TestbedError`\\ s are raised together afterwards."""
    errors: list[TestbedError] = []
    for hook in _BEFORE_DOWN:
        try:
            hook(testbed)
        except TestbedError as exc:
            errors.append(exc)
    if testbed.nodes and not _BEFORE_DOWN:
        # Cannot happen through the package (it registers the nodes' teardown); a node forgotten
        # here would lose the record of the host changes it must undo.
        errors.append(
            TestbedError(f"{testbed.dir}: nodes {', '.join(sorted(testbed.nodes))} left running: nothing stops nodes")
        )
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise TestbedError("\n".join(str(exc) for exc in errors))


# --- files ---------------------------------------------------------------------------------------


def write_private(path: Path, content: str) -> None:
    """Write a file readable only by its owner (it holds a token or key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(content)
    path.chmod(0o600)  # O_CREAT's mode does not apply to a file that already existed


def write_token_kubeconfig(path: Path, *, server: str, ca_pem: bytes, user: str, token: str) -> None:
    """A kubeconfig for bearer ``token`` against ``server``, the CA embedded (readable by its owner only)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "otel-dra-testbed",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "otel-dra-testbed", "context": {"cluster": "otel-dra-testbed", "user": user}}],
        "current-context": "otel-dra-testbed",
        "preferences": {},
    }
    write_private(path, yaml.safe_dump(config, sort_keys=False))
