"""A TCP forwarder from an address the node's pods can reach to a loopback service of the host.

The testbed's API server (and, in tests, the Collector) listen on 127.0.0.1 only, and pods have no
route to the host's loopback: what a pod reaches is the node bridge's own address
(:data:`otel_dra.testbed.node.BRIDGE_ADDRESS`). There is no kube-proxy either, so the
``kubernetes`` Service's cluster IP leads nowhere. ``start_node`` runs one of these per node, as a
testbed component, from ``BRIDGE_ADDRESS:<port>`` to the API server; pods are pointed at it with
``KUBERNETES_SERVICE_HOST``/``KUBERNETES_SERVICE_PORT`` (the serving certificate names the
address). Bytes pass through unchanged (TLS included).

The bridge appears only with the first pod sandbox, so the listening socket binds with
``IP_FREEBIND``: it accepts as soon as the address exists, and nothing else on the host can reach it
(the address is on the bridge alone; no route leads there from outside the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import selectors
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence

IP_FREEBIND = getattr(socket, "IP_FREEBIND", 15)  # Linux; Python's socket module lacks it before 3.12
_CHUNK = 65536


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def listen(address: tuple[str, int]) -> socket.socket:
    """A listening socket on ``address``, which need not exist on the host yet."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_IP, IP_FREEBIND, 1)
    sock.bind(address)
    sock.listen(128)
    return sock


def _copy_both_ways(client: socket.socket, upstream: socket.socket) -> None:
    with client, upstream, selectors.DefaultSelector() as selector:
        selector.register(client, selectors.EVENT_READ, upstream)
        selector.register(upstream, selectors.EVENT_READ, client)
        open_ends = 2
        while open_ends:
            for key, _ in selector.select():
                source: socket.socket = key.fileobj  # type: ignore[assignment]
                sink: socket.socket = key.data
                try:
                    data = source.recv(_CHUNK)
                except OSError:
                    data = b""
                if data:
                    try:
                        sink.sendall(data)
                    except OSError:
                        return
                    continue
                # One side finished: pass the half-close on, keep the other direction going.
                selector.unregister(source)
                open_ends -= 1
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)


def _connect(target: tuple[str, int]) -> socket.socket:
    return socket.create_connection(target, timeout=10)


class Forwarder:
    """Accepts on ``listen_address`` and pipes each connection to ``target``, a thread each, until
    :meth:`stop` (for tests, which run it in-process); ``connect`` opens the upstream connection."""

    def __init__(
        self,
        listen_address: tuple[str, int],
        target: tuple[str, int],
        connect: Callable[[tuple[str, int]], socket.socket] = _connect,
    ) -> None:
        self.target = target
        self._connect = connect
        self._sock = listen(listen_address)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"forward-{self.address[1]}", daemon=True)
        self._pipes: list[threading.Thread] = []
        # Both ends of every open connection: stop() shuts them down, which ends their threads. The
        # lock orders a pipe's registration against stop(): a connection that registers after stop
        # has shut the others down would otherwise be left open, its thread waiting forever.
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> Forwarder:
        self._thread.start()
        return self

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._pipe, args=(client,), daemon=True, name="forward-pipe")
            thread.start()
            self._pipes = [t for t in self._pipes if t.is_alive()] + [thread]

    def _pipe(self, client: socket.socket) -> None:
        try:
            upstream = self._connect(self.target)
        except OSError:
            client.close()
            return
        upstream.settimeout(None)
        with self._lock:
            if self._stopped.is_set():  # stop() came while this connection was being made
                client.close()
                upstream.close()
                return
            self._open.update((client, upstream))
        try:
            _copy_both_ways(client, upstream)
        finally:
            with self._lock:
                self._open.difference_update((client, upstream))

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        for thread in self._pipes:
            thread.join(timeout=5)

    def __enter__(self) -> Forwarder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m otel_dra.testbed.forward", description=__doc__)
    parser.add_argument("--listen", type=_address, required=True, help="HOST:PORT to accept on")
    parser.add_argument("--connect", type=_address, required=True, help="HOST:PORT to forward to")
    args = parser.parse_args(argv)
    try:
        forwarder = Forwarder(args.listen, args.connect).start()
    except OSError as exc:
        print(f"forward: cannot listen on {args.listen[0]}:{args.listen[1]}: {exc}", file=sys.stderr)
        return 1
    print(f"forwarding {args.listen[0]}:{args.listen[1]} -> {args.connect[0]}:{args.connect[1]}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    forwarder.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
