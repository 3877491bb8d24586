"""Build the testbed's real peers from Go modules: etcd and the Kubernetes control plane, and for the
chart and end-to-end tests helm, an OpenTelemetry Collector distribution (with the Collector Builder)
and Jaeger.

The machines this project runs on reach the Go module proxy but no binary download site, so every
peer is compiled from source with the local ``go`` tool. ``go install pkg@version`` refuses
k8s.io/kubernetes (its go.mod carries ``replace`` lines), so each peer is built inside a small
throw-away "wrapper" module under the cache root that requires the real module and pins its
dependencies. Binaries land in version-keyed directories outside the repository, which lets a machine
that already built them skip the (long) build, and lets a version bump rebuild side by side.

Everything that can be left half-done (a wrapper module whose ``go mod tidy`` failed, an interrupted
``go build``) is produced under a ``.tmp`` name first and renamed into place only once complete, so a
later run never mistakes a partial result for a finished one.
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

KUBERNETES_VERSION = "v1.34.4"
ETCD_VERSION = "v3.6.16"

# k8s.io/kubernetes requires its staging modules at v0.0.0 and relies on replace lines in its own
# go.mod, which do not apply to a module that depends on it; the wrapper must replace each of them
# with the published v0.<minor>.<patch> release matching the Kubernetes version.
KUBERNETES_STAGING_MODULES = (
    "api",
    "apiextensions-apiserver",
    "apimachinery",
    "apiserver",
    "cli-runtime",
    "client-go",
    "cloud-provider",
    "cluster-bootstrap",
    "code-generator",
    "component-base",
    "component-helpers",
    "controller-manager",
    "cri-api",
    "cri-client",
    "csi-translation-lib",
    "dynamic-resource-allocation",
    "endpointslice",
    "externaljwt",
    "kms",
    "kube-aggregator",
    "kube-controller-manager",
    "kube-proxy",
    "kube-scheduler",
    "kubectl",
    "kubelet",
    "metrics",
    "mount-utils",
    "pod-security-admission",
    "sample-apiserver",
    "sample-cli-plugin",
    "sample-controller",
)

KUBERNETES_COMMANDS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")

# How often a long step reports that it is still running, so a multi-minute link does not look hung.
_HEARTBEAT_SECONDS = 30.0
# Lines of go output kept for the error message of a failed step (the full output goes to a log file).
_ERROR_TAIL_LINES = 60


class BuildError(RuntimeError):
    """A peer could not be built (missing toolchain, module resolution or compile failure)."""


class BinariesMissingError(BuildError):
    """The testbed binaries have not been built on this machine yet."""


@dataclass(frozen=True)
class Binaries:
    """Paths to the testbed's executables."""

    etcd: Path
    kube_apiserver: Path
    kube_scheduler: Path
    kube_controller_manager: Path
    kubectl: Path

    def all(self) -> tuple[Path, ...]:
        return (
            self.etcd,
            self.kube_apiserver,
            self.kube_scheduler,
            self.kube_controller_manager,
            self.kubectl,
        )

    def missing(self) -> list[Path]:
        return [path for path in self.all() if not _is_executable(path)]

    def as_dict(self) -> dict[str, str]:
        return {
            "etcd": str(self.etcd),
            "kube-apiserver": str(self.kube_apiserver),
            "kube-scheduler": str(self.kube_scheduler),
            "kube-controller-manager": str(self.kube_controller_manager),
            "kubectl": str(self.kubectl),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, str]) -> Binaries:
        return cls(
            etcd=Path(data["etcd"]),
            kube_apiserver=Path(data["kube-apiserver"]),
            kube_scheduler=Path(data["kube-scheduler"]),
            kube_controller_manager=Path(data["kube-controller-manager"]),
            kubectl=Path(data["kubectl"]),
        )


def default_cache_root() -> Path:
    """``$OTEL_DRA_CACHE``, else ``~/.cache/otel-dra``: shared by every checkout on the machine."""
    env = os.environ.get("OTEL_DRA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "otel-dra"


def _resolve_root(cache_root: Path | None) -> Path:
    return (cache_root if cache_root is not None else default_cache_root()).expanduser().resolve()


def _kubernetes_bin_dir(root: Path) -> Path:
    return root / "bin" / f"kubernetes-{KUBERNETES_VERSION}"


def _etcd_bin_dir(root: Path) -> Path:
    return root / "bin" / f"etcd-{ETCD_VERSION}"


def expected_binaries(cache_root: Path | None = None) -> Binaries:
    """Where the binaries of the pinned versions live under the cache root (built or not)."""
    root = _resolve_root(cache_root)
    kube = _kubernetes_bin_dir(root)
    return Binaries(
        etcd=_etcd_bin_dir(root) / "etcd",
        kube_apiserver=kube / "kube-apiserver",
        kube_scheduler=kube / "kube-scheduler",
        kube_controller_manager=kube / "kube-controller-manager",
        kubectl=kube / "kubectl",
    )


def find_binaries(cache_root: Path | None = None) -> Binaries:
    """Return the built binaries, or raise :class:`BinariesMissingError` saying how to build them."""
    binaries = expected_binaries(cache_root)
    missing = binaries.missing()
    if missing:
        listed = ", ".join(str(path) for path in missing)
        raise BinariesMissingError(
            f"testbed binaries are not built yet (missing: {listed}); "
            "run `otel-dra testbed build` first (takes a while the first time)"
        )
    return binaries


def find_or_build_binaries() -> Binaries:
    """The built binaries, building them first when missing (several minutes, once)."""
    try:
        return find_binaries()
    except BinariesMissingError:
        _print_progress("building the testbed binaries first (one time, several minutes)")
        return build()


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def go_environment(cache_root: Path | None = None) -> dict[str, str]:
    """The environment for go commands: caches under the cache root, no toolchain downloads.

    GOTOOLCHAIN=local keeps go from trying to fetch a newer toolchain (there is no such download
    here); -mod=mod lets go update go.sum for the wrapper modules instead of failing.
    """
    root = _resolve_root(cache_root)
    env = dict(os.environ)
    env["GOMODCACHE"] = str(root / "go" / "mod")
    env["GOCACHE"] = str(root / "go" / "build")
    env["GOFLAGS"] = "-mod=mod"
    env["GOTOOLCHAIN"] = "local"
    return env


def _print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --- wrapper modules -----------------------------------------------------------------------------


def kubernetes_wrapper_files() -> dict[str, str]:
    """go.mod and tools.go of the k8s.io/kubernetes wrapper module (before ``go mod tidy``)."""
    staging_version = "v0." + KUBERNETES_VERSION.removeprefix("v1.")
    replaces = "".join(
        f"replace k8s.io/{name} => k8s.io/{name} {staging_version}\n\n" for name in KUBERNETES_STAGING_MODULES
    )
    go_mod = (
        "module otel-dra-peers/kubernetes\n\n"
        "go 1.24.0\n\n"
        # Copied from k8s.io/kubernetes' own go.mod: the main module's godebug settings decide runtime
        # behaviour, and Kubernetes is tested with these defaults.
        "godebug default=go1.24\n\n"
        f"require k8s.io/kubernetes {KUBERNETES_VERSION}\n\n" + replaces
    ).rstrip("\n") + "\n"
    # The blank imports make `go mod tidy` record every dependency of the commands we build (kubectl's
    # command tree lives in the k8s.io/kubectl staging module). The build tag keeps this file out of
    # real builds: importing a main package is only legal for dependency tracking.
    tools_go = (
        "//go:build tools\n"
        "package tools\n"
        "import (\n"
        '\t_ "k8s.io/kubernetes/cmd/kube-apiserver"\n'
        '\t_ "k8s.io/kubernetes/cmd/kube-scheduler"\n'
        '\t_ "k8s.io/kubernetes/cmd/kube-controller-manager"\n'
        '\t_ "k8s.io/kubectl/pkg/cmd"\n'
        '\t_ "k8s.io/kubernetes/cmd/kubectl"\n'
        ")\n"
    )
    return {"go.mod": go_mod, "tools.go": tools_go}


def etcd_wrapper_files() -> dict[str, str]:
    """go.mod and tools.go of the etcd wrapper module (before ``go mod tidy``)."""
    go_mod = f"module otel-dra-peers/etcd\n\ngo 1.24.0\n\nrequire go.etcd.io/etcd/server/v3 {ETCD_VERSION}\n"
    tools_go = '//go:build tools\npackage tools\nimport _ "go.etcd.io/etcd/server/v3"\n'
    return {"go.mod": go_mod, "tools.go": tools_go}


def _ensure_wrapper(
    root: Path,
    name: str,
    files: Mapping[str, str],
    *,
    env: Mapping[str, str],
    progress: Callable[[str], None],
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
    progress: Callable[[str], None],
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


def _kubernetes_ldflags() -> str:
    # Without these the binaries report v0.0.0-master, which breaks /version and kubectl's skew check.
    major, minor, _ = KUBERNETES_VERSION.removeprefix("v").split(".")
    return (
        "-s -w"
        f" -X k8s.io/component-base/version.gitVersion={KUBERNETES_VERSION}"
        f" -X k8s.io/component-base/version.gitMajor={major}"
        f" -X k8s.io/component-base/version.gitMinor={minor}"
    )


def build(
    cache_root: Path | None = None,
    progress: Callable[[str], None] = _print_progress,
    *,
    verbose: bool = False,
) -> Binaries:
    """Build etcd and the Kubernetes control plane binaries unless they already exist.

    The first run downloads modules and compiles for a long time (tens of minutes on 2 cores); later
    runs return immediately. ``progress`` receives human-readable status lines; with ``verbose`` it
    also receives go's output as it happens.
    """
    root = _resolve_root(cache_root)
    binaries = expected_binaries(root)
    if not binaries.missing():
        progress(f"testbed binaries already built under {root / 'bin'}")
        return binaries
    if shutil.which("go") is None:
        raise BuildError(
            "the `go` tool is not on PATH: install Go (1.24 or newer) to build the testbed's "
            "etcd and Kubernetes binaries from source"
        )
    env = go_environment(root)
    logs = root / "logs"

    def build_kubernetes(out_dir: Path) -> None:
        src = _ensure_wrapper(
            root,
            f"kubernetes-{KUBERNETES_VERSION}",
            kubernetes_wrapper_files(),
            env=env,
            progress=progress,
            verbose=verbose,
        )
        _run_step(
            f"kubernetes-{KUBERNETES_VERSION}: go build {' '.join(KUBERNETES_COMMANDS)}",
            [
                "go",
                "build",
                "-ldflags",
                _kubernetes_ldflags(),
                # A trailing separator makes go treat -o as a directory for several main packages.
                "-o",
                str(out_dir) + os.sep,
                *(f"k8s.io/kubernetes/cmd/{name}" for name in KUBERNETES_COMMANDS),
            ],
            cwd=src,
            env=env,
            log=logs / f"kubernetes-{KUBERNETES_VERSION}-build.log",
            progress=progress,
            verbose=verbose,
        )

    def build_etcd(out_dir: Path) -> None:
        src = _ensure_wrapper(
            root, f"etcd-{ETCD_VERSION}", etcd_wrapper_files(), env=env, progress=progress, verbose=verbose
        )
        # etcd's release binaries are static; cgo buys nothing here and needs a C toolchain.
        _run_step(
            f"etcd-{ETCD_VERSION}: go build etcd",
            ["go", "build", "-o", str(out_dir / "etcd"), "go.etcd.io/etcd/server/v3"],
            cwd=src,
            env={**env, "CGO_ENABLED": "0"},
            log=logs / f"etcd-{ETCD_VERSION}-build.log",
            progress=progress,
            verbose=verbose,
        )

    _build_into(_kubernetes_bin_dir(root), KUBERNETES_COMMANDS, build_kubernetes)
    _build_into(_etcd_bin_dir(root), ("etcd",), build_etcd)
    missing = binaries.missing()
    if missing:  # pragma: no cover - _build_into already checks each directory
        raise BuildError(f"build finished but binaries are missing: {', '.join(map(str, missing))}")
    progress(f"testbed binaries ready under {root / 'bin'}")
    return binaries


# --- helm (chart tests) --------------------------------------------------------------------------

HELM_VERSION = "v3.21.4"


def _helm_bin_dir(root: Path) -> Path:
    return root / "bin" / f"helm-{HELM_VERSION}"


def helm_wrapper_files() -> dict[str, str]:
    go_mod = f"module otel-dra-peers/helm\n\ngo 1.24.0\n\nrequire helm.sh/helm/v3 {HELM_VERSION}\n"
    tools_go = '//go:build tools\npackage tools\nimport _ "helm.sh/helm/v3/cmd/helm"\n'
    return {"go.mod": go_mod, "tools.go": tools_go}


def find_helm(cache_root: Path | None = None) -> Path:
    path = _helm_bin_dir(_resolve_root(cache_root)) / "helm"
    if not _is_executable(path):
        raise BinariesMissingError(f"helm is not built yet ({path}); run `otel-dra testbed build --helm`")
    return path


def build_helm(
    cache_root: Path | None = None,
    progress: Callable[[str], None] = _print_progress,
    *,
    verbose: bool = False,
) -> Path:
    """Build the real Helm CLI (for the chart tests) unless it already exists.

    A module build has no release ldflags, so helm assumes an old Kubernetes version: callers
    pass ``--kube-version`` to ``template``/``lint``.
    """
    root = _resolve_root(cache_root)
    target = _helm_bin_dir(root) / "helm"
    if _is_executable(target):
        return target
    if shutil.which("go") is None:
        raise BuildError("the `go` tool is not on PATH: install Go (1.24 or newer) to build helm")
    env = go_environment(root)

    def run_build(out_dir: Path) -> None:
        src = _ensure_wrapper(
            root, f"helm-{HELM_VERSION}", helm_wrapper_files(), env=env, progress=progress, verbose=verbose
        )
        _run_step(
            f"helm-{HELM_VERSION}: go build helm",
            [
                "go",
                "build",
                "-ldflags",
                f"-s -w -X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
                "-o",
                str(out_dir / "helm"),
                "helm.sh/helm/v3/cmd/helm",
            ],
            cwd=src,
            env={**env, "CGO_ENABLED": "0"},
            log=root / "logs" / f"helm-{HELM_VERSION}-build.log",
            progress=progress,
            verbose=verbose,
        )

    _build_into(_helm_bin_dir(root), ("helm",), run_build)
    return target


# --- prometheus-operator CRDs (chart tests) --------------------------------------------------------

PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
PROMETHEUS_OPERATOR_CRDS = ("servicemonitors", "podmonitors", "prometheusrules")


def prometheus_operator_crds(cache_root: Path | None = None) -> list[Path]:
    """The ServiceMonitor/PodMonitor/PrometheusRule CRD manifests, fetched with ``go mod download``
    from the prometheus-operator module (kept in the module cache; no network once cached)."""
    import json

    root = _resolve_root(cache_root)
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


# --- OpenTelemetry Collector (built with the Collector Builder) and Jaeger (e2e tests) ----------

# The Collector Builder (ocb) release and the component releases it assembles. Every component must
# come from one Collector release: core v0.165.0 pairs with the stable core modules v1.71.0 and with
# contrib v0.165.1. contrib's k8sattributesprocessor is versioned 1.x since it went stable (see
# OTELCOL_REPLACES for why it is one release behind).
OCB_VERSION = "v0.165.0"
OTELCOL_CORE_VERSION = "v0.165.0"
OTELCOL_STABLE_VERSION = "v1.71.0"
OTELCOL_CONTRIB_VERSION = "v0.165.1"
K8SATTRIBUTES_VERSION = "v1.3.1"
OTELCOL_NAME = "otelcol-dra"

_CORE = "go.opentelemetry.io/collector"
_CONTRIB = "github.com/open-telemetry/opentelemetry-collector-contrib"

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

# Jaeger v2 (a Collector distribution itself): tag v1.76.0 carries the v2.13.0 code. Its go.mod
# replaces sarama; replace lines of a dependency do not apply, so the wrapper repeats it.
JAEGER_VERSION = "v1.76.0"
JAEGER_REPLACES = ("github.com/Shopify/sarama => github.com/Shopify/sarama v1.33.0",)


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


def _ocb_bin_dir(root: Path) -> Path:
    return root / "bin" / f"ocb-{OCB_VERSION}"


def _jaeger_bin_dir(root: Path) -> Path:
    return root / "bin" / f"jaeger-{JAEGER_VERSION}"


def ocb_wrapper_files() -> dict[str, str]:
    go_mod = f"module otel-dra-peers/ocb\n\ngo 1.24.0\n\nrequire {_CORE}/cmd/builder {OCB_VERSION}\n"
    tools_go = f'//go:build tools\npackage tools\nimport _ "{_CORE}/cmd/builder"\n'
    return {"go.mod": go_mod, "tools.go": tools_go}


def jaeger_wrapper_files() -> dict[str, str]:
    replaces = "".join(f"replace {line}\n" for line in JAEGER_REPLACES)
    go_mod = (
        f"module otel-dra-peers/jaeger\n\ngo 1.24.0\n\nrequire github.com/jaegertracing/jaeger {JAEGER_VERSION}\n\n"
        + replaces
    )
    tools_go = '//go:build tools\npackage tools\nimport _ "github.com/jaegertracing/jaeger/cmd/jaeger"\n'
    return {"go.mod": go_mod, "tools.go": tools_go}


def find_otelcol(cache_root: Path | None = None) -> Path:
    path = _otelcol_bin_dir(_resolve_root(cache_root)) / OTELCOL_NAME
    if not _is_executable(path):
        raise BinariesMissingError(
            f"the OpenTelemetry Collector is not built yet ({path}); run `otel-dra testbed build --otelcol`"
        )
    return path


def find_jaeger(cache_root: Path | None = None) -> Path:
    path = _jaeger_bin_dir(_resolve_root(cache_root)) / "jaeger"
    if not _is_executable(path):
        raise BinariesMissingError(f"Jaeger is not built yet ({path}); run `otel-dra testbed build --jaeger`")
    return path


def _require_go(what: str) -> None:
    if shutil.which("go") is None:
        raise BuildError(f"the `go` tool is not on PATH: install Go (1.26 or newer) to build {what}")


def build_ocb(
    cache_root: Path | None = None,
    progress: Callable[[str], None] = _print_progress,
    *,
    verbose: bool = False,
) -> Path:
    """Build the OpenTelemetry Collector Builder unless it already exists."""
    root = _resolve_root(cache_root)
    target = _ocb_bin_dir(root) / "ocb"
    if _is_executable(target):
        return target
    _require_go("the OpenTelemetry Collector Builder")
    env = go_environment(root)

    def run_build(out_dir: Path) -> None:
        src = _ensure_wrapper(
            root, f"ocb-{OCB_VERSION}", ocb_wrapper_files(), env=env, progress=progress, verbose=verbose
        )
        _run_step(
            f"ocb-{OCB_VERSION}: go build builder",
            ["go", "build", "-ldflags", "-s -w", "-o", str(out_dir / "ocb"), f"{_CORE}/cmd/builder"],
            cwd=src,
            env={**env, "CGO_ENABLED": "0"},
            log=root / "logs" / f"ocb-{OCB_VERSION}-build.log",
            progress=progress,
            verbose=verbose,
        )

    _build_into(_ocb_bin_dir(root), ("ocb",), run_build)
    return target


def build_otelcol(
    cache_root: Path | None = None,
    progress: Callable[[str], None] = _print_progress,
    *,
    verbose: bool = False,
) -> Path:
    """Build the project's Collector distribution with ocb unless it already exists.

    ocb generates the distribution's Go sources under ``<cache>/src/<key>``, runs ``go mod tidy`` and
    ``go build`` there (with our GOMODCACHE/GOCACHE/GOTOOLCHAIN, which it passes through), and the
    binary is moved into ``<cache>/bin/<key>/`` only once it exists.
    """
    root = _resolve_root(cache_root)
    key = _otelcol_key()
    target = _otelcol_bin_dir(root) / OTELCOL_NAME
    if _is_executable(target):
        return target
    _require_go("the OpenTelemetry Collector")
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


def build_jaeger(
    cache_root: Path | None = None,
    progress: Callable[[str], None] = _print_progress,
    *,
    verbose: bool = False,
) -> Path:
    """Build Jaeger v2 (``cmd/jaeger``, memory storage and the query API) unless it already exists."""
    root = _resolve_root(cache_root)
    target = _jaeger_bin_dir(root) / "jaeger"
    if _is_executable(target):
        return target
    _require_go("Jaeger")
    env = go_environment(root)

    def run_build(out_dir: Path) -> None:
        src = _ensure_wrapper(
            root, f"jaeger-{JAEGER_VERSION}", jaeger_wrapper_files(), env=env, progress=progress, verbose=verbose
        )
        _run_step(
            f"jaeger-{JAEGER_VERSION}: go build cmd/jaeger",
            [
                "go",
                "build",
                "-trimpath",
                "-ldflags",
                "-s -w",
                "-o",
                str(out_dir / "jaeger"),
                "github.com/jaegertracing/jaeger/cmd/jaeger",
            ],
            cwd=src,
            env={**env, "CGO_ENABLED": "0"},
            log=root / "logs" / f"jaeger-{JAEGER_VERSION}-build.log",
            progress=progress,
            verbose=verbose,
        )

    _build_into(_jaeger_bin_dir(root), ("jaeger",), run_build)
    return target
