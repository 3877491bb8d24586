"""List + watch of one resource into a handler, with the behaviour client-go's reflector has.

- The initial list asks for ``resourceVersion=0`` (a relist: not older than the last version seen),
  which the API server answers from its watch cache, all at once whatever ``limit`` says; the
  answer is streamed (:mod:`otel_dra.kube.liststream`): each item goes to the handler as its bytes
  arrive, and the whole list is never held. A server that paginates anyway (``limit``/``continue``)
  is followed page by page, the next page asked for while this one is decoded. Items are raw JSON,
  or, for a resource with an item decoder (``ResourceType.protobuf``), asked for as protobuf (much
  less to produce, send and decode when little of each object is kept; JSON again if the server
  answers JSON or a protobuf page cannot be decoded). Watches are JSON.
- The watch asks for bookmarks and resumes from the last resourceVersion it saw.
- ``410 Gone`` (as an HTTP answer or a watch ERROR event) means our resourceVersion is too old:
  we relist.
- Errors back off exponentially with full jitter, capped, and reset after success. An answer with
  ``Retry-After`` (429 from priority and fairness or max-in-flight, 503) is waited for at least as
  long as it asks (up to ``MAX_RETRY_AFTER``), so a throttled exporter never comes back sooner than
  the API server said.

Sync state, which gates ``/metrics``: the cache is *synced* once a list has completed, and stays
synced while the watch is healthy. When the watch breaks, the cache still serves what it has for
``stale_after`` seconds (a reconnect normally takes milliseconds); past that it is out of sync
until a watch is established again or a relist succeeds.

An *optional* resource (an alpha API behind a feature gate, say, or one the exporter may lack the
RBAC for) may be missing without the cache being out of sync. One found through API discovery is
looked up before each list; the version discovery chose is logged when it is first found and again
only when it changes (or the resource comes back after being unavailable). When the API server does
not serve it, or RBAC does not allow listing or watching it, the handler is emptied, the reason is
logged once, the cache counts as in sync (it holds, correctly, nothing), and the list is tried
again every ``unavailable_retry`` seconds.

``on_connect``, when given, is called in the reflector's thread whenever what the API server is may
have changed: before the first list (and before the first list after an optional resource was
unavailable), and each time a list or a watch succeeds after a failure. A normal reconnect (the
watch's server-side timeout, every few minutes) does not call it. The exporter re-reads the API
server's version there: an upgrade restarts the API server, which breaks every watch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import urllib3
from google.protobuf.message import DecodeError

from otel_dra.kube import liststream, protobuf
from otel_dra.kube.client import ApiError, KubeClient
from otel_dra.kube.liststream import StreamedList

log = logging.getLogger(__name__)

# Bytes per read of a streamed list answer.
_READ = 1 << 20

# The longest Retry-After honoured, in seconds (a larger one is waited for this long): the API
# server's priority and fairness answers 1 s and more after repeated rejections.
MAX_RETRY_AFTER = 300.0


@dataclass(frozen=True)
class ResourceType:
    """A listable resource, e.g. ``ResourceType("resourceclaims", "resource.k8s.io/v1")``."""

    plural: str
    group_version: str
    # Decodes one item of a protobuf list page; None: lists are JSON.
    protobuf: protobuf.ItemDecoder | None = field(default=None, compare=False, repr=False)

    @property
    def path(self) -> str:
        prefix = "/api/" if "/" not in self.group_version else "/apis/"
        return f"{prefix}{self.group_version}/{self.plural}"


class Handler(Protocol):
    """Receives the objects. Called from the reflector thread only; must not raise."""

    def replace(self, objects: Iterable[dict[str, Any]]) -> None: ...
    def upsert(self, obj: dict[str, Any]) -> None: ...
    def delete(self, obj: dict[str, Any]) -> None: ...


class ReflectorEvents(Protocol):
    """Self-metric hooks."""

    def watch_event(self, resource: str, event_type: str) -> None: ...
    def relist(self, resource: str, reason: str) -> None: ...
    def list_error(self, resource: str, status: int) -> None: ...
    def watch_error(self, resource: str, status: int) -> None: ...


class _Gone(Exception):
    """Our resourceVersion is too old: relist."""


class _Stopped(Exception):
    """stop() was asked for during a list: the list ends at the next page."""


class _Unavailable(Exception):
    """An optional resource is not served, or not allowed: serve nothing and look again later."""


@dataclass
class SyncState:
    synced: bool
    has_synced: bool
    last_sync: float | None  # wall-clock time of the last list or watch progress
    error: str | None
    unavailable: str | None = None  # why an optional resource is not being watched


class Reflector:
    def __init__(
        self,
        client: KubeClient,
        resource: ResourceType,
        handler: Handler,
        *,
        events: ReflectorEvents | None = None,
        page_size: int = 500,
        stale_after: float = 30.0,
        watch_timeout: tuple[int, int] = (240, 420),
        backoff: tuple[float, float] = (0.5, 30.0),
        clock: Callable[[], float] = time.monotonic,
        field_selector: str = "",
        discover: Callable[[KubeClient], ResourceType | None] | None = None,
        unavailable_retry: float = 300.0,
        optional: bool = False,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        """``optional`` makes the resource optional (see the module notes); so does ``discover``,
        which returns where the resource is served (its group version may differ between
        clusters), or None. ``on_connect``: see the module notes (an exception it raises is logged)."""
        self.client = client
        self.field_selector = field_selector  # e.g. "spec.nodeName=node-1": list and watch alike
        self.resource = resource
        self.discover = discover
        self.on_connect = on_connect
        self.optional = optional or discover is not None
        self.unavailable_retry = unavailable_retry
        self._unavailable: str | None = None
        self._announced: ResourceType | None = None  # the discovered version last logged
        self.handler = handler
        self.events = events
        self.page_size = page_size
        self._protobuf = True  # lists ask for protobuf when the resource can decode it
        self.stale_after = stale_after
        self.watch_timeout = watch_timeout
        self.backoff = backoff
        self._clock = clock
        self._lock = threading.Lock()
        self._has_synced = False
        self._broken_since: float | None = None
        self._last_sync_wall: float | None = None
        self._error: str | None = None
        self._logged_error: str | None = None
        self._stop = threading.Event()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._thread: threading.Thread | None = None

    # --- state -----------------------------------------------------------------------------
    def state(self) -> SyncState:
        with self._lock:
            synced = self._has_synced and (
                self._broken_since is None or self._clock() - self._broken_since < self.stale_after
            )
            return SyncState(synced, self._has_synced, self._last_sync_wall, self._error, self._unavailable)

    def _progress(self, listed: bool = False) -> None:
        with self._lock:
            self._has_synced = self._has_synced or listed
            self._broken_since = None
            self._last_sync_wall = time.time()
            recovered = self._error is not None
            if recovered:
                log.info("%s: recovered", self.resource.plural)
            if listed and self.optional:
                back = self._unavailable is not None
                if self.discover is not None and (back or self.resource != self._announced):
                    # The version discovery chose: logged once, and again when it changes or comes back.
                    log.info(
                        "%s: served at %s (found by API discovery), watching it",
                        self.resource.plural,
                        self.resource.group_version,
                    )
                    self._announced = self.resource
                elif back:
                    log.info("%s: listed again, watching it", self.resource.plural)
                self._unavailable = None
            self._error = None
            self._logged_error = None
        if recovered:
            self._connected()  # outside the lock: it makes requests

    def _connected(self) -> None:
        if self.on_connect is None:
            return
        try:
            self.on_connect()
        except Exception:  # the hook's bug must not stop the list and watch
            log.exception("%s: on_connect failed", self.resource.plural)

    def _set_unavailable(self, reason: str) -> None:
        self.handler.replace(())
        with self._lock:
            self._has_synced = True
            self._broken_since = None
            self._error = None
            self._logged_error = None
            repeat = reason == self._unavailable
            self._unavailable = reason
        if not repeat:
            log.warning(
                "%s: %s; its metrics stay empty, everything else is served (looking again every %.0f s)",
                self.resource.plural,
                reason,
                self.unavailable_retry,
            )

    def _failed(self, message: str) -> None:
        with self._lock:
            if self._broken_since is None:
                self._broken_since = self._clock()
            self._error = message
            repeat = message == self._logged_error
            self._logged_error = message
        # The same error over and over (API server down for minutes) is logged once.
        log.log(logging.DEBUG if repeat else logging.ERROR, "%s: %s", self.resource.plural, message)

    # --- lifecycle -------------------------------------------------------------------------
    def start(self) -> Reflector:
        self._thread = threading.Thread(target=self.run, name=f"reflector-{self.resource.plural}", daemon=True)
        self._thread.start()
        return self

    def request_stop(self) -> None:
        """Ask the thread to stop without waiting (stop several reflectors in parallel)."""
        self._stop.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        resp = self._response
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()  # unblocks a read in progress
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        delay = self.backoff[0]
        resource_version: str | None = None
        since = ""  # the last version seen, for a relist ("": none, the initial list)
        relist_reason = "initial"
        connecting = True  # on_connect is due before the next list (the first, or after unavailable)
        while not self._stop.is_set():
            server_wait: float | None = None  # the Retry-After of the failed request, if any
            try:
                if resource_version is None:
                    if connecting:
                        connecting = False
                        self._connected()
                    if relist_reason != "initial" and self.events:
                        self.events.relist(self.resource.plural, relist_reason)
                    resource_version = self._list(since)
                    self._progress(listed=True)
                    delay = self.backoff[0]
                resource_version = self._watch(resource_version)
                delay = self.backoff[0]
                continue  # a watch that timed out normally: reconnect at once
            except _Gone:
                log.info("%s: resourceVersion %s expired, relisting", self.resource.plural, resource_version)
                since = resource_version or since
                resource_version, relist_reason = None, "expired"
                continue
            except _Stopped:
                break
            except _Unavailable as exc:
                self._set_unavailable(str(exc))
                connecting = True
                since = ""
                resource_version, relist_reason = None, "initial"
                delay = self.backoff[0]
                self._stop.wait(self.unavailable_retry)
                continue
            except ApiError as exc:
                if self._stop.is_set():
                    break
                self._failed(self._describe(exc))
                server_wait = exc.retry_after
            except Exception as exc:  # a bug or a malformed stream must not kill the thread
                if self._stop.is_set():
                    break
                log.exception("%s: unexpected error", self.resource.plural)
                self._failed(f"unexpected error: {exc}")
                since = resource_version or since
                resource_version, relist_reason = None, "error"
            # Full jitter: spreads reconnects of many replicas after an API server restart; never
            # sooner than a Retry-After asked (throttled replicas must not come back in a storm).
            wait = random.uniform(0, delay)
            if server_wait is not None:
                wait = max(wait, min(server_wait, MAX_RETRY_AFTER))
            self._stop.wait(wait)
            delay = min(delay * 2, self.backoff[1])

    def _optional_error(self, exc: ApiError) -> None:
        """For an optional resource, answers that mean "not for us" become _Unavailable."""
        if not self.optional:
            return
        if exc.status == 404:
            raise _Unavailable(f"not served by the API server ({self.resource.group_version})") from exc
        if exc.status == 403:
            raise _Unavailable(
                f"forbidden ({exc.message}); grant list and watch on "
                f"{self.resource.plural}.{self.resource.group_version.split('/')[0]} to report them"
            ) from exc

    def _describe(self, exc: ApiError) -> str:
        if exc.status == 403:
            return (
                f"forbidden: {exc.message} -- the exporter needs list and watch on "
                f"{self.resource.plural}.{self.resource.group_version.split('/')[0]}"
            )
        if exc.status == 401:
            return f"unauthorized: {exc.message} -- check the credentials"
        if exc.status == 0:
            return f"API server unreachable: {exc.message}"
        return str(exc)

    # --- list --------------------------------------------------------------------------------
    def _list(self, since: str = "") -> str:
        """The list, handed to the handler item by item as it is read (the answer for 10^5 objects
        is never held at once); the handler swaps its contents only if the whole list succeeds.
        ``since``: the last resourceVersion seen (a relist), so the answer is not older than it."""
        resource_version = ""
        count = 0
        if self.discover is not None:
            self.resource = self._discovered()
        decode_item = self.resource.protobuf if self._protobuf else None
        headers = {"Accept": protobuf.ACCEPT} if decode_item is not None else None

        def fetch(token: str | None) -> bytes:
            return self._fetch_page(token, headers)

        encoding = "JSON"  # of the page being decoded, for the error message

        def decode(raw: bytes) -> tuple[str, str | None, Iterable[Any]]:
            """(resourceVersion, continue token, items) of one page."""
            nonlocal encoding
            if decode_item is not None and protobuf.is_protobuf(raw):
                encoding = "protobuf"
                return _protobuf_page(raw, decode_item)
            return _json_page(raw)

        first_token: str | None = None  # of the first answer, when the server paginated

        def first_page() -> Iterator[Any]:
            """The first answer, streamed (see :meth:`_open_list`). Sets the list's version and the
            continue token (when the server did paginate) as it reads."""
            nonlocal resource_version, encoding, first_token
            resp = self._open_list(since, headers)
            with self._streamed(resp):
                page = StreamedList(resp.stream(_READ))
                resource_version, first_token = page.resource_version, page.continue_token
                if page.protobuf:
                    if decode_item is None:
                        raise ValueError("a protobuf answer to a JSON list")
                    encoding = "protobuf"
                    yield from map(decode_item, page.items())
                else:
                    yield from page.items()
                # What follows the items may say otherwise (see StreamedList._json_tail).
                resource_version, first_token = page.resource_version, page.continue_token

        def items() -> Iterator[dict[str, Any]]:
            nonlocal resource_version, count, encoding
            pending: _Prefetch | None = None
            try:
                for item in first_page():
                    if pending is None and first_token and not self._stop.is_set():
                        # The server paginated after all (no watch cache, say): the next page is
                        # asked for as the first one is handed over, as for the others below.
                        pending = _Prefetch(fetch, first_token, f"reflector-{self.resource.plural}-prefetch")
                    if isinstance(item, dict):
                        count += 1
                        yield item
                if pending is not None and pending.token != first_token:  # the tail said otherwise
                    pending.discard()
                    pending = None
                if not first_token:
                    return
                if self._stop.is_set():
                    raise _Stopped()
                encoding = "JSON"
                if pending is not None:
                    raw, pending = pending.result(), None
                else:
                    raw = fetch(first_token)
                while True:
                    # The next page is asked for while this one is decoded and handed over (the wait
                    # for the API server releases the GIL): for JSON the token is read from the head
                    # of the raw page, and checked against the decoded one; a protobuf page's is
                    # read with the page, whose items stay encoded until they are iterated.
                    ahead = None if protobuf.is_protobuf(raw) else _head_continue(raw)
                    if ahead and not self._stop.is_set():
                        pending = _Prefetch(fetch, ahead, f"reflector-{self.resource.plural}-prefetch")
                    page_version, token, page_items = decode(raw)
                    del raw
                    if not resource_version:
                        resource_version = page_version
                    if pending is not None and pending.token != token:  # not the page we need
                        pending.discard()
                        pending = None
                    if token and pending is None and ahead is None and not self._stop.is_set():
                        pending = _Prefetch(fetch, token, f"reflector-{self.resource.plural}-prefetch")
                    for item in page_items:
                        if isinstance(item, dict):
                            count += 1
                            yield item
                    del page_items
                    if not token:
                        return
                    if self._stop.is_set():
                        raise _Stopped()
                    if pending is not None:
                        raw, pending = pending.result(), None
                    else:
                        raw = fetch(token)
            except (ApiError, ValueError, DecodeError) as exc:
                raise self._list_failed(exc, encoding) from exc
            finally:
                if pending is not None:
                    pending.discard()

        self.handler.replace(items())
        log.info("%s: listed %d objects at resourceVersion %s", self.resource.plural, count, resource_version)
        return resource_version

    def _discovered(self) -> ResourceType:
        """Where API discovery finds the resource served now."""
        assert self.discover is not None
        try:
            found = self.discover(self.client)
        except ApiError as exc:
            raise ApiError(exc.status, f"API discovery failed: {exc.message}", exc.body, exc.retry_after) from exc
        if found is None:
            raise _Unavailable("not served by the API server (not found by API discovery)")
        return found

    def _fetch_page(self, token: str | None, headers: dict[str, str] | None) -> bytes:
        """A list page after the first, whole (``token``: its continue token)."""
        query: dict[str, str | int] = {"limit": self.page_size}
        if self.field_selector:
            query["fieldSelector"] = self.field_selector
        if token:
            query["continue"] = token
        return self.client.get_bytes(self.resource.path, query, headers=headers)

    def _open_list(self, since: str, headers: dict[str, str] | None) -> urllib3.BaseHTTPResponse:
        """The first answer of a list, to be streamed: with ``resourceVersion`` 0 (or, relisting,
        not older than what was seen) the API server answers from its watch cache, and answers the
        whole list at once (it ignores ``limit`` there); see :mod:`otel_dra.kube.liststream`."""
        query: dict[str, str | int] = {"limit": self.page_size, "resourceVersion": since or "0"}
        if since:
            query["resourceVersionMatch"] = "NotOlderThan"
        if self.field_selector:
            query["fieldSelector"] = self.field_selector

        def get() -> urllib3.BaseHTTPResponse:
            return self.client.request(
                "GET", self.resource.path, query=query, headers=headers, stream=True, timeout=(10.0, 60.0)
            )

        try:
            return get()
        except ApiError as exc:
            # What client-go does too: a version the cache cannot serve (compacted away, or
            # newer than this API server's cache: 504 after its wait) is listed by quorum read.
            if not since or exc.status not in (410, 504):
                raise
            log.info(
                "%s: cannot list at resourceVersion %s (%d), listing the latest",
                self.resource.plural,
                since,
                exc.status,
            )
            del query["resourceVersion"], query["resourceVersionMatch"]
            return get()

    @contextlib.contextmanager
    def _streamed(self, resp: urllib3.BaseHTTPResponse) -> Iterator[None]:
        """While a streamed answer is read: :meth:`stop` can unblock the read; a broken connection
        is an :class:`ApiError` (or the stop asked for); the connection is released, and closed
        when the answer was not read to the end (it cannot be reused)."""
        self._response = resp
        complete = False
        try:
            yield
            complete = True
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            if self._stop.is_set():
                raise _Stopped() from exc
            raise ApiError(0, f"{self.resource.path}: list connection lost: {exc}") from exc
        finally:
            self._response = None
            if not complete:
                resp.close()  # not read to the end: the connection cannot be reused
            resp.release_conn()

    def _list_failed(self, exc: ApiError | ValueError | DecodeError, encoding: str) -> Exception:
        """What a failed list raises (counted, an optional resource's "not for us" answer raised as
        _Unavailable); a protobuf page that could not be decoded makes every later list JSON."""
        if isinstance(exc, ApiError):
            if self.events:
                self.events.list_error(self.resource.plural, exc.status)
            self._optional_error(exc)
            if exc.status == 410:  # the continue token expired mid-list: start over
                # Logged here: the reason is the list, not an expired watch version.
                log.info("%s: list continuation expired (410), listing again", self.resource.plural)
                return _Gone()
            return ApiError(exc.status, f"list failed: {exc.message}", exc.body, exc.retry_after)
        if self.events:
            self.events.list_error(self.resource.plural, 200)
        if encoding == "protobuf":
            # Whatever is wrong (a server or proxy bug, a field whose type we got wrong),
            # JSON still works: the next attempt, and every list after it, asks for JSON.
            self._protobuf = False
            log.warning(
                "%s: protobuf list could not be decoded (%s); listing as JSON from now on",
                self.resource.plural,
                exc,
            )
            return ApiError(200, f"list answered malformed protobuf: {exc}")
        return ApiError(200, f"list answered malformed JSON: {exc}")

    # --- watch -------------------------------------------------------------------------------
    def _watch(self, resource_version: str) -> str:
        timeout = random.randint(*self.watch_timeout)
        query: dict[str, str | int] = {
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": resource_version,
            "timeoutSeconds": timeout,
        }
        if self.field_selector:
            query["fieldSelector"] = self.field_selector
        try:
            resp = self.client.request(
                "GET", self.resource.path, query=query, stream=True, timeout=(10.0, timeout + 30.0)
            )
        except ApiError as exc:
            if self.events:
                self.events.watch_error(self.resource.plural, exc.status)
            self._optional_error(exc)
            if exc.status == 410:
                raise _Gone() from exc
            raise ApiError(exc.status, f"watch failed: {exc.message}", exc.body, exc.retry_after) from exc
        self._response = resp
        self._progress()
        try:
            for line in _lines(resp):
                event = json.loads(line)
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    if self.events:
                        self.events.watch_error(self.resource.plural, int(code or 0))
                    if code == 410:
                        raise _Gone()
                    raise ApiError(int(code or 0), f"watch error event: {obj.get('message', obj)}")
                if self.events:
                    self.events.watch_event(self.resource.plural, str(kind))
                meta = obj.get("metadata")
                # Malformed metadata: the store drops (and counts) the object; it must not break the watch.
                rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
                if kind in ("ADDED", "MODIFIED"):
                    self.handler.upsert(obj)
                elif kind == "DELETED":
                    self.handler.delete(obj)
                elif kind != "BOOKMARK":
                    log.warning("%s: ignoring watch event of type %r", self.resource.plural, kind)
                    continue
                if rv:
                    resource_version = str(rv)
                with self._lock:
                    self._last_sync_wall = time.time()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            if self._stop.is_set():
                return resource_version
            if self.events:
                self.events.watch_error(self.resource.plural, 0)
            raise ApiError(0, f"watch connection lost: {exc}") from exc
        finally:
            self._response = None
            resp.release_conn()
        return resource_version


def _lines(resp: urllib3.BaseHTTPResponse) -> Iterator[bytes]:
    """Newline-delimited watch events from a streamed response."""
    buffer = b""
    for chunk in resp.stream(64 * 1024):
        buffer += chunk
        if b"\n" not in buffer:
            continue
        *complete, buffer = buffer.split(b"\n")
        for line in complete:
            if line.strip():
                yield line
    if buffer.strip():
        yield buffer


def _head_continue(raw: bytes) -> str | None:
    """The continue token of a raw list page, read from its head without decoding the items; None
    when there is none or the head is not in the expected shape (the caller then waits for the
    full decode)."""
    try:
        head = liststream.json_head(raw)
    except ValueError:
        return None
    return head[1] if head is not None else None


def _json_page(raw: bytes) -> tuple[str, str | None, Iterable[Any]]:
    """(resourceVersion, continue token, items) of a JSON list page."""
    page = json.loads(raw)
    meta = page.get("metadata") or {}
    page_items = page.get("items")
    items = page_items if isinstance(page_items, list) else []
    return str(meta.get("resourceVersion", "")), meta.get("continue") or None, items


def _protobuf_page(raw: bytes, decode_item: protobuf.ItemDecoder) -> tuple[str, str | None, Iterable[Any]]:
    """(resourceVersion, continue token, items) of a protobuf list page; its items are decoded as
    they are iterated."""
    pb = protobuf.list_page(raw)
    return pb.resource_version, pb.continue_token or None, map(decode_item, pb.items)


class _Prefetch:
    """One list page fetched in a thread of its own; ``result()`` returns it or raises what the
    fetch raised."""

    def __init__(self, fetch: Callable[[str], bytes], token: str, name: str) -> None:
        self.token = token
        self._fetch = fetch
        self._data: bytes | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._data = self._fetch(self.token)
        except BaseException as exc:  # handed to the list thread, which raises it in order
            self._error = exc

    def result(self) -> bytes:
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        data, self._data = self._data, None
        assert data is not None
        return data

    def discard(self) -> None:
        """Wait for the fetch (no thread is left behind) and drop what it got."""
        self._thread.join()
        self._data = self._error = None
