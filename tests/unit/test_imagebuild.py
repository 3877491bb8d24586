"""What the image build decides without building: which files the image depends on (its cache key),
the base's name from its recipe, the name inside an OCI archive; and the forwarder that lets a
node's pods reach loopback services. The build itself runs in tests/integration/test_node_chart.py."""

from __future__ import annotations

import io
import json
import socket
import tarfile
import threading
import time
from pathlib import Path

import pytest

from otel_dra.testbed.forward import Forwarder
from otel_dra.testbed.imagebuild import (
    DOCKERFILE,
    REPO_ROOT,
    ImageBuildError,
    archive_image_name,
    base_image_name,
    base_recipe,
    context_files,
    image_digest,
)


def test_the_repository_dockerfile_depends_on_the_package_and_its_metadata() -> None:
    files = {str(p.relative_to(REPO_ROOT)) for p in context_files()}
    assert {"requirements.lock", "pyproject.toml", "README.md", "otel_dra/cli/__init__.py"} <= files
    assert not any("__pycache__" in f for f in files)
    assert not any(f.startswith(("tests/", "deploy/", "bench/")) for f in files)
    assert DOCKERFILE.name == "Dockerfile"


def _context(tmp_path: Path) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("a = 1\n")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "req.txt").write_text("x==1\n")
    (tmp_path / "other.txt").write_text("not copied\n")
    (tmp_path / "Dockerfile").write_text(
        "ARG BASE=b\nFROM ${BASE} AS build\nCOPY req.txt ./\nCOPY --chown=1:1 pkg ./pkg\n"
        "FROM ${BASE}\nCOPY --from=build /opt /opt\n"
    )
    return tmp_path


def test_the_image_digest_follows_what_the_dockerfile_copies_and_nothing_else(tmp_path: Path) -> None:
    root = _context(tmp_path)
    dockerfile = root / "Dockerfile"
    assert [p.relative_to(root).as_posix() for p in context_files(dockerfile, root)] == ["req.txt", "pkg/a.py"]
    first = image_digest("base:1", dockerfile, root)
    (root / "other.txt").write_text("changed\n")
    (root / "pkg" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\1")
    assert image_digest("base:1", dockerfile, root) == first
    (root / "pkg" / "a.py").write_text("a = 2\n")
    second = image_digest("base:1", dockerfile, root)
    assert second != first
    assert image_digest("base:2", dockerfile, root) != second  # another base: another image
    dockerfile.write_text(dockerfile.read_text() + "USER 1\n")
    assert image_digest("base:1", dockerfile, root) != second


def test_a_dockerfile_copying_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM x\nCOPY nothere ./\n")
    with pytest.raises(ImageBuildError, match="COPY nothere: no such file"):
        context_files(tmp_path / "Dockerfile", tmp_path)


def test_the_base_name_carries_its_recipe_digest() -> None:
    name = base_image_name(base_recipe("http://deb.debian.org/debian"))
    assert name.startswith("localhost/otel-dra/base:bookworm-python3.11-")
    assert name == base_image_name(base_recipe("http://deb.debian.org/debian"))
    assert name != base_image_name(base_recipe("http://mirror.example/debian"))


def test_the_archive_names_its_image(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar"
    index = {"manifests": [{"annotations": {"org.opencontainers.image.ref.name": "localhost/x/y:1"}}]}
    with tarfile.open(archive, "w") as tar:
        data = json.dumps(index).encode()
        info = tarfile.TarInfo("index.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert archive_image_name(archive) == "localhost/x/y:1"
    with tarfile.open(archive, "w") as tar:
        data = b'{"manifests": [{}]}'
        info = tarfile.TarInfo("index.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ImageBuildError, match="names no image"):
        archive_image_name(archive)


def test_the_forwarder_passes_bytes_both_ways_and_half_closes() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def echo_upper() -> None:
        conn, _ = server.accept()
        with conn:
            data = b""
            while chunk := conn.recv(4096):  # until the client's half-close reaches us
                data += chunk
            received.append(data)
            conn.sendall(data.upper())

    thread = threading.Thread(target=echo_upper)
    thread.start()
    with Forwarder(("127.0.0.1", 0), server.getsockname()[:2]) as forwarder:
        with socket.create_connection(forwarder.address, timeout=10) as client:
            payload = b"x" * 200_000 + b"end"
            client.sendall(payload)
            client.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
        thread.join(timeout=10)
    server.close()
    assert received == [payload]
    assert answer == payload.upper()


def test_the_forwarder_stops_with_connections_open() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    forwarder = Forwarder(("127.0.0.1", 0), server.getsockname()[:2]).start()
    client = socket.create_connection(forwarder.address, timeout=10)
    upstream, _ = server.accept()
    forwarder.stop()  # must not hang on the idle connection
    assert client.recv(1) == b""
    client.close()
    upstream.close()
    server.close()


def test_the_forwarder_stops_while_a_connection_is_being_made() -> None:
    # The upstream connection exists (the server accepted it) a moment before the pipe registers
    # it; a stop() in that moment once left the pipe open and its thread waiting forever. Here the
    # moment lasts until stop() has begun.
    stopping = threading.Event()

    def connect(target: tuple[str, int]) -> socket.socket:
        upstream = socket.create_connection(target, timeout=5)
        stopping.wait(5)
        time.sleep(0.2)  # stop() has shut down what it found open by now
        return upstream

    with socket.create_server(("127.0.0.1", 0)) as server:
        forwarder = Forwarder(("127.0.0.1", 0), server.getsockname()[:2], connect).start()
        with socket.create_connection(forwarder.address, timeout=5) as client:
            upstream, _ = server.accept()
            stopping.set()
            forwarder.stop()
            assert client.recv(1) == b""
            assert upstream.recv(1) == b""
            upstream.close()


def test_testbed_image_wants_dir_and_node_together(capsys: pytest.CaptureFixture[str]) -> None:
    from otel_dra.cli import build_parser

    args = build_parser().parse_args(["testbed", "image", "--node", "n1"])
    assert args.func(args) == 1
    assert "--dir and --node go together" in capsys.readouterr().err
