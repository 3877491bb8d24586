"""The HTTP/1.1 connection engine: accepting, reading requests, limits and timeouts, threads.

It knows no route: a ``BaseHTTPRequestHandler`` class answers each request (the metrics app,
:mod:`otel_dra.telemetry.http`, gives it one). One selector thread accepts connections (TLS
handshakes included, certificates from :class:`~otel_dra.telemetry.webconfig.TLSContexts`) and
reads every open connection at once, so an idle or slow client costs a socket and a buffer, not a
thread; a complete request head goes to a bounded pool of worker threads, which answer it with the
handler on a blocking socket (the kernel's send timeout bounds a client that stops reading) and hand
the connection back for its next request. :class:`Limits` says what one client may take.

Request bodies are off by default (the metrics app takes none). With ``Limits.max_body_bytes`` a
request may carry a ``Content-Length`` body of at most that size: the selector thread receives it
whole, under the same deadline as the headers, before a worker sees the request (whose ``rfile``
then holds the head and the body), so a slow or stalled sender still costs no thread; the bodies
held at once (received, queued or served) are bounded in total too (``max_pending_body_bytes``).
"""

from __future__ import annotations

import collections
import contextlib
import io
import logging
import queue
import re
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from otel_dra.records import record
from otel_dra.telemetry.webconfig import TLSContexts

log = logging.getLogger(__name__)


# Buffers per sendmsg call (Linux IOV_MAX is 1024).
_IOV_BATCH = 512
# Over TLS (no sendmsg): bytes joined into one write.
_TLS_WRITE = 1 << 18


def send_buffers(sock: socket.socket, parts: list[bytes]) -> None:
    """Send buffers as they are (no copy of a body that is 100 MB at 10^5 claims) with few system
    calls. Each call releases and re-acquires the GIL; while a watch thread is busy, re-acquiring
    can wait up to the interpreter's switch interval, so one call per buffer (~1,300 at 10^5
    claims) made scrapes under churn several times slower than a few batched calls. A TLS socket
    has no sendmsg: buffers are joined into writes of about 256 KiB (encryption copies them anyway)."""
    if isinstance(sock, ssl.SSLSocket):
        _send_tls(sock, parts)
        return
    views = [memoryview(p) for p in parts if p]
    i = 0
    while i < len(views):
        batch = views[i : i + _IOV_BATCH]
        sent = sock.sendmsg(batch)
        for view in batch:
            if sent >= len(view):
                sent -= len(view)
                i += 1
            else:
                views[i] = view[sent:]  # partial send: resume inside this buffer
                break


def _send_tls(sock: ssl.SSLSocket, parts: list[bytes]) -> None:
    pending: list[bytes] = []
    size = 0
    for part in parts:
        if not part:
            continue
        pending.append(part)
        size += len(part)
        if size >= _TLS_WRITE:
            sock.sendall(pending[0] if len(pending) == 1 else b"".join(pending))
            pending, size = [], 0
    if pending:
        sock.sendall(b"".join(pending))


class SocketWriter(io.BufferedIOBase):
    """A handler's ``wfile``: each write goes to the socket at once with ``sendall`` (nothing is
    buffered, so nothing needs a flush). The stdlib's socketserver has the same class under a
    private name (``socketserver._SocketWriter``)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self._sock.sendall(b)
        with memoryview(b) as view:
            return view.nbytes

    def fileno(self) -> int:
        return self._sock.fileno()


class RequestHandler(BaseHTTPRequestHandler):
    """The base of the handlers this engine serves with: HTTP/1.1 (keep-alive), log lines at debug."""

    protocol_version = "HTTP/1.1"
    # Not HTTP/0.9 (the stdlib's default): an error such as a malformed request line's 400 then has
    # a status line and headers instead of an HTML body alone.
    default_request_version = "HTTP/1.0"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("http: " + format, *args)


@record(frozen=True)
class Limits:
    """What one client may take of the server. Requests are read by one thread that waits on every
    open connection at once (a selector), so a connection that is idle, or slow to send its request,
    costs a socket and a buffer, not a thread; only complete requests go to the worker threads.

    - ``max_connections``: open connections; beyond it new ones wait in the kernel's accept backlog
      (``backlog``) until one closes.
    - ``max_workers``: requests served at once (worker threads, started as needed); further complete
      requests wait in line for a worker.
    - ``max_requests_per_client``: requests from one client address served at once, of those the
      server's ``per_client`` says count (the metrics app: ``/metrics``; probes are never held); its
      further ones wait, in order, until one of its own is done. One client that opens many
      connections (a runaway script, a misconfigured scraper) then shares the CPU with the others
      as if it had only this many, instead of taking a share per connection: a full /metrics of a
      large cluster is tens of MB, and the copies are what the CPU spends most on.
    - ``header_timeout``: seconds from a request's first byte (a new connection's accept) to the end
      of its headers; a client that has not sent them by then is answered 408 and closed (slowloris).
    - ``idle_timeout``: seconds a keep-alive connection may wait for its next request.
    - ``write_timeout``: seconds a response's send may make no progress (a client that stops reading).
    - ``max_request_line`` (414), ``max_header_bytes`` (431): sizes, in bytes; a malformed request
      line or header is a 400.
    - ``max_body_bytes``: 0 (the default), requests carry no body: one that announces a body is
      answered by the handler with its body left unread, and its connection closed. Above 0, a
      ``Content-Length`` body of at most this many bytes is received by the selector with the head
      (``header_timeout`` then runs until the body's last byte) and handed to the worker with it; a
      larger one is 413, a chunked one (``Transfer-Encoding``) 411, a malformed or ambiguous length
      400, each answered at once and closed.
    - ``max_pending_body_bytes``: the bodies being received, waiting for a worker or being served,
      all connections together, by their announced lengths; a request whose body would go beyond is
      answered 503 and closed, so that many clients each sending a large body (slowly, or faster
      than the workers take them) cannot exhaust memory.
    """

    max_connections: int = 1024
    max_workers: int = 32
    max_requests_per_client: int = 1
    header_timeout: float = 10.0
    idle_timeout: float = 120.0
    write_timeout: float = 60.0
    max_request_line: int = 8192
    max_header_bytes: int = 65536
    backlog: int = 128
    max_body_bytes: int = 0
    max_pending_body_bytes: int = 32 << 20


# How often (seconds) the selector looks for connections past their deadline.
_SWEEP = 0.25
# Seconds a worker thread waits for a request before it ends (started again as needed): the threads
# a burst of requests started do not stay.
_WORKER_IDLE = 30.0

_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"

# A Content-Length value: digits only (no sign, no spaces inside), at most 18 of them (below 2^63).
_DIGITS = re.compile(rb"[0-9]{1,18}")


def body_length(head: bytes) -> int:
    """The length of the body that a request head announces: its ``Content-Length`` (0 when it has
    none); -411 for a ``Transfer-Encoding`` (not supported), -400 for a malformed length or two
    different ones (RFC 9112 6.3: a request smuggler's tools)."""
    length: int | None = None
    for line in head.split(b"\n")[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        name = name.strip().lower()
        if name == b"transfer-encoding":
            return -411
        if name != b"content-length":
            continue
        value = value.strip()
        if not _DIGITS.fullmatch(value):
            return -400
        if length is not None and int(value) != length:
            return -400
        length = int(value)
    return length or 0


def _client(conn: _Conn) -> str:
    """The client's address without its port (an IPv4 or IPv6 address tuple's first member)."""
    address = conn.address
    return str(address[0]) if isinstance(address, tuple) and address else str(address)


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class _Conn:
    """An open connection, owned by the selector thread while it waits for a request and by one
    worker while that request is served."""

    __slots__ = (
        "address",
        "buf",
        "counted",
        "deadline",
        "events",
        "expect",
        "handshaking",
        "reading",
        "reserved",
        "sock",
    )

    def __init__(self, sock: socket.socket, address: object, deadline: float, handshaking: bool) -> None:
        self.sock = sock
        self.address = address
        self.buf = bytearray()
        self.deadline = deadline
        self.handshaking = handshaking
        self.reading = False  # part of a request received: the header deadline runs
        self.events = 0
        self.counted = False  # its request counts against max_requests_per_client
        self.expect = 0  # bytes of head and body of the request being received (0: its head is not in)
        self.reserved = 0  # bytes of max_pending_body_bytes its body holds until its answer is sent


class HttpServer:
    """Accepts connections and reads requests on one selector thread (``serve_forever``), serves
    complete requests on a bounded pool of worker threads, and keeps every open connection in
    ``_connections`` so that stopping ends idle keep-alive connections (a scraper such as Prometheus
    keeps one open between scrapes) and waits for the workers instead of leaving threads behind.

    ``handler`` answers each request; ``tls`` makes it HTTPS (a handshake must end within
    ``handshake_timeout`` seconds); ``per_client(head)`` says whether a request (its head, request
    line and headers) counts against ``limits.max_requests_per_client`` (None: every request);
    ``name`` names the threads (``name``, then ``name-1``, ``name-2``... for the workers)."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        *,
        tls: TLSContexts | None = None,
        handshake_timeout: float = 10.0,
        limits: Limits | None = None,
        per_client: Callable[[bytes], object] | None = None,
        name: str = "http",
    ) -> None:
        self._handler = handler
        self._tls = tls
        self._handshake_timeout = handshake_timeout
        self._per_client = per_client
        self._name = name
        self.limits = limits or Limits()
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(self.limits.backlog)
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self._connections: dict[socket.socket, _Conn] = {}  # selector thread only (len() elsewhere)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._returned: collections.deque[tuple[_Conn, bool]] = collections.deque()
        self._jobs: queue.SimpleQueue[tuple[_Conn, bytes, int] | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._idle_workers = 0
        self._started = 0  # worker threads started so far (their names)
        self._workers_lock = threading.Lock()
        # Per client address (selector thread only): requests with a worker, and those waiting for
        # the client's own earlier ones (max_requests_per_client).
        self._in_flight: dict[str, int] = {}
        self._parked: dict[str, collections.deque[tuple[_Conn, bytes, int]]] = {}
        self._pending_body = 0  # bytes reserved by the bodies held now (selector thread only)
        self.parked = 0  # requests that waited for their client's earlier ones, in total
        self._accepting = False
        self._stopping = False
        self.timeouts = 0  # connections closed at a deadline (headers, idle, handshake)
        self._thread = threading.Thread(target=self.serve_forever, name=name, daemon=True)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def open_connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    def start(self) -> HttpServer:
        """Serve on a thread of its own (``name``)."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, end the idle connections, let responses being sent finish and wait (at
        most ``timeout`` seconds in total) for the server's threads."""
        self.shutdown()
        deadline = time.monotonic() + timeout
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        else:  # never started
            self._stopping = True
        for thread in self.workers():
            thread.join(max(0.0, deadline - time.monotonic()))
        self.server_close()

    # --- the selector thread ------------------------------------------------------------------------

    def serve_forever(self) -> None:
        sel = self._selector
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._accept_on()
        next_sweep = time.monotonic() + _SWEEP
        try:
            while not self._stopping:
                for key, _mask in sel.select(self._select_timeout(next_sweep)):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            while self._wake_r.recv(4096):
                                pass
                    else:
                        self._on_readable(key.data)
                while self._returned:
                    conn, keep = self._returned.popleft()
                    self._finished(conn)
                    self._take_back(conn, keep)
                now = time.monotonic()
                if now >= next_sweep:
                    next_sweep = now + _SWEEP
                    self._sweep(now)
        finally:
            for conn in [c for c in self._connections.values() if c.events]:
                self._close(conn)
            for waiting in self._parked.values():
                for conn, _, _ in waiting:
                    self._close(conn)
            self._parked.clear()
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(self.socket)
            self.socket.close()
            with self._workers_lock:
                for _ in self._workers:
                    self._jobs.put(None)

    def _accept_on(self) -> None:
        if not self._accepting:
            self._selector.register(self.socket, selectors.EVENT_READ, None)
            self._accepting = True

    def _accept_off(self) -> None:
        if self._accepting:
            self._selector.unregister(self.socket)
            self._accepting = False

    def _accept(self) -> None:
        limits = self.limits
        while len(self._connections) < limits.max_connections:
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: wait for the next sweep
                log.warning("http: cannot accept a connection: %s", exc)
                self._accept_off()
                return
            # The headers and the body go out in separate writes; with Nagle's algorithm the body of
            # a small response waits for the client's delayed ACK of the headers: ~40 ms per scrape
            # of a small /metrics (the plugin's), 0.4 ms without.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # The write timeout is the kernel's (SO_SNDTIMEO on a blocking socket), not Python's: with
            # a Python timeout the socket is non-blocking underneath, and a large body goes out in
            # one sendmsg and one GIL re-acquisition per socket buffer's worth instead of one per
            # batch (see send_buffers), each re-acquisition up to the switch interval under load.
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(limits.write_timeout))
            sock.setblocking(False)
            now = time.monotonic()
            tls = self._tls
            if tls is not None:
                try:
                    sock = tls.current().wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                except (OSError, ValueError) as exc:
                    log.debug("http: TLS setup for %s failed: %s", address, exc)
                    sock.close()
                    continue
                conn = _Conn(sock, address, now + self._handshake_timeout, True)
            else:
                conn = _Conn(sock, address, now + limits.header_timeout, False)
                conn.reading = True  # a new connection is there to send a request
            self._connections[sock] = conn
            self._watch(conn, selectors.EVENT_READ)
        # At the limit: the others wait in the kernel's backlog until a connection closes.
        self._accept_off()

    def _watch(self, conn: _Conn, events: int) -> None:
        if conn.events == events:
            return
        if conn.events:
            self._selector.modify(conn.sock, events, conn)
        else:
            self._selector.register(conn.sock, events, conn)
        conn.events = events

    def _unwatch(self, conn: _Conn) -> None:
        if conn.events:
            self._selector.unregister(conn.sock)
            conn.events = 0

    def _release(self, conn: _Conn) -> None:
        self._pending_body -= conn.reserved
        conn.reserved = conn.expect = 0

    def _close(self, conn: _Conn) -> None:
        self._release(conn)
        self._unwatch(conn)
        with contextlib.suppress(OSError):
            conn.sock.close()
        self._connections.pop(conn.sock, None)
        if not self._stopping and len(self._connections) < self.limits.max_connections:
            self._accept_on()

    def _on_readable(self, conn: _Conn) -> None:
        sock = conn.sock
        try:
            if conn.handshaking:
                sock.do_handshake()  # type: ignore[attr-defined]
                conn.handshaking = False
                conn.reading = True
                conn.deadline = time.monotonic() + self.limits.header_timeout
                self._watch(conn, selectors.EVENT_READ)
            while True:
                data = sock.recv(65536)
                if not data:
                    self._close(conn)
                    return
                if not conn.reading:  # the first byte of a keep-alive connection's next request
                    conn.reading = True
                    conn.deadline = time.monotonic() + self.limits.header_timeout
                conn.buf += data
                if not isinstance(sock, ssl.SSLSocket) or not sock.pending():
                    break
        except ssl.SSLWantReadError:
            self._watch(conn, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._watch(conn, selectors.EVENT_WRITE)
        except BlockingIOError:
            pass
        except (OSError, ValueError) as exc:  # a client that does not trust us, speaks plain HTTP, resets
            log.debug("http: connection from %s ended: %s", conn.address, exc)
            self._close(conn)
            return
        self._parse(conn)

    def _parse(self, conn: _Conn) -> None:
        """Hand a complete request head to a worker, or refuse one that is too large."""
        limits, buf = self.limits, conn.buf
        if conn.expect:  # its head is in; waiting for the rest of its body
            if len(buf) >= conn.expect:
                self._complete(conn)
            return
        while buf and buf[0] in b"\r\n":  # empty lines before a request are ignored (RFC 9112 2.2)
            del buf[:1]
        if not buf:
            return
        line_end = buf.find(b"\n", 0, limits.max_request_line + 1)
        if line_end < 0:
            if len(buf) > limits.max_request_line:
                self._dispatch(conn, b"", 414)
            return
        ends = [i for i in (buf.find(b"\n\r\n", line_end), buf.find(b"\n\n", line_end)) if i >= 0]
        if not ends:
            if len(buf) - line_end - 1 > limits.max_header_bytes:
                self._dispatch(conn, b"", 431)
            return
        end = min(ends)
        end += 3 if buf[end + 1 : end + 2] == b"\r" else 2
        if end - line_end - 1 > limits.max_header_bytes:
            self._dispatch(conn, b"", 431)
            return
        if limits.max_body_bytes > 0:
            length = body_length(bytes(buf[:end]))
            if length < 0:
                self._dispatch(conn, b"", -length)
                return
            if length > limits.max_body_bytes:
                self._dispatch(conn, b"", 413)
                return
            if length:
                if self._pending_body + length > limits.max_pending_body_bytes:
                    log.debug("http: %s: the bodies held are at their limit; 503", conn.address)
                    self._dispatch(conn, b"", 503)
                    return
                conn.reserved = length
                self._pending_body += length
            conn.expect = end + length
            if len(buf) >= conn.expect:
                self._complete(conn)
            return
        head = bytes(buf[:end])
        del buf[:end]
        self._dispatch(conn, head, 0)

    def _complete(self, conn: _Conn) -> None:
        """The head and the body of ``conn``'s request are in: to a worker, together. The body's
        bytes stay reserved until the worker is done with it (queued bodies count too)."""
        request = bytes(conn.buf[: conn.expect])
        del conn.buf[: conn.expect]
        conn.expect = 0
        self._dispatch(conn, request, 0)

    def _dispatch(self, conn: _Conn, head: bytes, error: int) -> None:
        self._unwatch(conn)
        if error or (self._per_client is not None and not self._per_client(head)):
            # Only the requests per_client names are limited per client: for the metrics app, a
            # probe of /healthz or /readyz (the kubelet's, from the node's address) must not wait
            # behind a long scrape from the same address.
            self._to_worker(conn, head, error)
            return
        conn.counted = True
        client = _client(conn)
        running = self._in_flight.get(client, 0)
        if running >= self.limits.max_requests_per_client:
            self._parked.setdefault(client, collections.deque()).append((conn, head, error))
            self.parked += 1
            return
        self._in_flight[client] = running + 1
        self._to_worker(conn, head, error)

    def _finished(self, conn: _Conn) -> None:
        """A worker is done with ``conn``'s request: its client's next waiting request may go."""
        if not conn.counted:
            return
        conn.counted = False
        client = _client(conn)
        waiting = self._parked.get(client)
        if waiting:
            self._to_worker(*waiting.popleft())  # the client's count stays: one ended, one starts
            if not waiting:
                del self._parked[client]
            return
        running = self._in_flight.get(client, 0) - 1
        if running > 0:
            self._in_flight[client] = running
        else:
            self._in_flight.pop(client, None)

    def _to_worker(self, conn: _Conn, head: bytes, error: int) -> None:
        with self._workers_lock:
            if self._idle_workers <= 0 and len(self._workers) < self.limits.max_workers:
                self._started += 1
                thread = threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True)
                self._workers.append(thread)
                self._idle_workers += 1
                thread.start()
            self._idle_workers -= 1
        self._jobs.put((conn, head, error))

    def _take_back(self, conn: _Conn, keep: bool) -> None:
        self._release(conn)
        if not keep or self._stopping:
            self._close(conn)
            return
        try:
            conn.sock.setblocking(False)
        except OSError:
            self._close(conn)
            return
        conn.reading = bool(conn.buf)
        conn.deadline = time.monotonic() + (self.limits.header_timeout if conn.reading else self.limits.idle_timeout)
        self._watch(conn, selectors.EVENT_READ)
        if conn.buf:
            self._parse(conn)  # a pipelined request, already received
        elif isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():
            self._on_readable(conn)

    def _select_timeout(self, next_sweep: float) -> float | None:
        """How long the selector may sleep: until the next sweep while a connection has a deadline
        or accepting is paused, for ever otherwise (woken by a connection, a worker or stop). An
        idle server then costs nothing: sweeping four times a second was a third of the example
        plugin's CPU between calls."""
        if self._accepting and not any(c.events for c in self._connections.values()):
            return None
        return max(0.0, next_sweep - time.monotonic())

    def _sweep(self, now: float) -> None:
        if not self._accepting and len(self._connections) < self.limits.max_connections:
            self._accept_on()
        for conn in [c for c in self._connections.values() if c.events and c.deadline <= now]:
            self.timeouts += 1
            if conn.reading and not conn.handshaking:
                log.debug("http: %s did not send its request headers in time", conn.address)
                with contextlib.suppress(OSError, ValueError):
                    conn.sock.send(_TIMEOUT_RESPONSE)
            else:
                log.debug("http: closing %s connection from %s", "TLS" if conn.handshaking else "idle", conn.address)
            self._close(conn)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full: it is awake already
            self._wake_w.send(b"\0")

    # --- worker threads -------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_WORKER_IDLE)
            except queue.Empty:
                with self._workers_lock:
                    # More idle workers than requests waiting: this one is not needed.
                    if self._idle_workers > 0:
                        self._idle_workers -= 1
                        self._workers.remove(threading.current_thread())
                        return
                continue
            if job is None:
                return
            conn, head, error = job
            keep = False
            try:
                keep = self._serve(conn, head, error)
            finally:
                with self._workers_lock:
                    self._idle_workers += 1
                self._returned.append((conn, keep))
                self._wake()

    def _serve(self, conn: _Conn, head: bytes, error: int) -> bool:
        """Answer one request; whether the connection may carry another."""
        sock = conn.sock
        handler = self._handler.__new__(self._handler)
        handler.request = handler.connection = sock
        handler.client_address = conn.address  # type: ignore[assignment]
        handler.server = self  # type: ignore[assignment]
        handler.rfile = io.BytesIO(head)
        handler.wfile = SocketWriter(sock)
        handler.close_connection = True
        try:
            sock.setblocking(True)  # a send that makes no progress for write_timeout fails (SO_SNDTIMEO)
            if error:
                handler.requestline, handler.request_version, handler.command = "", "", ""
                handler.send_error(error)
            else:
                handler.handle_one_request()
        except Exception as exc:
            self.handle_error(exc, conn.address)
            return False
        # Without max_body_bytes a request body is left unread: it would be read as the next request.
        # With it, the body was received whole with the head (and a chunked one refused).
        headers = getattr(handler, "headers", None)
        if (
            not self.limits.max_body_bytes
            and headers is not None
            and (headers.get("Content-Length", "0").strip() != "0" or "Transfer-Encoding" in headers)
        ):
            return False
        return not handler.close_connection

    def handle_error(self, exc: BaseException, client_address: object) -> None:
        # A client that goes away mid-request (or a TLS peer that drops the connection without a
        # close_notify) is routine; anything else is a bug worth a traceback.
        if isinstance(exc, OSError):
            log.debug("http: connection from %s ended: %s", client_address, exc)
        else:
            log.warning("http: error serving %s", client_address, exc_info=exc)

    # --- stopping -------------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop accepting and reading: the selector thread closes every connection waiting for a
        request and tells the workers to end once they have sent what they are sending."""
        self._stopping = True
        self._wake()

    def workers(self) -> list[threading.Thread]:
        with self._workers_lock:
            return list(self._workers)

    def server_close(self) -> None:
        """After the threads: close what is left (connections handed back too late, the wake pair)."""
        while self._returned:
            conn, _ = self._returned.popleft()
            with contextlib.suppress(OSError):
                conn.sock.close()
            self._connections.pop(conn.sock, None)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        with contextlib.suppress(OSError):
            self.socket.close()
