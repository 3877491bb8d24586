"""``otel-dra testbed build|up|down``: the local control plane from the command line."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from otel_dra.cli.flags import add_flag
from otel_dra.testbed.build import BuildError, build, refresh_releases
from otel_dra.testbed.controlplane import TestbedError, down, up
from otel_dra.testbed.releases import (
    KUBERNETES_RELEASES,
    KUBERNETES_VERSION_ENV,
    KubernetesRelease,
    ci_minors,
    default_release,
    kubernetes_release,
    newest_release,
    releases,
)


def kubernetes_version(text: str) -> KubernetesRelease:
    """argparse type: a supported Kubernetes minor ("1.37") or version ("v1.37.2")."""
    try:
        return kubernetes_release(text)
    except BuildError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_kubernetes_version_flag(parser: argparse.ArgumentParser) -> None:
    """``--kubernetes-version``: which release the local control plane is built from and runs."""
    add_flag(
        parser,
        "--kubernetes-version",
        KUBERNETES_VERSION_ENV,
        f"Kubernetes minor or version of the local control plane: "
        f"{', '.join(r.minor for r in KUBERNETES_RELEASES)} (default: the newest generally available "
        f"release served, now {default_release().minor}; see `otel-dra testbed releases`)",
        default=None,
        type=kubernetes_version,
        metavar="VERSION",
    )


def add_parser(subparsers: Any) -> None:
    """Add the ``testbed`` command group to the top-level ``otel-dra`` parser."""
    testbed = subparsers.add_parser(
        "testbed",
        help="a real local Kubernetes control plane (etcd + kube-apiserver) for the demo and tests",
        description="Build and run etcd, kube-apiserver and optionally kube-scheduler and "
        "kube-controller-manager on loopback ports, with all state under one directory.",
    )
    commands = testbed.add_subparsers(dest="testbed_command", required=True)
    for add in (_add_build, _add_up, _add_image, _add_releases, _add_down):
        add(commands)


def _add_build(commands: Any) -> None:
    p_build = commands.add_parser(
        "build",
        help="build etcd, Kubernetes and the other peers from Go modules (slow the first time)",
        description="Builds into version-keyed directories under the cache (default $OTEL_DRA_CACHE, "
        "else ~/.cache/otel-dra) and skips binaries that already exist. Needs the go tool.",
    )
    p_build.add_argument("--cache", type=Path, default=None, help="cache directory (default: %(default)s)")
    p_build.add_argument("-v", "--verbose", action="store_true", help="show go's output as it happens")
    p_build.add_argument("--helm", action="store_true", help="also build helm (for the chart tests)")
    p_build.add_argument(
        "--otelcol",
        action="store_true",
        help="also build the OpenTelemetry Collector distribution with the Collector Builder (e2e tests)",
    )
    p_build.add_argument("--jaeger", action="store_true", help="also build Jaeger v2 (trace e2e tests)")
    p_build.add_argument(
        "--node",
        action="store_true",
        help="also build containerd and make the node's pause and busybox images (`testbed up --node`; "
        "the kubelet is always built with the control plane)",
    )
    p_build.add_argument("--all", action="store_true", help="build every peer (--helm --otelcol --jaeger --node)")
    add_kubernetes_version_flag(p_build)
    p_build.set_defaults(func=cmd_build)


def _add_up(commands: Any) -> None:
    p_up = commands.add_parser(
        "up",
        help="start a control plane and return once it is ready",
        description="Writes DIR/kubeconfig (admin), DIR/state.json and DIR/logs/. The processes keep "
        "running after this command returns; stop them with `otel-dra testbed down --dir DIR`.",
    )
    p_up.add_argument("--dir", type=Path, required=True, help="directory for the testbed's state")
    p_up.add_argument("--scheduler", action="store_true", help="also run kube-scheduler (DRA allocation)")
    p_up.add_argument(
        "--controller-manager",
        action="store_true",
        help="also run kube-controller-manager (ResourceClaimTemplate -> ResourceClaim only)",
    )
    p_up.add_argument(
        "--node",
        metavar="NAME",
        help="also run a real node: containerd and the kubelet, registered as Node NAME, with their state "
        "under DIR (implies --scheduler and --controller-manager; needs root, `testbed build --node`, "
        "and Debian's runc and containernetworking-plugins)",
    )
    p_up.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds to wait for each component (default: %(default)s)",
    )
    p_up.add_argument(
        "--feature-gates",
        type=feature_gates,
        default={},
        metavar="A=true,B=false",
        help="feature gates for every component, on top of those the release's row turns on (docs/testbed.md); "
        "a gate the release removed is refused. E.g. GenericWorkload=true,DRAWorkloadResourceClaims=true "
        "(PodGroups on 1.38, with --runtime-config scheduling.k8s.io/v1beta1=true)",
    )
    p_up.add_argument(
        "--runtime-config",
        action="append",
        default=[],
        metavar="GROUP/VERSION=true",
        help="API group versions kube-apiserver serves beyond its defaults (repeatable)",
    )
    add_kubernetes_version_flag(p_up)
    p_up.set_defaults(func=cmd_up)


def _add_image(commands: Any) -> None:
    p_image = commands.add_parser(
        "image",
        help="build the project's image from the Dockerfile with buildah, on a local Debian base, and "
        "optionally load it into a running testbed node",
        description="No registry is needed: the Dockerfile's BASE is a Debian minbase with Python 3.11 made "
        "with debootstrap (cached under the cache directory by a digest of its recipe), the build runs "
        "`buildah bud` (vfs storage under the cache, chroot isolation; its pip step needs PyPI), and the "
        "result is an OCI archive under <cache>/images, rebuilt only when the Dockerfile or a file it "
        "copies changed. Needs root and Debian's buildah and debootstrap. Prints the image name and the "
        "archive.",
    )
    p_image.add_argument("--cache", type=Path, default=None, help="cache directory (default: ~/.cache/otel-dra)")
    p_image.add_argument("--dir", type=Path, help="a testbed directory whose node gets the image (with --node)")
    p_image.add_argument("--node", metavar="NAME", help="load the image into this testbed node's containerd")
    p_image.add_argument("--force", action="store_true", help="build even when an archive of the same inputs exists")
    p_image.set_defaults(func=cmd_image)


def _add_releases(commands: Any) -> None:
    p_releases = commands.add_parser(
        "releases",
        help="the Kubernetes releases the testbed builds, the default, and the CI matrix",
        description="Prints the release table with each tracking row at the version the module proxy last "
        "served (kept under the cache by `testbed build` and by --refresh). --default, --newest and --ci "
        "print one line for scripts (.ci/run, the Makefile).",
    )
    p_releases.add_argument("--refresh", action="store_true", help="ask the module proxy for new releases first")
    shown = p_releases.add_mutually_exclusive_group()
    shown.add_argument("--default", action="store_true", help="print the default minor only")
    shown.add_argument("--newest", action="store_true", help="print the newest minor served (pre-releases too)")
    shown.add_argument(
        "--ci",
        action="store_true",
        help="print the minors CI tests besides the default: the oldest, and the newest "
        "while it is newer than the default",
    )
    shown.add_argument("--minors", action="store_true", help="print every minor")
    p_releases.set_defaults(func=cmd_releases)


def _add_down(commands: Any) -> None:
    p_down = commands.add_parser(
        "down",
        help="stop the control plane started in DIR (keeps logs, deletes etcd data)",
    )
    p_down.add_argument("--dir", type=Path, required=True, help="directory given to `testbed up`")
    p_down.set_defaults(func=cmd_down)


def feature_gates(text: str) -> dict[str, bool]:
    """argparse type: ``A=true,B=false`` as kube-apiserver's --feature-gates takes it."""
    gates: dict[str, bool] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        if not sep or not name or value.lower() not in ("true", "false"):
            raise argparse.ArgumentTypeError(f"{item!r} is not NAME=true or NAME=false")
        gates[name] = value.lower() == "true"
    return gates


def _error(message: str) -> int:
    print(f"otel-dra testbed: error: {message}", file=sys.stderr)
    return 1


def _release_after_refresh(chosen: KubernetesRelease | None) -> KubernetesRelease:
    """Ask the module proxy for new releases, then the release to build: a tracking minor at what is
    served now, a pinned version as given, and no choice the default as it is now."""
    refresh_releases()
    if chosen is None:
        return kubernetes_release()
    return kubernetes_release(chosen.minor) if chosen.tracks else chosen


def cmd_build(args: argparse.Namespace) -> int:
    from otel_dra.testbed.build import build_helm, build_jaeger, build_node, build_otelcol

    extras: list[Path] = []
    started = time.monotonic()
    try:
        release = _release_after_refresh(args.kubernetes_version)
        binaries = build(args.cache, verbose=args.verbose, version=release)
        if args.helm or args.all:
            extras.append(build_helm(args.cache, verbose=args.verbose))
        if args.otelcol or args.all:
            extras.append(build_otelcol(args.cache, verbose=args.verbose))
        if args.jaeger or args.all:
            extras.append(build_jaeger(args.cache, verbose=args.verbose))
        if args.node or args.all:
            extras.extend(build_node(args.cache, verbose=args.verbose))
    except BuildError as exc:
        return _error(str(exc))
    for path in (*binaries.all(), *extras):
        print(path)
    print(f"peers ready in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from otel_dra.testbed.build import find_binaries
    from otel_dra.testbed.node import check_node, start_node

    started = time.monotonic()
    if args.node:
        # Before the control plane starts: a machine that cannot run a node fails at once.
        try:
            check_node(args.dir, args.node, find_binaries(version=args.kubernetes_version).kubelet)
        except (BuildError, TestbedError) as exc:
            return _error(str(exc))
    try:
        testbed = up(
            args.dir,
            scheduler=args.scheduler or bool(args.node),
            controller_manager=args.controller_manager or bool(args.node),
            # The node's pods (the Helm chart's) get ServiceAccount tokens, and their Deployments and
            # DaemonSets controllers.
            service_accounts=bool(args.node),
            timeout=args.timeout,
            kubernetes_version=args.kubernetes_version,
            feature_gates={**kubernetes_release(args.kubernetes_version).feature_gates, **args.feature_gates},
            apiserver_args=[f"--runtime-config={value}" for value in args.runtime_config],
        )
    except (BuildError, TestbedError) as exc:
        return _error(str(exc))
    if args.node:
        try:
            start_node(testbed, args.node, timeout=args.timeout)
        except (BuildError, TestbedError) as exc:
            try:
                testbed.down()
            except TestbedError as down_exc:
                return _error(f"{exc}\nand stopping the testbed again: {down_exc}")
            return _error(str(exc))
    print(f"testbed ready in {time.monotonic() - started:.1f}s: {testbed.server}", file=sys.stderr)
    for name, pid in testbed.pids.items():
        print(f"  {name}: pid {pid}, log {testbed.dir / 'logs' / f'{name}.log'}", file=sys.stderr)
    if args.node:
        from otel_dra.testbed.node import node_of, pod_api_server

        node = node_of(testbed, args.node)
        api_host, api_port = pod_api_server(testbed, args.node)
        print(
            f"  node {node.name}: a DRA plugin takes --kubelet-plugins-directory-path={node.plugins_dir} "
            f"--kubelet-registrar-directory-path={node.registry_dir} --cdi-root={node.cdi_dir}; "
            f"pod logs under {node.pod_logs}; pods reach the API server with "
            f"KUBERNETES_SERVICE_HOST={api_host} KUBERNETES_SERVICE_PORT={api_port} (no kube-proxy)",
            file=sys.stderr,
        )
    print(f"stop it with: otel-dra testbed down --dir {testbed.dir}", file=sys.stderr)
    # stdout carries only what scripts need: `export $(otel-dra testbed up --dir d)`.
    print(f"KUBECONFIG={testbed.kubeconfig}")
    return 0


def cmd_image(args: argparse.Namespace) -> int:
    from otel_dra.testbed.imagebuild import ImageBuildError, build_image

    if bool(args.dir) != bool(args.node):
        return _error("--dir and --node go together (the testbed node to load the image into)")
    started = time.monotonic()
    try:
        image = build_image(args.cache, force=args.force)
    except (BuildError, ImageBuildError) as exc:
        return _error(str(exc))
    steps = ", ".join(f"{step} {seconds:.0f}s" for step, seconds in image.seconds.items()) or "cached"
    print(f"image {image.name} ({steps}): {image.archive}", file=sys.stderr)
    if args.node:
        from otel_dra.testbed.controlplane import Testbed
        from otel_dra.testbed.node import load_image

        try:
            name = load_image(Testbed.load(args.dir), args.node, image.archive, image_name=image.name)
        except TestbedError as exc:
            return _error(str(exc))
        print(
            f"loaded into node {args.node}: pods use image {name} with imagePullPolicy Never or IfNotPresent "
            f"(helm: --set image.repository={image.repository} --set image.tag={image.tag})",
            file=sys.stderr,
        )
    print(f"done in {time.monotonic() - started:.0f}s", file=sys.stderr)
    print(f"IMAGE={image.name}")
    print(f"ARCHIVE={image.archive}")
    return 0


def cmd_releases(args: argparse.Namespace) -> int:
    if args.refresh:
        refresh_releases()
    default, newest = default_release(), newest_release()
    if args.default:
        print(default.minor)
    elif args.newest:
        print(newest.minor)
    elif args.ci:
        print(" ".join(ci_minors()))
    elif args.minors:
        print(" ".join(r.minor for r in releases()))
    else:
        for r in releases():
            marks = [
                m
                for m, on in (
                    ("default", r.minor == default.minor),
                    ("newest", r.minor == newest.minor),
                    ("pre-release", r.prerelease),
                )
                if on
            ]
            go = f", Go {r.go.removeprefix('go')}" if r.go else ""
            print(f"{r.minor}\t{r.version}\tetcd {r.etcd}{go}\t{', '.join(marks)}".rstrip())
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        down(args.dir)
    except TestbedError as exc:
        return _error(str(exc))
    print(f"testbed in {args.dir.resolve()} stopped in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return 0
