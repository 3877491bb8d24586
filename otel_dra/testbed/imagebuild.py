"""The project's container image, built here from the repository's Dockerfile, without a daemon or a
registry, for the testbed node (``otel-dra testbed image``).

No registry can be reached from these machines, so the Dockerfile's base (``ARG BASE``, by default
``python:3.11-slim-bookworm``) cannot be pulled. A local base takes its place: a Debian root
filesystem made with ``debootstrap --variant=minbase`` holding Debian's ``python3`` and
``python3-venv`` (bookworm: Python 3.11, the default base's minor), committed into buildah's storage
as ``localhost/otel-dra/base:...``. Its name carries a digest of its recipe (suite, packages,
mirror), so a machine that already made it skips the step (about a minute, most of it downloading
the packages), and a changed recipe makes a new base beside the old one.

Debian's ``buildah`` (rootful, ``--storage-driver vfs --isolation chroot``: no overlay-in-overlay,
no user namespaces, no daemon) then runs the Dockerfile with ``BASE`` pointing at that base. The
``RUN pip install`` step needs PyPI, as a user's ``docker build`` does. The result is written as an
OCI archive (``buildah push ... oci-archive:``), which ``ctr images import`` loads into the node's
containerd (:func:`otel_dra.testbed.node.load_image`). The archive is named after a digest of the
base and of every file the Dockerfile copies from the build context, so an unchanged tree is not
built again.

buildah's storage lives under the cache (``<cache>/buildah``), never in /var/lib/containers; the
image itself is removed from that storage once archived (vfs keeps every image as a full copy), so
it holds the base alone between builds; the newest few archives are kept (checkouts share the
cache), and one build runs at a time per cache (a lock file beside the storage). Nothing stays
mounted: every buildah working container is removed, and whatever debootstrap or buildah left
mounted under the cache is unmounted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from otel_dra.testbed.build import resolve_cache_root

Progress = Callable[[str], None]

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO_ROOT / "Dockerfile"
# The Dockerfile's default base is python:3.11-slim-bookworm: the local base must give the same
# Python minor on the same Debian release.
DEBIAN_SUITE = "bookworm"
PYTHON_MINOR = "3.11"
BASE_PACKAGES = ("python3", "python3-venv")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
MIRROR_ENV = "OTEL_DRA_DEBIAN_MIRROR"
# Bumped when the way the base is made changes in a way the other recipe fields do not show.
_BASE_RECIPE_VERSION = 1
BASE_REPOSITORY = "localhost/otel-dra/base"
# `localhost/`: the name can never mean a registry's image (the node's images use it too).
IMAGE_REPOSITORY = "localhost/otel-dra/otel-dra"
BUILDAH = "buildah"
DEBOOTSTRAP = "debootstrap"


class ImageBuildError(RuntimeError):
    """The image could not be built (a tool missing, debootstrap or buildah failed)."""


@dataclass(frozen=True)
class BuiltImage:
    """An image archive ready for ``ctr images import``."""

    name: str  # repository:tag, as pods refer to it
    archive: Path  # OCI archive (index.json carries the name as org.opencontainers.image.ref.name)
    base: str  # the base image it was built FROM
    # What each step took, in seconds; a step that was skipped (cached) is absent.
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def repository(self) -> str:
        return self.name.rpartition(":")[0]

    @property
    def tag(self) -> str:
        return self.name.rpartition(":")[2]


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _version() -> str:
    from otel_dra import __version__

    return __version__


def check_tools() -> None:
    """A clear error naming the Debian packages when buildah or debootstrap is missing."""
    absent = [tool for tool in (BUILDAH, DEBOOTSTRAP) if shutil.which(tool) is None]
    if absent:
        raise ImageBuildError(
            f"building the image here needs {' and '.join(absent)}: `apt-get install {' '.join(absent)}` "
            "(Debian's packages; `make peers` / .ci/run install them)"
        )
    if os.geteuid() != 0:
        raise ImageBuildError(
            f"building the image here needs root (euid {os.geteuid()}): debootstrap chroots and buildah's "
            "vfs storage keeps the image's files with their owners"
        )


def mirror() -> str:
    return os.environ.get(MIRROR_ENV, DEFAULT_MIRROR)


def base_recipe(mirror_url: str | None = None) -> dict[str, object]:
    return {
        "suite": DEBIAN_SUITE,
        "variant": "minbase",
        "packages": list(BASE_PACKAGES),
        "mirror": mirror_url or mirror(),
        "python": PYTHON_MINOR,
        "recipe": _BASE_RECIPE_VERSION,
    }


def base_image_name(recipe: dict[str, object] | None = None) -> str:
    digest = hashlib.sha256(json.dumps(recipe or base_recipe(), sort_keys=True).encode()).hexdigest()[:12]
    return f"{BASE_REPOSITORY}:{DEBIAN_SUITE}-python{PYTHON_MINOR}-{digest}"


def context_files(dockerfile: Path = DOCKERFILE, root: Path = REPO_ROOT) -> list[Path]:
    """Every file the Dockerfile copies from the build context (``COPY``/``ADD`` without
    ``--from``), directories expanded, bytecode caches left out: what the image depends on."""
    sources: list[Path] = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] not in (["COPY"], ["ADD"]) or any(w.startswith("--from") for w in words):
            continue
        for source in (w for w in words[1:-1] if not w.startswith("--")):
            path = root / source
            if path.is_dir():
                sources.extend(p for p in sorted(path.rglob("*")) if p.is_file() and "__pycache__" not in p.parts)
            elif path.is_file():
                sources.append(path)
            else:
                raise ImageBuildError(f"{dockerfile}: COPY {source}: no such file in {root}")
    return sources


def image_digest(base: str, dockerfile: Path = DOCKERFILE, root: Path = REPO_ROOT) -> str:
    """A digest of what the build reads: the base's name, the Dockerfile and the copied files."""
    digest = hashlib.sha256()
    digest.update(base.encode() + b"\0")
    for path in (dockerfile, *context_files(dockerfile, root)):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


# --- running the tools ------------------------------------------------------------------------------


class _Buildah:
    """buildah with its storage under the cache: vfs (works inside any filesystem, no overlay
    mounts), its run state beside it."""

    def __init__(self, cache_root: Path) -> None:
        self.root = cache_root / "buildah"
        self.argv = [
            BUILDAH,
            f"--root={self.root / 'storage'}",
            f"--runroot={self.root / 'run'}",
            "--storage-driver=vfs",
        ]

    def run(self, *args: str, check: bool = True, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([*self.argv, *args], capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            output = _tail(result.stderr + result.stdout)
            raise ImageBuildError(f"buildah {' '.join(args[:2])} failed (exit {result.returncode}):\n{output}")
        return result

    def has_image(self, name: str) -> bool:
        return self.run("inspect", "--type=image", name, check=False).returncode == 0

    def clean(self) -> None:
        """No working container (a failed build's) and nothing mounted is left behind."""
        self.run("rm", "--all", check=False)
        self.run("umount", "--all", check=False)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _mounts_under(top: Path) -> list[str]:
    prefix = str(top).rstrip("/") + "/"
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
        if point == str(top) or point.startswith(prefix):
            points.append(point)
    return points


def mounts_left(cache_root: Path | None = None) -> list[str]:
    """Mount points under the image build's directories (a check that a build left none)."""
    root = resolve_cache_root(cache_root)
    return [*_mounts_under(root / "buildah"), *_mounts_under(root / "imagebuild")]


def _unmount_all(top: Path) -> None:
    for point in sorted(_mounts_under(top), key=lambda p: p.count("/"), reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)


def _run(argv: Sequence[str], what: str, *, timeout: float = 1800, log: Path | None = None) -> None:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if log is not None:
        log.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise ImageBuildError(f"{what} failed (exit {result.returncode}):\n{_tail(result.stderr + result.stdout)}")


# --- the base ---------------------------------------------------------------------------------------


# Archives of other trees are kept (several checkouts share the cache), up to this many.
KEEP_ARCHIVES = 3


@contextlib.contextmanager
def _build_lock(root: Path, progress: Progress) -> Iterator[None]:
    """One image build at a time per cache: checkouts share buildah's storage, and a build removes
    the working containers it leaves (``buildah rm --all``), which would cut another one short."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / "imagebuild.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"image: waiting for another image build in {root} to finish")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_base(cache_root: Path | None = None, progress: Progress = _to_stderr) -> tuple[str, float | None]:
    """The local base image's name, made unless buildah's storage has it; and the seconds making
    it took (None: it was there)."""
    check_tools()
    root = resolve_cache_root(cache_root)
    with _build_lock(root, progress):
        return _build_base(root, progress)


def _build_base(root: Path, progress: Progress) -> tuple[str, float | None]:
    buildah = _Buildah(root)
    recipe = base_recipe()
    name = base_image_name(recipe)
    if buildah.has_image(name):
        return name, None
    started = time.monotonic()
    work = root / "imagebuild" / name.rpartition(":")[2]
    rootfs = work / "rootfs"
    _unmount_all(work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    progress(
        f"image: making the local base {name}: debootstrap --variant=minbase {DEBIAN_SUITE} "
        f"with {', '.join(BASE_PACKAGES)} from {recipe['mirror']} (about a minute)"
    )
    try:
        _run(
            [
                DEBOOTSTRAP,
                "--variant=minbase",
                f"--include={','.join(BASE_PACKAGES)}",
                DEBIAN_SUITE,
                str(rootfs),
                str(recipe["mirror"]),
            ],
            "debootstrap",
            log=work / "debootstrap.log",
        )
        _check_python(rootfs)
        # What an image does not need: the downloaded packages and the package lists (apt would
        # fetch fresh ones), as the python:*-slim images leave them out.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / junk).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tarball = work / "rootfs.tar"
        _run(["tar", "--numeric-owner", "--xattrs", "-C", str(rootfs), "-cf", str(tarball), "."], "tar of the base")
        container = buildah.run("from", "scratch").stdout.strip()
        try:
            buildah.run("add", container, str(tarball), "/")
            buildah.run(
                "config",
                "--os=linux",
                "--arch=amd64",
                "--env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "--env=LANG=C.UTF-8",
                "--cmd=python3",
                f"--label=org.opencontainers.image.description=Debian {DEBIAN_SUITE} minbase with "
                f"{' '.join(BASE_PACKAGES)} (otel-dra's local base)",
                container,
            )
            buildah.run("commit", "--rm", container, name)
        finally:
            buildah.clean()
    finally:
        _unmount_all(work)
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - started
    progress(f"image: base {name} made in {seconds:.0f}s")
    return name, seconds


def _check_python(rootfs: Path) -> None:
    """The base must carry the Python minor the Dockerfile's default base has."""
    result = subprocess.run(
        ["chroot", str(rootfs), "python3", "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
    )
    found = result.stdout.strip()
    if result.returncode != 0 or found != PYTHON_MINOR:
        raise ImageBuildError(
            f"the base's python3 is {found or 'unusable'} ({result.stderr.strip()}), the Dockerfile's default "
            f"base has Python {PYTHON_MINOR}"
        )


# --- the image --------------------------------------------------------------------------------------


def build_image(
    cache_root: Path | None = None,
    *,
    progress: Progress = _to_stderr,
    dockerfile: Path = DOCKERFILE,
    context: Path = REPO_ROOT,
    force: bool = False,
) -> BuiltImage:
    """The project's image as an OCI archive under ``<cache>/images/``: the local base (made when
    missing), then ``buildah bud`` of ``dockerfile``; skipped when an archive of the same inputs
    exists (``force``: build anyway)."""
    check_tools()
    root = resolve_cache_root(cache_root)
    with _build_lock(root, progress):
        return _build_image(root, progress, dockerfile, context, force)


def _build_image(root: Path, progress: Progress, dockerfile: Path, context: Path, force: bool) -> BuiltImage:
    base, base_seconds = _build_base(root, progress)
    seconds: dict[str, float] = {} if base_seconds is None else {"base": base_seconds}
    digest = image_digest(base, dockerfile, context)
    name = f"{IMAGE_REPOSITORY}:{_version()}"
    archive = root / "images" / f"otel-dra-{digest}.oci.tar"
    if archive.is_file() and not force:
        return BuiltImage(name, archive, base, seconds)
    buildah = _Buildah(root)
    started = time.monotonic()
    progress(f"image: buildah bud {dockerfile.name} FROM {base} (pip installs from PyPI)")
    try:
        buildah.run(
            "bud",
            "--isolation=chroot",
            "--pull=never",  # the base is local; nothing may be fetched from a registry
            *_pip_trust(root),
            f"--build-arg=BASE={base}",
            f"--build-arg=VERSION={_version()}",
            f"--file={dockerfile}",
            f"--tag={name}",
            str(context),
        )
        seconds["build"] = time.monotonic() - started
        archive.parent.mkdir(parents=True, exist_ok=True)
        partial = archive.with_name(archive.name + ".tmp")
        partial.unlink(missing_ok=True)
        pushed = time.monotonic()
        # The ref name inside the archive is the full name: ctr import --base-name keeps it.
        buildah.run("push", name, f"oci-archive:{partial}:{name}")
        partial.rename(archive)
        seconds["archive"] = time.monotonic() - pushed
        archives = sorted(archive.parent.glob("otel-dra-*.oci.tar"), key=lambda a: a.stat().st_mtime, reverse=True)
        for old in archives[KEEP_ARCHIVES:]:
            old.unlink(missing_ok=True)
    finally:
        # The archive is what is used; a full vfs copy of the image in the storage is not.
        buildah.run("rmi", "--force", name, check=False)
        buildah.clean()
        _unmount_all(buildah.root)
    progress(f"image: {name} built in {seconds['build']:.0f}s, archived in {seconds['archive']:.1f}s: {archive}")
    return BuiltImage(name, archive, base, seconds)


# Where the RUN steps find the host's CA bundle and the pip configuration naming it.
_BUILD_CA = "/etc/ssl/certs/otel-dra-build-host-ca.crt"
_BUILD_PIP_CONF = "/etc/pip.conf"


def host_ca_bundle() -> Path | None:
    """The CA bundle the host's own pip trusts (PIP_CERT, else SSL_CERT_FILE, else Debian's)."""
    for candidate in (
        os.environ.get("PIP_CERT"),
        os.environ.get("SSL_CERT_FILE"),
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def _pip_trust(cache_root: Path) -> list[str]:
    """``buildah bud --volume`` options that let the RUN steps' pip trust what the host's pip
    trusts and use its index: behind a TLS-intercepting egress proxy (its CA is in the host's store,
    not in pip's bundled certifi) PyPI is otherwise unreachable from the build. Bind mounts are not
    part of any layer, and the final stage has no RUN step, so nothing of this reaches the image."""
    bundle = host_ca_bundle()
    if bundle is None:
        return []
    lines = ["[global]", f"cert = {_BUILD_CA}"]
    for env, key in (("PIP_INDEX_URL", "index-url"), ("PIP_EXTRA_INDEX_URL", "extra-index-url")):
        if os.environ.get(env):
            lines.append(f"{key} = {os.environ[env]}")
    conf = cache_root / "imagebuild" / "pip.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("\n".join(lines) + "\n")
    return [f"--volume={bundle.resolve()}:{_BUILD_CA}:ro", f"--volume={conf}:{_BUILD_PIP_CONF}:ro"]


def archive_image_name(archive: Path) -> str:
    """The name an OCI archive's index.json gives its image (what ``ctr images import`` names it)."""
    import tarfile

    with tarfile.open(archive) as tar:
        member = tar.extractfile("index.json")
        if member is None:
            raise ImageBuildError(f"{archive}: no index.json (not an OCI archive)")
        index = json.load(member)
    names: Iterable[str] = (
        m.get("annotations", {}).get("org.opencontainers.image.ref.name", "") for m in index.get("manifests", [])
    )
    found = [n for n in names if n]
    if not found:
        raise ImageBuildError(f"{archive}: its index.json names no image")
    return found[0]


__all__ = [
    "BuiltImage",
    "ImageBuildError",
    "base_image_name",
    "build_base",
    "build_image",
    "check_tools",
    "context_files",
    "image_digest",
    "mounts_left",
]
