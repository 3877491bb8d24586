"""The testbed's releases in one table: every Kubernetes minor it builds and runs, and the versions
of its other peers.

Everything that names a Kubernetes version reads it from here: the ``--kubernetes-version`` choices
and default, the control plane's and the kubelet's feature gates, the CI matrix (``otel-dra testbed
releases --ci``, which ``.ci/run`` and the Makefile call), and the version table in docs/testbed.md
(checked by tests/unit/test_docs.py). Adding a release is one row of :data:`KUBERNETES_RELEASES`.

A row is either pinned (``version`` is what is built) or it *tracks* its minor: then ``version`` is
only the floor, and the newest release of that minor the Go module proxy serves, pre-releases
included (``v1.38.0-beta.0`` today, ``-rc.N`` and ``v1.38.0`` as they appear), is built instead.
What the proxy last answered is kept in ``<cache>/releases.json`` by ``otel-dra testbed build`` and
``otel-dra testbed releases --refresh`` (the only two that ask the proxy), so that every later
command, test and benchmark names the same build without a network round trip.

The default release is the newest row whose (resolved) version is generally available: it becomes
1.38 by this table alone on the day the proxy serves ``v1.38.0``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from otel_dra.testbed.errors import ReleaseError

# --- versions ------------------------------------------------------------------------------------

_VERSION = re.compile(r"v?(\d+(?:\.\d+)*)(?:-(alpha|beta|rc)\.(\d+))?")
# Pre-releases sort before the release they lead to: alpha < beta < rc < the release itself.
_STAGES = {"alpha": 0, "beta": 1, "rc": 2, None: 3}


def version_key(text: str) -> tuple[int, ...]:
    """ "1.35", "v1.37.2", "v1.38.0-beta.0" or a Go version "1.26" as a tuple that compares as
    versions do (a pre-release before its release: v1.38.0-rc.1 < v1.38.0)."""
    match = _VERSION.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    numbers = tuple(int(part) for part in match.group(1).split("."))
    if len(numbers) < 3:  # a minor or a Go version: compares by its numbers alone
        return numbers
    return (*numbers, _STAGES[match.group(2)], int(match.group(3) or 0))


def is_prerelease(version: str) -> bool:
    return "-" in version


def minor_of(version: str) -> str:
    return ".".join(version.strip().removeprefix("v").split(".")[:2])


# --- the other peers ----------------------------------------------------------------------------

HELM_VERSION = "v3.21.4"
# The node's container runtime (``testbed up --node``): a current 2.x release, which has CDI on by
# default (Debian's containerd 1.6 has none).
CONTAINERD_VERSION = "v2.4.2"
# The Collector Builder (ocb) release and the component releases it assembles. Every component must
# come from one Collector release: core v0.165.0 pairs with the stable core modules v1.71.0 and with
# contrib v0.165.1. contrib's k8sattributesprocessor is versioned 1.x since it went stable (see
# build.OTELCOL_REPLACES for why it is one release behind).
OCB_VERSION = "v0.165.0"
OTELCOL_CORE_VERSION = "v0.165.0"
OTELCOL_STABLE_VERSION = "v1.71.0"
OTELCOL_CONTRIB_VERSION = "v0.165.1"
K8SATTRIBUTES_VERSION = "v1.3.1"
# Jaeger v2 (a Collector distribution itself): tag v1.76.0 carries the v2.13.0 code.
JAEGER_VERSION = "v1.76.0"
# The upstream example driver's kubelet plugin: bench.plugin's side-by-side peer, never a CI peer.
UPSTREAM_DRIVER_VERSION = "v0.4.0"
# The ServiceMonitor/PodMonitor/PrometheusRule CRDs of the chart tests.
PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
# The Go the machines have; a release that needs a newer one names its toolchain (``go`` below).
MACHINE_GO = "1.26"


# --- Kubernetes --------------------------------------------------------------------------------

# k8s.io/kubernetes requires its staging modules at v0.0.0 and relies on replace lines in its own
# go.mod, which do not apply to a module that depends on it; the wrapper must replace each of them
# with the published v0.<minor>.<patch> release matching the Kubernetes version. The build checks
# a row's list against the release's own go.mod (see build.check_staging).
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
# 1.36 added two staging modules, 1.38 two more.
_STAGING_SINCE_1_36 = tuple(sorted((*KUBERNETES_STAGING_MODULES, "cri-streaming", "streaming")))
_STAGING_SINCE_1_38 = tuple(sorted((*_STAGING_SINCE_1_36, "apiextensions-api", "ktesting")))

# Alpha (1.34-1.35) DRA features whose fields the exporter reads: without them the API server drops
# the fields (and may then reject the object, e.g. a slice without `perDeviceNodeSelection`). The
# exporter must handle every v1 shape, so the testbed turns them on where they are off by default:
# - DRAPartitionableDevices: perDeviceNodeSelection, sharedCounters, consumesCounters;
# - DRADeviceTaints: device taints in slices, DeviceTaintRule (served only with the row's
#   taint_rule_api; the scheduler then watches DeviceTaintRules, see controlplane.up);
# - DRAConsumableCapacity: allowMultipleAllocations, requestPolicy, consumedCapacity, shareID;
# - DRADeviceBindingConditions: status.allocation.allocationTimestamp (set by the scheduler);
# - DRAExtendedResource: DeviceClass spec.extendedResourceName.
DEFAULT_FEATURE_GATES: Mapping[str, bool] = {
    "DRAPartitionableDevices": True,
    "DRADeviceTaints": True,
    "DRAConsumableCapacity": True,
    "DRADeviceBindingConditions": True,
    "DRAExtendedResource": True,
}
# The alpha API version that serves DeviceTaintRules in Kubernetes 1.34 and 1.35.
DEVICE_TAINT_RULE_API = "resource.k8s.io/v1alpha3"
# 1.38 removed these gates: naming one on any component fails its start ("unrecognized feature gate").
_REMOVED_IN_1_38 = ("DynamicResourceAllocation", "KubeletTracing")
# The module path that 1.38's kubelet imports and the module proxy refuses; the testbed builds the
# kubelet with the stand-in under otel_dra/testbed/standins/ instead (see its package comment).
IPTABLES_WRAPPERS = "sigs.k8s.io/iptables-wrappers"


@dataclass(frozen=True)
class KubernetesRelease:
    """A Kubernetes minor the testbed can build and run.

    - ``version``: what is built; for a row that ``tracks`` its minor, the floor until the module
      proxy has been asked (see the module docstring).
    - ``etcd``: the etcd it is tested with (``hack/lib/etcd.sh`` of its tree, at the newest patch of
      that etcd line); ``godebug`` and ``staging``: what of its own go.mod the wrapper module repeats.
    - ``go``: the Go toolchain its go.mod needs when the machines' (:data:`MACHINE_GO`) is older,
      fetched by the go command (``GOTOOLCHAIN``); "" when the machines' Go builds it.
    - ``feature_gates``: what every component gets (only gates off by default in that minor: a GA
      gate locked on is refused when set to false and warned about when set at all);
      ``removed_gates``: gates the release no longer knows, which nothing may name.
    - ``taint_rule_api``: the API version that serves DeviceTaintRules where it must be enabled with
      ``--runtime-config`` (None: served by default); with ``taint_rule_gate`` on, kube-scheduler
      waits for a DeviceTaintRule informer to sync, which never happens unless the API server
      serves them.
    - ``standins``: module paths the release imports that the proxy refuses, built from
      otel_dra/testbed/standins/<last path element> instead.
    """

    version: str
    etcd: str
    godebug: str
    staging: tuple[str, ...]
    feature_gates: Mapping[str, bool] = field(default_factory=dict)
    taint_rule_api: str | None = None
    taint_rule_gate: str = ""
    removed_gates: tuple[str, ...] = ()
    go: str = ""
    tracks: bool = False
    standins: tuple[str, ...] = ()

    @property
    def minor(self) -> str:
        return minor_of(self.version)

    @property
    def prerelease(self) -> bool:
        return is_prerelease(self.version)

    @property
    def served_taint_rule_api(self) -> str:
        """The API version DeviceTaintRules are created in on this minor's testbed."""
        return self.taint_rule_api or "resource.k8s.io/v1"

    def gate_errors(self, gates: Mapping[str, bool]) -> list[str]:
        """Why ``gates`` cannot be given to this release's components (empty: they can)."""
        return [
            f"feature gate {name} was removed in Kubernetes {self.minor} (its components refuse to start with it)"
            for name in gates
            if name in self.removed_gates
        ]


# Supported: 1.34 up to the newest release the module proxy serves. A new minor is one row. Gate
# states per minor are those of pkg/features/kube_features.go of each release.
KUBERNETES_RELEASES: tuple[KubernetesRelease, ...] = (
    KubernetesRelease(
        "v1.34.4", etcd="v3.6.16", godebug="default=go1.24", staging=KUBERNETES_STAGING_MODULES,
        feature_gates=DEFAULT_FEATURE_GATES, taint_rule_api=DEVICE_TAINT_RULE_API, taint_rule_gate="DRADeviceTaints",
    ),
    # 1.35 split DRADeviceTaintRules (alpha) out of DRADeviceTaints.
    KubernetesRelease(
        "v1.35.4", etcd="v3.6.16", godebug="default=go1.25", staging=KUBERNETES_STAGING_MODULES,
        feature_gates={**DEFAULT_FEATURE_GATES, "DRADeviceTaintRules": True},
        taint_rule_api=DEVICE_TAINT_RULE_API, taint_rule_gate="DRADeviceTaintRules",
    ),
    # 1.36: the other DRA gates are beta and on; DeviceTaintRules are beta, off, served by v1beta2.
    # DRAListTypeAttributes (alpha): list-typed device attributes (bools, ints, strings, versions).
    KubernetesRelease(
        "v1.36.3", etcd="v3.6.16", godebug="default=go1.26", staging=_STAGING_SINCE_1_36,
        feature_gates={"DRADeviceTaintRules": True, "DRAListTypeAttributes": True},
        taint_rule_api="resource.k8s.io/v1beta2", taint_rule_gate="DRADeviceTaintRules",
    ),
    # 1.37: device taints and DeviceTaintRules are GA (v1), the rest beta and on. Alpha:
    # DRAListTypeAttributes, and DRAOptionalNodeOperations (skipNodeOperations on slices and
    # allocation results).
    KubernetesRelease(
        "v1.37.2", etcd="v3.7.3", godebug="default=go1.26", staging=_STAGING_SINCE_1_36,
        feature_gates={"DRAListTypeAttributes": True, "DRAOptionalNodeOperations": True},
    ),
    # 1.38: consumable capacity, fractional capacity ranges and binding conditions GA, partitionable
    # devices locked on; DynamicResourceAllocation and KubeletTracing removed; no new DRA gate. The
    # alpha gates are 1.37's. Needs Go 1.27; tracks the newest served 1.38 (beta.0 today).
    KubernetesRelease(
        "v1.38.0-beta.0", etcd="v3.7.3", godebug="default=go1.27", staging=_STAGING_SINCE_1_38,
        feature_gates={"DRAListTypeAttributes": True, "DRAOptionalNodeOperations": True},
        removed_gates=_REMOVED_IN_1_38, go="go1.27.3", tracks=True, standins=(IPTABLES_WRAPPERS,),
    ),
)  # fmt: skip

# What `testbed build|up`, the demo, the sandbox, the benchmarks and the tests use unless told
# otherwise (a flag, or this environment variable): "1.37", "v1.37" or "v1.37.2".
KUBERNETES_VERSION_ENV = "OTEL_DRA_KUBERNETES_VERSION"
# Where `testbed build` and `testbed releases --refresh` keep what the module proxy last answered.
RESOLVED_FILE = "releases.json"


def default_cache_root() -> Path:
    """``$OTEL_DRA_CACHE``, else ``~/.cache/otel-dra``: shared by every checkout on the machine."""
    env = os.environ.get("OTEL_DRA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "otel-dra"


def read_resolved(root: Path | None = None) -> dict[str, str]:
    """minor -> version, as the module proxy last answered for the tracking rows (may be empty)."""
    path = (root or default_cache_root().resolve()) / RESOLVED_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    versions = data.get("versions") if isinstance(data, dict) else None
    if not isinstance(versions, dict):
        return {}
    return {str(k): str(v) for k, v in versions.items() if _VERSION.fullmatch(str(v))}


def write_resolved(versions: Mapping[str, str], root: Path | None = None) -> None:
    path = (root or default_cache_root().resolve()) / RESOLVED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"versions": dict(sorted(versions.items()))}, indent=1) + "\n")
    tmp.replace(path)


def newest_of_minor(row: KubernetesRelease, served: list[str]) -> str:
    """The row's version once the proxy listed ``served``: the newest of its minor (pre-releases
    included) for a tracking row, never older than the row's floor; the row's own for a pinned one."""
    if not row.tracks:
        return row.version
    candidates = [v for v in served if _VERSION.fullmatch(v) and minor_of(v) == row.minor]
    return max((row.version, *candidates), key=version_key)


def releases(root: Path | None = None) -> tuple[KubernetesRelease, ...]:
    """The table with each tracking row at the version last resolved (its floor before that)."""
    resolved = read_resolved(root)
    return tuple(
        dataclasses.replace(row, version=newest_of_minor(row, [resolved[row.minor]]))
        if row.tracks and row.minor in resolved
        else row
        for row in KUBERNETES_RELEASES
    )


def default_release(root: Path | None = None) -> KubernetesRelease:
    """The newest generally available release: a tracking row becomes the default by the table
    alone once its minor's GA release is served."""
    return max((r for r in releases(root) if not r.prerelease), key=lambda r: version_key(r.version))


def newest_release(root: Path | None = None) -> KubernetesRelease:
    """The newest release served, pre-releases included."""
    return max(releases(root), key=lambda r: version_key(r.version))


def kubernetes_release(spec: str | KubernetesRelease | None = None) -> KubernetesRelease:
    """The release for ``spec`` (a minor such as "1.37", or a full version "v1.37.2"); None: the
    environment's OTEL_DRA_KUBERNETES_VERSION, else :func:`default_release`."""
    if isinstance(spec, KubernetesRelease):
        return spec
    text = (spec if spec is not None else os.environ.get(KUBERNETES_VERSION_ENV) or "").strip()
    table = releases()
    if not text:
        return default_release()
    wanted = text.removeprefix("v")
    for release in table:
        if wanted in (release.minor, release.version.removeprefix("v")):
            return release
    served = ", ".join(release.minor for release in table)
    source = f"{KUBERNETES_VERSION_ENV}={text!r}" if spec is None else repr(text)
    raise ReleaseError(f"Kubernetes version {source} is not one the testbed builds (one of {served}, or their patch)")


def ci_minors(root: Path | None = None) -> tuple[str, ...]:
    """The minors CI runs the integration tests on besides the default: the oldest, and the newest
    served while it is newer than the default (a pre-release included)."""
    table = releases(root)
    default, newest = default_release(root), newest_release(root)
    chosen = [table[0].minor]
    if newest.minor != default.minor and newest.minor not in chosen:
        chosen.append(newest.minor)
    return tuple(chosen)


def release_table(root: Path | None = None) -> str:
    """The releases as the Markdown table of docs/testbed.md (checked there by a test), with the
    tracking rows at their floor: what the docs promise, not what this machine last resolved."""
    lines = [
        "| Kubernetes | built | etcd | Go | gates the testbed turns on | gates removed |",
        "|---|---|---|---|---|---|",
    ]
    default = max((r for r in KUBERNETES_RELEASES if not r.prerelease), key=lambda r: version_key(r.version))
    for row in KUBERNETES_RELEASES:
        built = f"newest served {row.minor}.x, at least {row.version}" if row.tracks else row.version
        if row is default:
            built += " (default)"
        gates = ", ".join(sorted(row.feature_gates)) or "none"
        removed = ", ".join(row.removed_gates) or "none"
        go = row.go.removeprefix("go") if row.go else MACHINE_GO
        lines.append(f"| {row.minor} | {built} | {row.etcd} | {go} | {gates} | {removed} |")
    return "\n".join(lines) + "\n"


# What each peer is for, for the docs' table (docs/testbed.md, "Peer versions"), in `make peers` order.
_PEERS_DOC = (
    ("helm", HELM_VERSION, "the chart tests (`testbed build --helm`)"),
    ("OpenTelemetry Collector Builder (ocb)", OCB_VERSION, "builds the Collector distribution"),
    (
        "OpenTelemetry Collector: core / stable modules / contrib",
        f"{OTELCOL_CORE_VERSION} / {OTELCOL_STABLE_VERSION} / {OTELCOL_CONTRIB_VERSION}",
        "the e2e tests and `collector-config/` (`--otelcol`)",
    ),
    ("Jaeger v2", JAEGER_VERSION, "the trace e2e tests (`--jaeger`)"),
    ("containerd", CONTAINERD_VERSION, "the real node (`--node`)"),
    ("prometheus-operator CRDs", PROMETHEUS_OPERATOR_VERSION, "the chart tests"),
    ("dra-example-driver", UPSTREAM_DRIVER_VERSION, "bench.plugin's side-by-side peer only"),
)


def peer_table() -> str:
    """The other peers' versions as the Markdown table of docs/testbed.md (checked there by a test)."""
    lines = ["| peer | version | for |", "|---|---|---|"]
    lines += [f"| {name} | {version} | {what} |" for name, version, what in _PEERS_DOC]
    return "\n".join(lines) + "\n"
