"""Build the testbed's real peers from Go modules: etcd and the Kubernetes control plane, and for the
chart and end-to-end tests helm, an OpenTelemetry Collector distribution (with the Collector Builder)
and Jaeger.

The machines this project runs on reach the Go module proxy but no binary download site, so every
peer is compiled from source with the local ``go`` tool. ``go install pkg@version`` refuses
k8s.io/kubernetes (its go.mod carries ``replace`` lines), so each peer is built inside a small
throw-away "wrapper" module under the cache root that requires the real module and pins its
dependencies. Binaries land in version-keyed directories outside the repository, which lets a machine
that already built them skip the (long) build, and lets a version bump rebuild side by side.

Every peer is one row of :data:`PEERS` (a :class:`GoPeer`: module, version, packages, flags) and
one generic builder, :func:`build_peer`, turns any row into its wrapper module and ``go build``
command, so a new peer or version is a new row. Only the Collector distribution is a step of its own:
ocb (itself a row) generates and builds it from a manifest.

Everything that can be left half-done (a wrapper module whose ``go mod tidy`` failed, an interrupted
``go build``) is produced under a ``.tmp`` name first and renamed into place only once complete, so a
later run never mistakes a partial result for a finished one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from otel_dra.testbed.errors import BuildError
from otel_dra.testbed.releases import (
    CONTAINERD_VERSION,
    HELM_VERSION,
    JAEGER_VERSION,
    K8SATTRIBUTES_VERSION,
    KUBERNETES_RELEASES,
    KUBERNETES_STAGING_MODULES,
    KUBERNETES_VERSION_ENV,
    OCB_VERSION,
    OTELCOL_CONTRIB_VERSION,
    OTELCOL_CORE_VERSION,
    OTELCOL_STABLE_VERSION,
    PROMETHEUS_OPERATOR_VERSION,
    UPSTREAM_DRIVER_VERSION,
    KubernetesRelease,
    default_cache_root,
    default_release,
    kubernetes_release,
    minor_of,
    newest_of_minor,
    read_resolved,
    releases,
    version_key,
    write_resolved,
)

# The names other modules import from here, now kept in the release table (releases.py).
__all__ = [
    "CONTAINERD_VERSION",
    "HELM_VERSION",
    "JAEGER_VERSION",
    "KUBERNETES_RELEASES",
    "KUBERNETES_STAGING_MODULES",
    "KUBERNETES_VERSION_ENV",
    "OCB_VERSION",
    "OTELCOL_CONTRIB_VERSION",
    "OTELCOL_CORE_VERSION",
    "OTELCOL_STABLE_VERSION",
    "UPSTREAM_DRIVER_VERSION",
    "Binaries",
    "BinariesMissingError",
    "BuildError",
    "KubernetesRelease",
    "build",
    "default_cache_root",
    "find_binaries",
    "kubernetes_release",
    "refresh_releases",
    "version_key",
]

# The kubelet is a node part (``testbed up --node``), built with the control plane from the same
# wrapper module so that a node always runs the control plane's version.
KUBERNETES_COMMANDS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl", "kubelet")

# The control-plane rows below are written for the oldest supported release; control_plane()
# derives every other release's rows from them.
_OLDEST = KUBERNETES_RELEASES[0]

OTELCOL_NAME = "otelcol-dra"
OTELCOL_TITLE = "the OpenTelemetry Collector"

_CORE = "go.opentelemetry.io/collector"
_CONTRIB = "github.com/open-telemetry/opentelemetry-collector-contrib"

# Jaeger's go.mod replaces sarama; replace lines of a dependency do not apply, so the wrapper
# repeats it.
JAEGER_REPLACES = ("github.com/Shopify/sarama => github.com/Shopify/sarama v1.33.0",)

# The Go stand-ins for modules the proxy refuses (see KubernetesRelease.standins).
STANDINS_DIR = Path(__file__).with_name("standins")

# Receives the human-readable status lines of a build (stderr by default).
Progress = Callable[[str], None]

# How often a long step reports that it is still running, so a multi-minute link does not look hung.
_HEARTBEAT_SECONDS = 30.0
# Lines of go output kept for the error message of a failed step (the full output goes to a log file).
_ERROR_TAIL_LINES = 60


class BinariesMissingError(BuildError):
    """The testbed binaries have not been built on this machine yet."""


# --- the peer table --------------------------------------------------------------------------------


@dataclass(frozen=True)
class GoPeer:
    """One row of the peer table: Go main package(s) built inside a wrapper module that requires
    ``module`` at ``version``.

    The row's key ``<name>-<version>`` names everything it leaves in the cache: the wrapper module
    ``src/<key>``, the binaries ``bin/<key>/`` and the logs ``logs/<key>-tidy.log`` and
    ``logs/<key>-build.log``. Fields that depend on the version (Kubernetes' staging replaces and
    version ldflags) can be functions of the row, so that a row for another version is the same row
    with only ``version`` changed.
    """

    name: str
    version: str
    module: str
    # Main packages, built by one `go build` in this order; () means the module's root package.
    packages: tuple[str, ...] = ()
    # The executable's name where it is not the package's last path element (one-package rows only):
    # go names the binaries of several packages itself.
    binary: str = ""
    # The packages tools.go imports so that `go mod tidy` records their dependencies; None: `packages`.
    imports: tuple[str, ...] | Callable[[GoPeer], tuple[str, ...]] | None = None
    ldflags: str | Callable[[GoPeer], str] = ""
    # go.mod replace directives ("old => new version"): a dependency's own replaces do not apply.
    replaces: tuple[str, ...] | Callable[[GoPeer], tuple[str, ...]] = ()
    godebug: str = ""
    # False: CGO_ENABLED=0, like the peers' static release binaries (cgo buys nothing here and needs
    # a C toolchain); None: the environment's setting.
    cgo: bool | None = False
    trimpath: bool = False
    # What the progress lines call the build step (after "go build "); default: the binary names.
    label: str = ""
    # How messages name the peer ("Jaeger is not built yet", "install Go ... to build Jaeger"); default: name.
    title: str = ""
    # The oldest Go toolchain that builds this version, for the hint when `go` is missing.
    min_go: str = "1.24"
    # True: the key also carries a digest of the build recipe (packages, flags, replaces), so that a
    # row that gains a binary or a flag builds into a new directory beside the old one. Without it a
    # warm cache would either keep a directory that lacks the new binary or have to rebuild it in
    # place, under the feet of every checkout that shares the cache.
    recipe_in_key: bool = False
    # The Go toolchain the row needs where the machine's go is older ("go1.27.3"; the go command
    # fetches it from the module proxy, GOTOOLCHAIN); "": the machine's.
    toolchain: str | Callable[[GoPeer], str] = ""
    # Local modules copied into the wrapper module beside go.mod (directories under standins/, each
    # the stand-in for a module the proxy refuses; the row's replaces point at them).
    local_modules: tuple[str, ...] | Callable[[GoPeer], tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if not self.packages:
            object.__setattr__(self, "packages", (self.module,))  # frozen: the dataclass way to normalise
        if not self.title:
            object.__setattr__(self, "title", self.name)
        if self.binary and len(self.packages) != 1:
            raise ValueError(f"{self.key}: `binary` names the output of a one-package row only")

    @property
    def key(self) -> str:
        if self.recipe_in_key:
            return f"{self.name}-{self.version}-{self.recipe_digest()}"
        return f"{self.name}-{self.version}"

    def recipe_digest(self) -> str:
        """Ten hex digits of SHA-256 over what decides the row's binaries besides module and version."""
        import hashlib

        recipe = json.dumps(
            {
                "packages": self.packages,
                "binary": self.binary,
                "imports": self.tools_imports(),
                "ldflags": self.go_ldflags(),
                "replaces": self.go_replaces(),
                "godebug": self.godebug,
                "cgo": self.cgo,
                "trimpath": self.trimpath,
                # Only where set, so that the keys of the rows without them stay what they were.
                **({"toolchain": self.go_toolchain()} if self.go_toolchain() else {}),
                **(
                    {"local": {name: _local_module_files(name) for name in self.go_local_modules()}}
                    if self.go_local_modules()
                    else {}
                ),
            },
            sort_keys=True,
        )
        return hashlib.sha256(recipe.encode()).hexdigest()[:10]

    @property
    def binaries(self) -> tuple[str, ...]:
        if self.binary:
            return (self.binary,)
        return tuple(package.rsplit("/", 1)[-1] for package in self.packages)

    def bin_dir(self, root: Path) -> Path:
        return root / "bin" / self.key

    def tools_imports(self) -> tuple[str, ...]:
        if self.imports is None:
            return self.packages
        return self.imports(self) if callable(self.imports) else self.imports

    def go_ldflags(self) -> str:
        return self.ldflags(self) if callable(self.ldflags) else self.ldflags

    def go_replaces(self) -> tuple[str, ...]:
        return self.replaces(self) if callable(self.replaces) else self.replaces

    def go_toolchain(self) -> str:
        return self.toolchain(self) if callable(self.toolchain) else self.toolchain

    def go_local_modules(self) -> tuple[str, ...]:
        return self.local_modules(self) if callable(self.local_modules) else self.local_modules


def _local_module_files(name: str) -> dict[str, str]:
    """The files of the stand-in module standins/<name>, by path relative to it."""
    base = STANDINS_DIR / name
    if not base.is_dir():
        raise BuildError(f"no stand-in module {name} under {STANDINS_DIR}")
    return {str(path.relative_to(base)): path.read_text() for path in sorted(base.rglob("*")) if path.is_file()}


def _release_of(peer: GoPeer) -> KubernetesRelease:
    """The table row of a Kubernetes peer row's version (a tracking row's at any resolved version)."""
    for row in KUBERNETES_RELEASES:
        if row.minor == minor_of(peer.version):
            return row
    raise BuildError(f"Kubernetes {peer.version} is not a release of the table")


def kubernetes_staging_replaces(peer: GoPeer) -> tuple[str, ...]:
    """k8s.io/<staging> => the v0.<minor>.<patch> release, for each staging module of the row's
    release (KUBERNETES_RELEASES), and each stand-in module => its local copy."""
    staging_version = "v0." + peer.version.removeprefix("v1.")
    release = _release_of(peer)
    return (
        *(f"k8s.io/{name} => k8s.io/{name} {staging_version}" for name in release.staging),
        *(f"{module} => ./{module.rsplit('/', 1)[-1]}" for module in release.standins),
    )


def kubernetes_local_modules(peer: GoPeer) -> tuple[str, ...]:
    return tuple(module.rsplit("/", 1)[-1] for module in _release_of(peer).standins)


def kubernetes_toolchain(peer: GoPeer) -> str:
    return _release_of(peer).go


def kubernetes_version_ldflags(peer: GoPeer) -> str:
    # Without these the binaries report v0.0.0-master, which breaks /version and kubectl's skew check.
    major, minor, _ = peer.version.removeprefix("v").split(".", 2)
    return (
        "-s -w"
        f" -X k8s.io/component-base/version.gitVersion={peer.version}"
        f" -X k8s.io/component-base/version.gitMajor={major}"
        f" -X k8s.io/component-base/version.gitMinor={minor}"
    )


def kubernetes_tools_imports(peer: GoPeer) -> tuple[str, ...]:
    """The commands, with kubectl's command tree (it lives in the k8s.io/kubectl staging module)
    imported just before cmd/kubectl."""
    return tuple(
        imported
        for package in peer.packages
        for imported in (("k8s.io/kubectl/pkg/cmd", package) if package.endswith("/cmd/kubectl") else (package,))
    )


def helm_version_ldflags(peer: GoPeer) -> str:
    # As helm's own release build does: the version `helm version` reports.
    return f"-s -w -X helm.sh/helm/v3/internal/version.version={peer.version}"


# The table. A row gives name, version and the module its wrapper requires, then only what differs from
# GoPeer's defaults (one `go build` of the module's root package, static, `-o <name>`).
ETCD = GoPeer("etcd", _OLDEST.etcd, "go.etcd.io/etcd/server/v3", binary="etcd")
# Another Kubernetes version is this row with another version: dataclasses.replace(KUBERNETES, version=...).
KUBERNETES = GoPeer(
    "kubernetes", _OLDEST.version, "k8s.io/kubernetes",
    packages=tuple(f"k8s.io/kubernetes/cmd/{name}" for name in KUBERNETES_COMMANDS),
    imports=kubernetes_tools_imports, ldflags=kubernetes_version_ldflags, replaces=kubernetes_staging_replaces,
    # Copied from k8s.io/kubernetes' own go.mod (per release, see control_plane): the main module's
    # godebug settings decide runtime behaviour, and Kubernetes is tested with these defaults.
    godebug=_OLDEST.godebug,
    # The control plane has always been built with the environment's cgo setting; forcing it either
    # way would make a fresh machine's binaries differ from the cached ones.
    cgo=None, title="Kubernetes", recipe_in_key=True,
    toolchain=kubernetes_toolchain, local_modules=kubernetes_local_modules,
)  # fmt: skip
# A module build has no release ldflags for the Kubernetes version, so helm assumes an old one:
# callers pass ``--kube-version`` to ``template``/``lint``.
HELM = GoPeer(
    "helm", HELM_VERSION, "helm.sh/helm/v3", packages=("helm.sh/helm/v3/cmd/helm",), ldflags=helm_version_ldflags
)
OCB = GoPeer(
    "ocb", OCB_VERSION, f"{_CORE}/cmd/builder", binary="ocb", ldflags="-s -w",
    label="builder", title="the OpenTelemetry Collector Builder", min_go="1.26",
)  # fmt: skip
# cmd/jaeger: Jaeger v2 with memory storage and the query API.
JAEGER = GoPeer(
    "jaeger", JAEGER_VERSION, "github.com/jaegertracing/jaeger",
    packages=("github.com/jaegertracing/jaeger/cmd/jaeger",), ldflags="-s -w", replaces=JAEGER_REPLACES, trimpath=True,
    label="cmd/jaeger", title="Jaeger", min_go="1.26",
)  # fmt: skip


def containerd_version_ldflags(peer: GoPeer) -> str:
    # As containerd's Makefile does: the version `containerd --version` and the CRI's Version report.
    package = "github.com/containerd/containerd/v2"
    return f"-s -w -X {package}/version.Version={peer.version} -X {package}/version.Package={package}"


# containerd, its CLI and the runc shim (runc itself and the CNI plugins come from Debian, see
# .ci/run). Static (the Makefile's default for releases): cgo would only add the btrfs snapshotter,
# whose headers a fresh machine lacks.
CONTAINERD = GoPeer(
    "containerd", CONTAINERD_VERSION, "github.com/containerd/containerd/v2",
    packages=tuple(
        f"github.com/containerd/containerd/v2/cmd/{name}" for name in ("containerd", "ctr", "containerd-shim-runc-v2")
    ),
    ldflags=containerd_version_ldflags, title="containerd", min_go="1.26",
)  # fmt: skip

# The upstream example driver's kubelet plugin, for bench.plugin's side-by-side comparison on a real
# node only: never a product or CI peer (not in `make peers`, not built by `testbed build`). Its go.mod
# has no replace lines; it needs Go 1.26 (k8s.io 0.36 modules).
UPSTREAM_DRIVER = GoPeer(
    "dra-example-driver", UPSTREAM_DRIVER_VERSION, "sigs.k8s.io/dra-example-driver",
    packages=("sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin",), ldflags="-s -w", trimpath=True,
    label="cmd/dra-example-kubeletplugin", title="the upstream dra-example-driver", min_go="1.26",
)  # fmt: skip

PEERS: tuple[GoPeer, ...] = (ETCD, KUBERNETES, HELM, OCB, JAEGER, CONTAINERD)
# What `build` builds and `Binaries` points at, in build order.
CONTROL_PLANE: tuple[GoPeer, ...] = (KUBERNETES, ETCD)


def control_plane(release: str | KubernetesRelease | None = None) -> tuple[GoPeer, ...]:
    """The control-plane rows (Kubernetes, etcd) of a release (see :func:`kubernetes_release`)."""
    chosen = kubernetes_release(release)
    kubernetes, etcd = CONTROL_PLANE
    return (
        dataclasses.replace(kubernetes, version=chosen.version, godebug=chosen.godebug),
        dataclasses.replace(etcd, version=chosen.etcd),
    )


@dataclass(frozen=True)
class Binaries:
    """Paths to the control plane's executables; a field per binary of :data:`CONTROL_PLANE` that
    the testbed runs (``kube_apiserver`` is the binary ``kube-apiserver``)."""

    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    kubectl: Path
    kubelet: Path

    def all(self) -> tuple[Path, ...]:
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def missing(self) -> list[Path]:
        return [path for path in self.all() if not _is_executable(path)]

    def as_dict(self) -> dict[str, str]:
        return {_binary_name(field.name): str(getattr(self, field.name)) for field in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, str]) -> Binaries:
        """The inverse of :meth:`as_dict`; keys that are not fields (other binaries) are ignored, and
        a state file from before the kubelet was built names it beside kube-apiserver."""
        data = {"kubelet": str(Path(data["kube-apiserver"]).with_name("kubelet")), **data}
        return cls(**{field.name: Path(data[_binary_name(field.name)]) for field in dataclasses.fields(cls)})


def _binary_name(field_name: str) -> str:
    return field_name.replace("_", "-")


def resolve_cache_root(cache_root: Path | None) -> Path:
    return (cache_root if cache_root is not None else default_cache_root()).expanduser().resolve()


def expected_binaries(cache_root: Path | None = None, version: str | KubernetesRelease | None = None) -> Binaries:
    """Where the binaries of a release (default: :func:`kubernetes_release`'s) live under the cache
    root, built or not."""
    root = resolve_cache_root(cache_root)
    return Binaries.from_dict(
        {name: str(peer.bin_dir(root) / name) for peer in control_plane(version) for name in peer.binaries}
    )


def find_binaries(cache_root: Path | None = None, version: str | KubernetesRelease | None = None) -> Binaries:
    """Return the built binaries, or raise :class:`BinariesMissingError` saying how to build them."""
    release = kubernetes_release(version)
    binaries = expected_binaries(cache_root, release)
    missing = binaries.missing()
    if missing:
        listed = ", ".join(str(path) for path in missing)
        flag = "" if release.minor == default_release().minor else f" --kubernetes-version {release.minor}"
        raise BinariesMissingError(
            f"testbed binaries are not built yet (missing: {listed}); "
            f"run `otel-dra testbed build{flag}` first (takes a while the first time)"
        )
    return binaries


def find_or_build_binaries(version: str | KubernetesRelease | None = None) -> Binaries:
    """The built binaries, building them first when missing (several minutes, once)."""
    try:
        return find_binaries(version=version)
    except BinariesMissingError:
        _to_stderr("building the testbed binaries first (one time, several minutes)")
        return build(version=version)


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _require_built(path: Path, title: str, flag: str) -> Path:
    if not _is_executable(path):
        raise BinariesMissingError(f"{title} is not built yet ({path}); run `otel-dra testbed build --{flag}`")
    return path


def _require_go(what: str, min_go: str) -> None:
    if shutil.which("go") is None:
        raise BuildError(f"the `go` tool is not on PATH: install Go ({min_go} or newer) to build {what}")


def go_environment(cache_root: Path | None = None) -> dict[str, str]:
    """The environment for go commands: caches under the cache root, no toolchain downloads.

    GOTOOLCHAIN=local keeps go from trying to fetch a newer toolchain (there is no such download
    here); -mod=mod lets go update go.sum for the wrapper modules instead of failing.
    """
    root = resolve_cache_root(cache_root)
    env = dict(os.environ)
    env["GOMODCACHE"] = str(root / "go" / "mod")
    env["GOCACHE"] = str(root / "go" / "build")
    env["GOFLAGS"] = "-mod=mod"
    env["GOTOOLCHAIN"] = "local"
    return env


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- wrapper modules and go commands of a row ----------------------------------------------------


def wrapper_files(peer: GoPeer) -> dict[str, str]:
    """go.mod and tools.go of the row's wrapper module (before ``go mod tidy``)."""
    stanzas = [f"module otel-dra-peers/{peer.name}", "go 1.24.0"]
    if peer.godebug:
        stanzas.append(f"godebug {peer.godebug}")
    stanzas.append(f"require {peer.module} {peer.version}")
    stanzas.extend(f"replace {replace}" for replace in peer.go_replaces())
    # The blank imports make `go mod tidy` record every dependency of the commands we build. The build
    # tag keeps this file out of real builds: importing a main package is only legal for dependency
    # tracking.
    imports = peer.tools_imports()
    if len(imports) == 1:
        import_block = f'import _ "{imports[0]}"\n'
    else:
        import_block = "import (\n" + "".join(f'\t_ "{package}"\n' for package in imports) + ")\n"
    files = {"go.mod": "\n\n".join(stanzas) + "\n", "tools.go": "//go:build tools\npackage tools\n" + import_block}
    for name in peer.go_local_modules():
        files.update({f"{name}/{path}": text for path, text in _local_module_files(name).items()})
    return files


def go_build_command(peer: GoPeer, out_dir: Path) -> list[str]:
    """The ``go build`` argv that writes the row's binaries into ``out_dir``."""
    ldflags = peer.go_ldflags()
    # For one package -o names the file; for several, a trailing separator makes go treat -o as a
    # directory and name each binary after its package.
    output = str(out_dir / peer.binaries[0]) if len(peer.packages) == 1 else str(out_dir) + os.sep
    return [
        "go",
        "build",
        *(["-trimpath"] if peer.trimpath else []),
        *(["-ldflags", ldflags] if ldflags else []),
        "-o",
        output,
        *peer.packages,
    ]


def go_build_environment(peer: GoPeer, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` (see :func:`go_environment`) with the row's toolchain and cgo setting."""
    env = toolchain_environment(peer, env)
    if peer.cgo is None:
        return env
    return {**env, "CGO_ENABLED": "1" if peer.cgo else "0"}


def toolchain_environment(peer: GoPeer, env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with GOTOOLCHAIN set to the row's toolchain where the machine's go is older: the go
    command then fetches that toolchain from the module proxy like a module (into GOMODCACHE, once)."""
    wanted = peer.go_toolchain()
    if wanted and version_key(local_go_version()) < version_key(wanted.removeprefix("go")):
        return {**env, "GOTOOLCHAIN": wanted}
    return dict(env)


def local_go_version() -> str:
    """The machine's go version ("1.26.8"), asked without letting go switch toolchains."""
    result = subprocess.run(
        ["go", "env", "GOVERSION"], env={**os.environ, "GOTOOLCHAIN": "local"}, capture_output=True, text=True
    )
    text = result.stdout.strip().removeprefix("go")
    if result.returncode != 0 or not text:
        raise BuildError(f"`go env GOVERSION` failed: {result.stderr.strip()}")
    return text.split("-")[0].split(" ")[0]


# The per-peer names from before the table, kept for their callers.
def kubernetes_wrapper_files() -> dict[str, str]:
    return wrapper_files(KUBERNETES)


def etcd_wrapper_files() -> dict[str, str]:
    return wrapper_files(ETCD)


def helm_wrapper_files() -> dict[str, str]:
    return wrapper_files(HELM)


def ocb_wrapper_files() -> dict[str, str]:
    return wrapper_files(OCB)


def jaeger_wrapper_files() -> dict[str, str]:
    return wrapper_files(JAEGER)


def _ensure_wrapper(
    root: Path,
    name: str,
    files: Mapping[str, str],
    *,
    env: Mapping[str, str],
    progress: Progress,
    verbose: bool,
) -> Path:
    """Create and tidy the wrapper module ``<root>/src/<name>`` unless it is already complete."""
    final = root / "src" / name
    if (final / "go.mod").is_file() and (final / "go.sum").is_file():
        return final
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for filename, content in files.items():
        (tmp / filename).parent.mkdir(parents=True, exist_ok=True)
        (tmp / filename).write_text(content)
    # -e: the tools.go imports of main packages make tidy report errors it can safely skip.
    _run_step(
        f"{name}: go mod tidy",
        ["go", "mod", "tidy", "-e"],
        cwd=tmp,
        env=env,
        log=root / "logs" / f"{name}-tidy.log",
        progress=progress,
        verbose=verbose,
    )
    if not (tmp / "go.sum").is_file():
        raise BuildError(f"{name}: go mod tidy did not produce go.sum (see {root / 'logs' / f'{name}-tidy.log'})")
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


# --- building ------------------------------------------------------------------------------------


def _run_step(
    step: str,
    cmd: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    log: Path,
    progress: Progress,
    verbose: bool,
) -> None:
    """Run one go command, reporting start, heartbeats and elapsed time; output only on failure.

    The full output is always written to ``log`` so a failure can be investigated after the fact.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    progress(f"[{step}] started")
    start = time.monotonic()
    tail: collections.deque[str] = collections.deque(maxlen=_ERROR_TAIL_LINES)
    with log.open("w") as log_file:
        proc = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None  # guaranteed by stdout=PIPE

        def pump(stream: Callable[[], str]) -> None:
            for line in iter(stream, ""):
                log_file.write(line)
                tail.append(line.rstrip("\n"))
                if verbose:
                    progress(f"  {line.rstrip()}")

        reader = threading.Thread(target=pump, args=(proc.stdout.readline,), daemon=True)
        reader.start()
        try:
            while True:
                try:
                    proc.wait(timeout=_HEARTBEAT_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    progress(f"[{step}] still running, {time.monotonic() - start:.0f}s")
        except BaseException:
            # Ctrl-C or similar: do not leave a compiler running behind the user's back.
            proc.kill()
            proc.wait()
            raise
        finally:
            reader.join()
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        output = "\n".join(tail)
        raise BuildError(f"[{step}] failed after {elapsed:.0f}s (exit {proc.returncode}); full log: {log}\n{output}")
    progress(f"[{step}] done in {elapsed:.0f}s")


def _build_into(
    final_dir: Path,
    names: Sequence[str],
    run_build: Callable[[Path], None],
) -> None:
    """Build into ``<final_dir>.tmp`` and rename it into place once every expected binary exists."""
    if all(_is_executable(final_dir / name) for name in names):
        return
    tmp = final_dir.with_name(final_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    run_build(tmp)
    absent = [name for name in names if not _is_executable(tmp / name)]
    if absent:
        raise BuildError(f"build finished but did not produce {', '.join(absent)} in {tmp}")
    shutil.rmtree(final_dir, ignore_errors=True)
    tmp.rename(final_dir)


def build_peer(
    peer: GoPeer,
    cache_root: Path | None = None,
    progress: Progress = _to_stderr,
    *,
    verbose: bool = False,
) -> Path:
    """Build any row of the peer table unless its binaries already exist; returns ``bin/<key>/``."""
    root = resolve_cache_root(cache_root)
    _build_peers(root, (peer,), peer.title, progress, verbose)
    return peer.bin_dir(root)


def _build_peers(
    root: Path,
    peers: Sequence[GoPeer],
    what: str,
    progress: Progress,
    verbose: bool,
) -> None:
    """Build each row in turn; go is only required (and ``what`` it builds named) when one is missing."""
    if _all_built(root, peers):
        return
    # Compared as numbers: Go 1.9 is older than 1.24.
    _require_go(what, max((peer.min_go for peer in peers), key=version_key))
    env = go_environment(root)
    for peer in peers:
        _build_row(root, peer, env, progress, verbose)


def _all_built(root: Path, peers: Sequence[GoPeer]) -> bool:
    return all(_is_executable(peer.bin_dir(root) / name) for peer in peers for name in peer.binaries)


def _build_row(root: Path, peer: GoPeer, env: Mapping[str, str], progress: Progress, verbose: bool) -> None:
    """The generic recipe: tidy the row's wrapper module, then one ``go build`` into ``bin/<key>``."""

    def run_build(out_dir: Path) -> None:
        src = _ensure_wrapper(
            root,
            peer.key,
            wrapper_files(peer),
            env=toolchain_environment(peer, env),
            progress=progress,
            verbose=verbose,
        )
        _run_step(
            f"{peer.key}: go build {peer.label or ' '.join(peer.binaries)}",
            go_build_command(peer, out_dir),
            cwd=src,
            env=go_build_environment(peer, env),
            log=root / "logs" / f"{peer.key}-build.log",
            progress=progress,
            verbose=verbose,
        )

    _build_into(peer.bin_dir(root), peer.binaries, run_build)


def served_versions(module: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Every version of ``module`` the module proxy lists (``go list -m -versions``), pre-releases
    included."""
    _require_go(f"the testbed (and to ask the module proxy for {module})", "1.24")
    result = subprocess.run(
        ["go", "list", "-m", "-versions", module],
        # Outside any module (a wrapper's go.mod would not matter, and GOFLAGS=-mod=mod is refused there).
        env={**(env if env is not None else go_environment()), "GOFLAGS": ""},
        cwd=os.sep,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        raise BuildError(f"go list -m -versions {module} failed: {result.stderr.strip()}")
    return result.stdout.split()[1:]


def _is_version(text: str) -> bool:
    try:
        version_key(text)
    except ValueError:
        return False
    return True


def refresh_releases(progress: Progress = _to_stderr) -> tuple[KubernetesRelease, ...]:
    """Ask the module proxy for the newest release of each tracking row's minor and keep the answer
    (``<cache>/releases.json``). An unreachable proxy keeps what was resolved before (one line
    says so): the testbed then builds and runs what it last knew."""
    tracking = [row for row in KUBERNETES_RELEASES if row.tracks]
    if not tracking:
        return releases()
    known = read_resolved()
    try:
        served = served_versions("k8s.io/kubernetes")
    except (BuildError, OSError, subprocess.TimeoutExpired) as exc:
        kept = ", ".join(f"{m} {v}" for m, v in sorted(known.items())) or "the table's floors"
        progress(f"could not ask the module proxy for Kubernetes releases ({exc}); keeping {kept}")
        return releases()
    resolved = {**known, **{row.minor: newest_of_minor(row, served) for row in tracking}}
    newer = sorted(
        (v for v in served if _is_version(v) and version_key(minor_of(v)) > version_key(KUBERNETES_RELEASES[-1].minor)),
        key=version_key,
    )
    if newer:
        # The project supports up to the newest release served: a new minor is one row to add.
        progress(f"Kubernetes {newer[-1]} is served and newer than every row of the release table (releases.py)")
    for row in tracking:
        if resolved[row.minor] != known.get(row.minor):
            progress(f"Kubernetes {row.minor}: the newest release served is {resolved[row.minor]}")
    write_resolved(resolved)
    return releases()


def check_staging(peer: GoPeer, root: Path) -> None:
    """Fail before a long build when the row's staging modules are not those that the release's own
    go.mod replaces with ./staging/src/k8s.io/<name> (a new minor that added or dropped one)."""
    _require_go(peer.title, peer.min_go)
    env = toolchain_environment(peer, {**go_environment(root), "GOFLAGS": ""})
    try:
        result = subprocess.run(
            ["go", "mod", "download", "-json", f"{peer.module}@{peer.version}"],
            env=env,
            cwd=os.sep,
            capture_output=True,
            text=True,
            timeout=600,
        )
        go_mod = Path(json.loads(result.stdout)["GoMod"]).read_text()
    except (ValueError, KeyError, TypeError, OSError, subprocess.TimeoutExpired):
        return  # not downloadable: the wrapper's `go mod tidy` reports why, with its log
    own = {
        line.split()[0].removeprefix("k8s.io/")
        for line in go_mod.splitlines()
        if "=> ./staging/src/k8s.io/" in line and line.strip().startswith("k8s.io/")
    }
    row = set(_release_of(peer).staging)
    if own != row:
        raise BuildError(
            f"Kubernetes {peer.version}: its go.mod replaces the staging modules {sorted(own - row)} that the "
            f"release table lacks, and not {sorted(row - own)} that it names (fix the row's `staging`)"
        )


def build(
    cache_root: Path | None = None,
    progress: Progress = _to_stderr,
    *,
    verbose: bool = False,
    version: str | KubernetesRelease | None = None,
) -> Binaries:
    """Build etcd and the Kubernetes control plane binaries of a release (default: see
    :func:`kubernetes_release`) unless they already exist.

    The first run downloads modules and compiles for a long time (tens of minutes on 2 cores); later
    runs return immediately. ``progress`` receives human-readable status lines; with ``verbose`` it
    also receives go's output as it happens.
    """
    root = resolve_cache_root(cache_root)
    peers = control_plane(version)
    binaries = expected_binaries(root, version)
    # The rows, not `Binaries`: a binary added to a row is built even before the testbed runs it.
    if _all_built(root, peers):
        progress(f"testbed binaries already built under {root / 'bin'}")
        return binaries
    check_staging(peers[0], root)
    _build_peers(root, peers, "the testbed's etcd and Kubernetes binaries from source", progress, verbose)
    missing = binaries.missing()
    if missing:  # pragma: no cover - _build_into already checks each directory
        raise BuildError(f"build finished but binaries are missing: {', '.join(map(str, missing))}")
    progress(f"testbed binaries ready under {root / 'bin'}")
    return binaries


def build_helm(cache_root: Path | None = None, progress: Progress = _to_stderr, *, verbose: bool = False) -> Path:
    """Build the real Helm CLI (for the chart tests) unless it already exists."""
    return build_peer(HELM, cache_root, progress, verbose=verbose) / "helm"


def find_helm(cache_root: Path | None = None) -> Path:
    return _require_built(HELM.bin_dir(resolve_cache_root(cache_root)) / "helm", HELM.title, "helm")


def build_ocb(cache_root: Path | None = None, progress: Progress = _to_stderr, *, verbose: bool = False) -> Path:
    """Build the OpenTelemetry Collector Builder unless it already exists."""
    return build_peer(OCB, cache_root, progress, verbose=verbose) / "ocb"


def build_jaeger(cache_root: Path | None = None, progress: Progress = _to_stderr, *, verbose: bool = False) -> Path:
    """Build Jaeger v2 (``cmd/jaeger``, memory storage and the query API) unless it already exists."""
    return build_peer(JAEGER, cache_root, progress, verbose=verbose) / "jaeger"


def build_node(cache_root: Path | None = None, progress: Progress = _to_stderr, *, verbose: bool = False) -> list[Path]:
    """The node parts besides the kubelet (built with the control plane): containerd, ctr and the
    runc shim, and the locally made pause and busybox images. runc and the CNI plugins come from
    Debian (.ci/run installs them)."""
    from otel_dra.testbed.images import ImageError, node_images

    root = resolve_cache_root(cache_root)
    bin_dir = build_peer(CONTAINERD, root, progress, verbose=verbose)
    try:
        images = node_images(root)
    except ImageError as exc:
        raise BuildError(str(exc)) from None
    return [*(bin_dir / name for name in CONTAINERD.binaries), *(image.tarball for image in images)]


def build_upstream_driver(
    cache_root: Path | None = None, progress: Progress = _to_stderr, *, verbose: bool = False
) -> Path:
    """Build the upstream example driver's kubelet plugin (bench only) unless it already exists."""
    return build_peer(UPSTREAM_DRIVER, cache_root, progress, verbose=verbose) / UPSTREAM_DRIVER.binaries[0]


def find_jaeger(cache_root: Path | None = None) -> Path:
    return _require_built(JAEGER.bin_dir(resolve_cache_root(cache_root)) / "jaeger", JAEGER.title, "jaeger")


# --- prometheus-operator CRDs (chart tests) --------------------------------------------------------

PROMETHEUS_OPERATOR_CRDS = ("servicemonitors", "podmonitors", "prometheusrules")


def prometheus_operator_crds(cache_root: Path | None = None) -> list[Path]:
    """The ServiceMonitor/PodMonitor/PrometheusRule CRD manifests, fetched with ``go mod download``
    from the prometheus-operator module (kept in the module cache; no network once cached)."""
    import json

    root = resolve_cache_root(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    module = f"github.com/prometheus-operator/prometheus-operator@{PROMETHEUS_OPERATOR_VERSION}"
    result = subprocess.run(
        ["go", "mod", "download", "-json", module],
        env=go_environment(root),
        cwd=root,
        capture_output=True,
        text=True,
    )
    try:
        info = json.loads(result.stdout)
    except ValueError:
        raise BuildError(f"go mod download {module} failed: {result.stderr.strip()}") from None
    if info.get("Error") or not info.get("Dir"):
        raise BuildError(f"go mod download {module} failed: {info.get('Error')}")
    crd_dir = Path(info["Dir"]) / "example" / "prometheus-operator-crd"
    paths = [crd_dir / f"monitoring.coreos.com_{name}.yaml" for name in PROMETHEUS_OPERATOR_CRDS]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise BuildError(f"prometheus-operator {PROMETHEUS_OPERATOR_VERSION} lacks {', '.join(missing)}")
    return paths


# --- OpenTelemetry Collector (built with the Collector Builder, for the e2e tests) ------------

# One distribution for the gateway and the agent configs (collector-config/): a second binary would
# double the build time for a handful of packages. Not included, and why:
# - fileexporter: not served at the v0.165 release (only up to v0.161.0).
# - resourcedetectionprocessor: v0.165.x declares `go 1.26.9`, newer than the Go toolchain the
#   project builds with (1.26.8, GOTOOLCHAIN=local); k8sattributes + resource cover the agent's needs.
OTELCOL_COMPONENTS: Mapping[str, tuple[str, ...]] = {
    "receivers": (f"{_CORE}/receiver/otlpreceiver {OTELCOL_CORE_VERSION}",),
    "processors": (
        f"{_CORE}/processor/batchprocessor {OTELCOL_CORE_VERSION}",
        f"{_CORE}/processor/memorylimiterprocessor {OTELCOL_CORE_VERSION}",
        f"{_CONTRIB}/processor/k8sattributesprocessor {K8SATTRIBUTES_VERSION}",
        f"{_CONTRIB}/processor/resourceprocessor {OTELCOL_CONTRIB_VERSION}",
    ),
    "exporters": (
        f"{_CORE}/exporter/otlpexporter {OTELCOL_CORE_VERSION}",
        f"{_CORE}/exporter/otlphttpexporter {OTELCOL_CORE_VERSION}",
        f"{_CORE}/exporter/debugexporter {OTELCOL_CORE_VERSION}",
        f"{_CONTRIB}/exporter/prometheusexporter {OTELCOL_CONTRIB_VERSION}",
    ),
    "extensions": (f"{_CONTRIB}/extension/healthcheckextension {OTELCOL_CONTRIB_VERSION}",),
    # Config sources: ${env:...} and ${file:...} in configs, --config=<file>, yaml: for overrides.
    "providers": tuple(
        f"{_CORE}/confmap/provider/{name}provider {OTELCOL_STABLE_VERSION}" for name in ("env", "file", "yaml")
    ),
}

# k8sattributesprocessor cannot be had at the v0.165 release itself: v1.4.0/v1.4.1 (built from contrib
# v0.165.x) require go.opentelemetry.io/otel at an unreleased commit (semconv/v1.44.0) that the module
# proxy does not serve. v1.3.1 (contrib v0.164.1) builds against the released otel v1.47.0 and the
# stable v1.71.0 core APIs, but its internal/kubelet v0.164.1 is not served either: the v0.165.1 one
# replaces it. Its tests' semconvtest module is not served at any version, hence `go mod tidy -e`.
OTELCOL_REPLACES = (f"{_CONTRIB}/internal/kubelet => {_CONTRIB}/internal/kubelet {OTELCOL_CONTRIB_VERSION}",)


def otelcol_manifest(output_path: Path) -> str:
    """The Collector Builder manifest of the project's distribution (YAML text)."""
    lines = [
        "dist:",
        f"  name: {OTELCOL_NAME}",
        "  module: otel-dra-peers/otelcol",
        "  description: OpenTelemetry Collector for otel-dra (tests and collector-config/ validation)",
        f"  version: {OTELCOL_CORE_VERSION.removeprefix('v')}-otel-dra",
        f"  output_path: {output_path}",
    ]
    for kind, modules in OTELCOL_COMPONENTS.items():
        lines.append(f"{kind}:")
        lines.extend(f"  - gomod: {module}" for module in modules)
    lines.append("replaces:")
    lines.extend(f"  - {replace}" for replace in OTELCOL_REPLACES)
    return "\n".join(lines) + "\n"


def _otelcol_key() -> str:
    """Cache key: the core version plus a digest of the component list, so that adding a component
    builds a new binary beside the old one instead of reusing a binary that lacks it."""
    import hashlib

    digest = hashlib.sha256(otelcol_manifest(Path("-")).encode()).hexdigest()[:10]
    return f"{OTELCOL_NAME}-{OTELCOL_CORE_VERSION}-{digest}"


def _otelcol_bin_dir(root: Path) -> Path:
    return root / "bin" / _otelcol_key()


def find_otelcol(cache_root: Path | None = None) -> Path:
    path = _otelcol_bin_dir(resolve_cache_root(cache_root)) / OTELCOL_NAME
    return _require_built(path, OTELCOL_TITLE, "otelcol")


def build_otelcol(
    cache_root: Path | None = None,
    progress: Progress = _to_stderr,
    *,
    verbose: bool = False,
) -> Path:
    """Build the project's Collector distribution with ocb unless it already exists.

    Not a row of the peer table: there is no module to wrap, ocb (a row) generates one from the
    manifest. ocb generates the distribution's Go sources under ``<cache>/src/<key>``, runs ``go mod tidy`` and
    ``go build`` there (with our GOMODCACHE/GOCACHE/GOTOOLCHAIN, which it passes through), and the
    binary is moved into ``<cache>/bin/<key>/`` only once it exists.
    """
    root = resolve_cache_root(cache_root)
    key = _otelcol_key()
    target = _otelcol_bin_dir(root) / OTELCOL_NAME
    if _is_executable(target):
        return target
    _require_go(OTELCOL_TITLE, OCB.min_go)
    ocb = build_ocb(root, progress, verbose=verbose)
    env = go_environment(root)

    def run_build(out_dir: Path) -> None:
        src = root / "src" / key
        # ocb regenerates every file; a fresh directory keeps an interrupted run from mixing in.
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        manifest = src / "manifest.yaml"
        manifest.write_text(otelcol_manifest(src))
        _run_step(
            f"{key}: ocb (go mod tidy + go build)",
            [str(ocb), f"--config={manifest}", *(["--verbose"] if verbose else [])],
            cwd=src,
            # ocb runs `go mod tidy` without -e, which fails on test-only modules the proxy does not
            # serve (see OTELCOL_REPLACES); GOFLAGS reaches only the go commands that know a flag, so
            # -e applies to tidy and not to build.
            env={**env, "GOFLAGS": env["GOFLAGS"] + " -e"},
            log=root / "logs" / f"{key}-build.log",
            progress=progress,
            verbose=verbose,
        )
        built = src / OTELCOL_NAME
        if not _is_executable(built):
            raise BuildError(f"ocb finished but {built} does not exist (see {root / 'logs' / f'{key}-build.log'})")
        shutil.move(str(built), out_dir / OTELCOL_NAME)

    _build_into(_otelcol_bin_dir(root), (OTELCOL_NAME,), run_build)
    return target
