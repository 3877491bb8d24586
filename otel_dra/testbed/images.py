"""The node's container images, made here: no registry can be reached from these machines, so
nothing a testbed node runs may need a pull.

Both images are one layer holding Debian's statically linked busybox (``busybox-static``) and its
applet links, packed as OCI image-layout tarballs (``oci-layout``, ``index.json``, ``blobs/``) that
``ctr images import`` loads. The pause image is the same layer with an entrypoint that sleeps
until it is signalled. Every timestamp, owner and mode in the tarballs is fixed, so the same
busybox gives the same image digests on every machine and run.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# The name under which Debian's busybox-static installs the binary.
BUSYBOX = Path("/bin/busybox")
# The applets the images link; tests run `sh -c '...'` with these.
APPLETS = ("sh", "sleep", "env", "cat", "echo", "ls", "true", "false", "grep", "mkdir", "id", "wc", "sort")
# The names pods (and containerd's sandbox_image) use; `localhost/` keeps them from ever meaning a
# real registry's image.
PAUSE_IMAGE = "localhost/otel-dra/pause:1"
BUSYBOX_IMAGE = "localhost/otel-dra/busybox:1"
# PID 1 of a pod sandbox: it only has to hold the namespaces. A shell with a trap, because a PID 1
# without a handler ignores SIGTERM and would only go on SIGKILL.
_PAUSE_ENTRYPOINT = ("/bin/sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done")
_MTIME = 0  # the epoch: reproducible layers


class ImageError(RuntimeError):
    """An image could not be made (busybox-static missing)."""


@dataclass(frozen=True)
class Image:
    name: str
    tarball: Path


def _blob(data: bytes) -> tuple[str, bytes]:
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def busybox_layer(busybox: Path = BUSYBOX) -> bytes:
    """An uncompressed layer tar: /bin/busybox, its applet links, and the mount points runc uses."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(info: tarfile.TarInfo, content: bytes | None = None) -> None:
            info.mtime, info.uid, info.gid, info.uname, info.gname = _MTIME, 0, 0, "", ""
            tar.addfile(info, io.BytesIO(content) if content is not None else None)

        for directory in ("bin", "dev", "etc", "proc", "sys", "tmp"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            add(info)
        content = busybox.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(content), 0o755
        add(info, content)
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type, info.linkname, info.mode = tarfile.SYMTYPE, "busybox", 0o777
            add(info)
        passwd = b"root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size, info.mode = len(passwd), 0o644
        add(info, passwd)
    return buffer.getvalue()


def oci_archive(name: str, layer: bytes, *, entrypoint: Sequence[str] = (), cmd: Sequence[str] = ()) -> bytes:
    """An OCI image-layout tarball of a one-layer linux/amd64 image named ``name``."""
    layer_digest, _ = _blob(layer)
    config: dict[str, object] = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},  # uncompressed: digest == diff id
    }
    image_config: dict[str, object] = config["config"]  # type: ignore[assignment]
    if entrypoint:
        image_config["Entrypoint"] = list(entrypoint)
    if cmd:
        image_config["Cmd"] = list(cmd)
    config_digest, config_bytes = _blob(json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": len(layer)}],
    }
    manifest_digest, manifest_bytes = _blob(json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                # ctr names the imported image after this annotation.
                "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name},
            }
        ],
    }
    files: Mapping[str, bytes] = {
        "oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
        "index.json": json.dumps(index, sort_keys=True).encode(),
        **{
            f"blobs/sha256/{digest.removeprefix('sha256:')}": data
            for digest, data in (
                (layer_digest, layer),
                (config_digest, config_bytes),
                (manifest_digest, manifest_bytes),
            )
        },
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, _MTIME
            tar.addfile(info)
        for path, data in files.items():
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), 0o644, _MTIME
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _file_name(image: str) -> str:
    return image.removeprefix("localhost/").replace("/", "_").replace(":", "-") + ".tar"


def node_images(cache_root: Path, busybox: Path = BUSYBOX) -> tuple[Image, Image]:
    """The pause and busybox image tarballs under ``<cache>/images/``, made (in well under a
    second) unless present; a busybox of other content makes new tarballs beside the old ones."""
    if not busybox.is_file():
        raise ImageError(
            f"{busybox} is missing: install Debian's busybox-static (`apt-get install busybox-static`), "
            "the testbed node's images are made from it"
        )
    if b"ld-linux" in busybox.read_bytes()[:4096]:  # the ELF interpreter: a dynamic binary
        raise ImageError(
            f"{busybox} is dynamically linked (Debian's `busybox`): the images hold no libc, install "
            "`busybox-static` instead"
        )
    layer = busybox_layer(busybox)
    out_dir = cache_root / "images" / hashlib.sha256(layer).hexdigest()[:12]
    made = []
    for name, entrypoint, cmd in ((PAUSE_IMAGE, _PAUSE_ENTRYPOINT, ()), (BUSYBOX_IMAGE, (), ("/bin/sh",))):
        path = out_dir / _file_name(name)
        if not path.is_file():
            out_dir.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(oci_archive(name, layer, entrypoint=entrypoint, cmd=cmd))
            tmp.rename(path)
        made.append(Image(name, path))
    return made[0], made[1]
