"""The reflector's state machine with a scripted client (the real API server is in tests/integration)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest

from otel_dra._generated.k8s import meta_pb2
from otel_dra.kube import protobuf
from otel_dra.kube.client import ApiError
from otel_dra.kube.reflector import Reflector, ResourceType
from tests.helpers import wait_until

RT = ResourceType("deviceclasses", "resource.k8s.io/v1")


class _Stream:
    def __init__(self, events):
        self._data = b"".join(json.dumps(e).encode() + b"\n" for e in events)

    def stream(self, n):
        # Split mid-line to exercise the line reassembly.
        for i in range(0, len(self._data), 7):
            yield self._data[i : i + 7]

    def release_conn(self):
        pass

    def shutdown(self):
        pass


class _Chunks:
    """A list answer streamed in 7-byte reads, so that items and their lengths straddle reads."""

    def __init__(self, data):
        self._data = data
        self.closed = False

    def stream(self, n):
        for i in range(0, len(self._data), 7):
            yield self._data[i : i + 7]

    def close(self):
        self.closed = True

    def release_conn(self):
        pass

    def shutdown(self):
        pass


class _Client:
    """Answers list pages and watch requests from a script; records what was asked."""

    def __init__(self, lists, watches, done):
        self.lists, self.watches, self.done = list(lists), list(watches), done
        self.calls = []
        self.accepts = []

    def get_bytes(self, path, query, headers=None):
        self.calls.append(("list", dict(query)))
        self.accepts.append((headers or {}).get("Accept", "application/json"))
        page = self.lists.pop(0)
        if isinstance(page, Exception):
            raise page
        # As the API server writes it (no spaces), so that the reflector reads ahead.
        return page if isinstance(page, bytes) else json.dumps(page, separators=(",", ":")).encode()

    def request(self, method, path, *, query, stream, timeout, headers=None):
        if "watch" not in query:  # the first answer of a list, read as a stream
            return _Chunks(self.get_bytes(path, query, headers))
        self.calls.append(("watch", dict(query)))
        if not self.watches:
            self.done.set()
            raise ApiError(0, "script finished")
        step = self.watches.pop(0)
        if isinstance(step, Exception):
            raise step
        return _Stream(step)


class _Handler:
    def __init__(self):
        self.objects = {}
        self.replaced = 0

    def replace(self, objects):
        self.replaced += 1
        self.objects = {o["metadata"]["name"]: o for o in objects}

    def upsert(self, obj):
        self.objects[obj["metadata"]["name"]] = obj

    def delete(self, obj):
        self.objects.pop(obj["metadata"]["name"], None)


class _Events:
    def __init__(self):
        self.seen = []

    def watch_event(self, resource, event_type):
        self.seen.append(("event", event_type))

    def relist(self, resource, reason):
        self.seen.append(("relist", reason))

    def list_error(self, resource, status):
        self.seen.append(("list_error", status))

    def watch_error(self, resource, status):
        self.seen.append(("watch_error", status))


def _obj(name, rv):
    return {"metadata": {"name": name, "resourceVersion": rv}}


def _run(lists, watches, resource=RT):
    done = threading.Event()
    client, handler, events = _Client(lists, watches, done), _Handler(), _Events()
    reflector = Reflector(client, resource, handler, events=events, page_size=2, backoff=(0.001, 0.002), stale_after=60)
    thread = threading.Thread(target=reflector.run, daemon=True)
    thread.start()
    assert done.wait(5)
    reflector.stop()
    # The thread still reports the script's end; let it finish while this test's log capture is
    # open (a log record after the test wrote a "Logging error" trace to the session's stderr).
    thread.join(5)
    assert not thread.is_alive()
    return client, handler, events, reflector


def test_paginated_list_then_watch_resumes_from_last_version_and_bookmarks():
    lists = [
        {"metadata": {"resourceVersion": "10", "continue": "t1"}, "items": [_obj("a", "5"), _obj("b", "6")]},
        {"metadata": {"resourceVersion": "10"}, "items": [_obj("c", "7")]},
    ]
    watches = [
        [
            {"type": "ADDED", "object": _obj("d", "11")},
            {"type": "DELETED", "object": _obj("a", "12")},
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}},
        ],
        [{"type": "MODIFIED", "object": _obj("b", "16")}],
    ]
    client, handler, _events, reflector = _run(lists, watches)
    # The first request from the watch cache (resourceVersion 0); a server that paginates anyway
    # is followed through its continue tokens.
    assert [c for c in client.calls if c[0] == "list"] == [
        ("list", {"limit": 2, "resourceVersion": "0"}),
        ("list", {"limit": 2, "continue": "t1"}),
    ]
    watch_rvs = [q["resourceVersion"] for kind, q in client.calls if kind == "watch"]
    # After the script's end the reflector may re-watch (1-2 ms backoff) before the test stops it:
    # each such retry resumes from the last version seen, 16.
    assert watch_rvs[:3] == ["10", "15", "16"] and set(watch_rvs[3:]) <= {"16"}
    assert all(q["allowWatchBookmarks"] == "true" for kind, q in client.calls if kind == "watch")
    assert sorted(handler.objects) == ["b", "c", "d"] and handler.objects["b"]["metadata"]["resourceVersion"] == "16"
    assert reflector.state().has_synced


def test_gone_relists_both_as_http_410_and_as_error_event():
    page = {"metadata": {"resourceVersion": "1"}, "items": [_obj("a", "1")]}
    watches = [
        ApiError(410, "Gone"),
        [{"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old resource version"}}],
    ]
    _client, handler, events, _ = _run([page, page, page], watches)
    assert handler.replaced == 3
    assert [e for e in events.seen if e[0] == "relist"] == [("relist", "expired"), ("relist", "expired")]


def test_errors_back_off_and_are_reported_and_mark_state():
    page = {"metadata": {"resourceVersion": "1"}, "items": []}
    _client, _handler, events, reflector = _run(
        [ApiError(403, "Forbidden", '{"message": "cannot list"}'), page], [ApiError(500, "boom")]
    )
    assert ("list_error", 403) in events.seen and ("watch_error", 500) in events.seen
    state = reflector.state()
    assert state.has_synced and state.error is not None


def test_optional_resource_not_served_or_forbidden_is_logged_once_and_counts_as_synced(caplog):
    import logging

    found = ResourceType("devicetaintrules", "resource.k8s.io/v1alpha3")
    answers = [None, None, found, found]  # not served twice, then served; then a 403 on list
    page = {"metadata": {"resourceVersion": "3"}, "items": [_obj("rule", "2")]}
    done = threading.Event()
    client = _Client(
        [page] + [ApiError(403, "Forbidden")] * 20,
        [[{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "4"}}}], ApiError(410, "Gone")],
        done,
    )
    handler, states = _Handler(), []
    handler.objects = {"stale": _obj("stale", "1")}

    def discover(c):
        states.append(reflector.state())
        return answers.pop(0) if answers else found

    reflector = Reflector(
        client,
        found,
        handler,
        backoff=(0.001, 0.002),
        discover=discover,
        unavailable_retry=0.01,
    )
    with caplog.at_level(logging.WARNING, logger="otel_dra.kube.reflector"):
        thread = threading.Thread(target=reflector.run, daemon=True)
        thread.start()
        wait_until(lambda: len(states) >= 5, timeout=5, interval=0.01, what="five discoveries")
        reflector.stop()
    messages = [r.getMessage() for r in caplog.records]
    # Not served: emptied, in sync, logged once for two attempts.
    assert states[1].synced and states[1].unavailable and "not served" in states[1].unavailable
    assert sum("not served" in m for m in messages) == 1
    # Then served: listed, watched (the bookmark), until a 410 relists and the list is forbidden.
    assert any(kind == "watch" for kind, _ in client.calls)
    assert states[3].unavailable is None and states[3].has_synced
    assert sum("forbidden" in m for m in messages) == 1
    final = reflector.state()
    assert final.synced and final.unavailable and "grant list and watch" in final.unavailable
    assert handler.objects == {}  # nothing stale is served


def test_optional_resource_without_discovery_forbidden_then_allowed(caplog):
    """Pods: always served, optional only because RBAC may not allow them. A 403 empties the cache,
    keeps it in sync and is logged once; once allowed, the list is logged as back."""
    import logging

    page = {"metadata": {"resourceVersion": "3"}, "items": [_obj("p", "2")]}
    done = threading.Event()
    client = _Client([ApiError(403, "Forbidden"), ApiError(403, "Forbidden"), page], [], done)
    handler = _Handler()
    handler.objects = {"stale": _obj("stale", "1")}
    pods = ResourceType("pods", "v1")
    reflector = Reflector(client, pods, handler, backoff=(0.001, 0.002), optional=True, unavailable_retry=0.01)
    assert reflector.discover is None and reflector.optional
    with caplog.at_level(logging.INFO, logger="otel_dra.kube.reflector"):
        thread = threading.Thread(target=reflector.run, daemon=True)
        thread.start()
        assert done.wait(5)
        reflector.stop()
        thread.join(5)  # run() was started by hand: stop() has no thread of its own to join
    assert not thread.is_alive()
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("pods: forbidden") for m in messages) == 1
    assert "pods: listed again, watching it" in messages
    assert not any("found by API discovery" in m for m in messages)
    assert reflector.state().synced and reflector.state().unavailable is None
    assert list(handler.objects) == ["p"]  # the stale object went with the 403, the listed one came


def _discovery(served: dict[str, list[str]]):
    """A client answering API discovery for resource.k8s.io as a release serves it: version ->
    resource names (as /apis/resource.k8s.io/<version> lists them)."""

    class Discovery:
        def __init__(self):
            self.paths = []

        def get_json(self, path, query=None):
            self.paths.append(path)
            if path == "/apis/resource.k8s.io":
                return {
                    "kind": "APIGroup",
                    "name": "resource.k8s.io",
                    "versions": [{"groupVersion": f"resource.k8s.io/{v}", "version": v} for v in served],
                    "preferredVersion": {"groupVersion": "resource.k8s.io/v1", "version": "v1"},
                }
            version = path.rsplit("/", 1)[1]
            if served.get(version) is None:
                raise ApiError(404, "Not Found")
            return {
                "kind": "APIResourceList",
                "groupVersion": f"resource.k8s.io/{version}",
                "resources": [{"name": n, "namespaced": False, "kind": "DeviceTaintRule"} for n in served[version]],
            }

    return Discovery()


V1_RESOURCES = ["deviceclasses", "resourceclaims", "resourceclaims/status", "resourceclaimtemplates", "resourceslices"]
TAINT_RULES = ["devicetaintrules", "devicetaintrules/status"]


def test_discovery_prefers_v1_then_v1beta2_then_v1alpha3():
    """What the releases serve (checked against real API servers of 1.34 and 1.37): the newest
    version serving DeviceTaintRules wins; a version that lists no devicetaintrules is skipped."""
    from otel_dra.cluster.devicetaintrule import discover

    releases = {
        # 1.34 with --runtime-config=resource.k8s.io/v1alpha3=true (no status subresource yet).
        "1.34": ({"v1": V1_RESOURCES, "v1alpha3": ["devicetaintrules"]}, "resource.k8s.io/v1alpha3"),
        # 1.34 without: not served.
        "1.34 default": ({"v1": V1_RESOURCES, "v1beta2": V1_RESOURCES, "v1beta1": V1_RESOURCES}, None),
        # 1.36 with the DRADeviceTaintRules gate and --runtime-config=resource.k8s.io/v1beta2=true.
        "1.36": ({"v1": V1_RESOURCES, "v1beta2": V1_RESOURCES + TAINT_RULES}, "resource.k8s.io/v1beta2"),
        # 1.37: GA, and the older versions too when enabled.
        "1.37": (
            {"v1": V1_RESOURCES + TAINT_RULES, "v1beta2": V1_RESOURCES + TAINT_RULES, "v1alpha3": TAINT_RULES},
            "resource.k8s.io/v1",
        ),
        # 1.37 with --runtime-config=resource.k8s.io/v1/devicetaintrules=false and v1alpha3 on.
        "1.37 v1 off": ({"v1": V1_RESOURCES, "v1alpha3": TAINT_RULES}, "resource.k8s.io/v1alpha3"),
        "1.37 all off": ({"v1": V1_RESOURCES}, None),
    }
    for release, (served, expected) in releases.items():
        client = _discovery(served)
        found = discover(client)
        assert (found.group_version if found else None) == expected, release
        assert found is None or found.plural == "devicetaintrules"
        if expected:  # nothing past the version that serves them is asked for
            assert client.paths[-1] == f"/apis/{expected}", release


def test_discovery_skips_a_version_gone_between_the_group_and_its_list():
    from otel_dra.cluster.devicetaintrule import discover

    client = _discovery({"v1": None, "v1beta2": V1_RESOURCES + TAINT_RULES})  # v1 listed, then 404
    assert discover(client) == ResourceType("devicetaintrules", "resource.k8s.io/v1beta2")


def test_the_discovered_version_is_logged_once_and_again_when_it_changes(caplog):
    import logging

    beta = ResourceType("devicetaintrules", "resource.k8s.io/v1beta2")
    ga = ResourceType("devicetaintrules", "resource.k8s.io/v1")
    answers = [beta, beta, beta, ga]  # relisted twice at v1beta2 (410s), then the cluster upgraded
    page = {"metadata": {"resourceVersion": "3"}, "items": [_obj("rule", "2")]}
    done = threading.Event()
    client = _Client([page] * 4, [ApiError(410, "Gone")] * 3, done)
    reflector = Reflector(
        client, RT, _Handler(), backoff=(0.001, 0.002), discover=lambda c: answers.pop(0), unavailable_retry=0.01
    )
    with caplog.at_level(logging.INFO, logger="otel_dra.kube.reflector"):
        thread = threading.Thread(target=reflector.run, daemon=True)
        thread.start()
        assert done.wait(5)
        reflector.stop()
        thread.join(5)
    chosen = [r.getMessage() for r in caplog.records if "found by API discovery" in r.getMessage()]
    assert chosen == [
        "devicetaintrules: served at resource.k8s.io/v1beta2 (found by API discovery), watching it",
        "devicetaintrules: served at resource.k8s.io/v1 (found by API discovery), watching it",
    ]
    assert reflector.resource == ga


# --- the list reads ahead: page N+1 is asked for while page N is decoded and handed over ---------


def _page(names, cont=None, rv="10"):
    meta = {"resourceVersion": rv, **({"continue": cont} if cont else {})}
    return {
        "kind": "DeviceClassList",
        "apiVersion": "resource.k8s.io/v1",
        "metadata": meta,
        "items": [_obj(n, "1") for n in names],
    }


class _Recording(_Handler):
    """Notes, for each object handed over, how many list requests had been made by then."""

    def __init__(self, client):
        super().__init__()
        self.client, self.seen = client, []

    def replace(self, objects):
        def noted():
            for o in objects:
                self.seen.append((o["metadata"]["name"], sum(kind == "list" for kind, _ in self.client.calls)))
                yield o

        super().replace(noted())


def _run_with(client, handler, events=None):
    reflector = Reflector(client, RT, handler, events=events, page_size=2, backoff=(0.001, 0.002), stale_after=60)
    thread = threading.Thread(target=reflector.run, daemon=True)
    thread.start()
    assert client.done.wait(5)
    reflector.stop()
    thread.join(5)
    assert not thread.is_alive()
    return reflector


def test_list_asks_for_the_next_page_before_handing_over_this_one_and_keeps_the_order():
    done = threading.Event()
    client = _Client([_page("ab", "t1"), _page("cd", "t2"), _page("e")], [], done)
    handler = _Recording(client)
    _run_with(client, handler)
    # Page 2 was asked for before "a" was handed over, page 3 before "c"; the last page asks for nothing.
    assert handler.seen == [("a", 2), ("b", 2), ("c", 3), ("d", 3), ("e", 3)]
    assert [q.get("continue") for kind, q in client.calls if kind == "list"] == [None, "t1", "t2"]
    assert list(handler.objects) == ["a", "b", "c", "d", "e"]


def test_an_error_on_a_read_ahead_page_comes_after_the_pages_before_it():
    done = threading.Event()
    lists = [_page("ab", "t1"), ApiError(500, "boom"), _page("ab", "t1"), _page("c")]
    client, events = _Client(lists, [], done), _Events()
    handler = _Recording(client)
    _run_with(client, handler, events)
    assert [name for name, _ in handler.seen] == ["a", "b", "a", "b", "c"]  # the first list failed after "b"
    assert ("list_error", 500) in events.seen
    assert list(handler.objects) == ["a", "b", "c"]


def test_gone_and_malformed_json_on_a_read_ahead_page():
    done = threading.Event()
    lists = [_page("ab", "t1"), ApiError(410, "Gone"), _page("ab", "t1"), b'{"metadata":{}, "items": [', _page("z")]
    client, events = _Client(lists, [], done), _Events()
    handler = _Handler()
    _run_with(client, handler, events)
    assert ("relist", "expired") in events.seen  # 410 mid-list: listed again
    assert ("list_error", 410) in events.seen and ("list_error", 200) in events.seen
    assert list(handler.objects) == ["z"]


def test_a_head_that_disagrees_with_the_decoded_page_is_not_trusted():
    """Only the decoded page says which page comes next (here a duplicate key: json keeps the last)."""
    done = threading.Event()
    odd = b'{"metadata":{"continue":"wrong"},"items":[{"metadata":{"name":"a"}}],"metadata":{"continue":"t1"}}'
    client = _Client([odd, b"", _page("b")], [], done)  # b"": the answer to "wrong", dropped unread
    handler = _Handler()
    _run_with(client, handler)
    assert [q.get("continue") for kind, q in client.calls if kind == "list"] == [None, "wrong", "t1"]
    assert list(handler.objects) == ["a", "b"]


def test_the_continue_token_read_from_the_head_of_a_page():
    from otel_dra.kube.reflector import _head_continue

    assert (
        _head_continue(
            b'{"kind":"PodList","apiVersion":"v1","metadata":{"resourceVersion":"5","continue":"eyJ2Ijo_-"},"items":['
        )
        == "eyJ2Ijo_-"
    )
    assert _head_continue(b'{"metadata":{"continue":"a\\u002bb\\"c"},"items":[]}') == 'a+b"c'  # JSON escapes decoded
    assert _head_continue(b'{"metadata":{"resourceVersion":"5"},"items":[]}') is None  # the last page
    assert _head_continue(b'{"metadata":{"x":{"continue":"t"}},"items":[]}') is None  # not flat: decode first
    assert _head_continue(b'{ "metadata": {"continue": "t"}, "items": []}') is None  # not as Go writes it
    assert _head_continue(b'{"kind":"X","items":[],"metadata":{"continue":"t"}}') is None  # items first
    assert _head_continue(b'{"metadata":{"continue":"t",},"items":[]}') is None  # malformed metadata
    assert _head_continue(b"[]") is None


def test_stop_during_a_list_ends_it_at_the_next_page_and_leaves_no_thread():
    release, asked = threading.Event(), threading.Event()

    class Blocking(_Client):
        def get_bytes(self, path, query, headers=None):
            if query.get("continue") == "t1":
                asked.set()
                assert release.wait(5)
            return super().get_bytes(path, query, headers)

    done = threading.Event()
    client = Blocking([_page("ab", "t1"), _page("cd", "t2"), _page("e")], [], done)
    handler = _Handler()
    reflector = Reflector(client, RT, handler, page_size=2, backoff=(0.001, 0.002)).start()
    assert asked.wait(5)
    reflector.request_stop()
    release.set()
    reflector.stop()
    assert reflector._thread is not None and not reflector._thread.is_alive()
    assert [q.get("continue") for kind, q in client.calls if kind == "list"] == [None, "t1"]  # not page 3
    assert handler.replaced == 1 and handler.objects == {}  # the handler saw the list fail, not complete
    assert not reflector.state().has_synced
    assert not [t for t in threading.enumerate() if t.name.endswith("-prefetch")]


# --- lists as protobuf ------------------------------------------------------------------------------


def _pb_item(data: bytes) -> dict:
    meta = meta_pb2.ObjectMeta.FromString(data)
    return {"metadata": {"name": meta.name, "resourceVersion": meta.resourceVersion}}


PB_RT = ResourceType("pods", "v1", protobuf=_pb_item)


def _pb_page(names, token="", rv="10"):
    """A protobuf list answer as the API server writes it: magic, runtime.Unknown, the list."""
    page = meta_pb2.List(
        metadata=meta_pb2.ListMeta(resourceVersion=rv, **{"continue": token}),
        items=[meta_pb2.ObjectMeta(name=n, resourceVersion="5").SerializeToString() for n in names],
    )
    return protobuf.MAGIC + meta_pb2.Unknown(raw=page.SerializeToString()).SerializeToString()


def test_protobuf_list_pages_follow_their_continue_tokens():
    client, handler, _events, reflector = _run([_pb_page("ab", "t1"), _pb_page("c", rv="11")], [], resource=PB_RT)
    assert [q for kind, q in client.calls if kind == "list"] == [
        {"limit": 2, "resourceVersion": "0"},
        {"limit": 2, "continue": "t1"},
    ]
    assert client.accepts == [protobuf.ACCEPT] * 2
    assert sorted(handler.objects) == ["a", "b", "c"]
    # The watch starts from the first page's resourceVersion, as with JSON. (The script has no watch
    # events: the watch fails and is retried every 1-2 ms until the test stops the reflector, so a
    # loaded machine sees several, each from the same version.)
    watches = [q["resourceVersion"] for kind, q in client.calls if kind == "watch"]
    assert watches and set(watches) == {"10"}, watches
    assert reflector.state().has_synced


def test_a_json_answer_to_a_protobuf_list_is_read_as_json():
    client, handler, _events, _ = _run([_page("ab", "t1"), _pb_page("c")], [], resource=PB_RT)
    assert client.accepts == [protobuf.ACCEPT] * 2
    assert sorted(handler.objects) == ["a", "b", "c"]


def test_an_undecodable_protobuf_page_is_counted_and_the_lists_after_it_are_json(caplog):
    truncated = _pb_page("ab", "t1")[:-3]
    # Its head names page 2, which is asked for (and dropped) before the cut is found.
    client, handler, events, _ = _run([truncated, _pb_page("c"), _page("ab")], [], resource=PB_RT)
    assert ("list_error", 200) in events.seen
    assert client.accepts == [protobuf.ACCEPT, protobuf.ACCEPT, "application/json"]
    assert sorted(handler.objects) == ["a", "b"]
    assert "protobuf list could not be decoded" in caplog.text


def test_list_page_refuses_what_is_not_a_protobuf_list():
    with pytest.raises(ValueError, match="no k8s magic"):
        protobuf.list_page(b'{"items":[]}')
    with pytest.raises(ValueError, match="malformed protobuf list"):
        protobuf.list_page(protobuf.MAGIC + b"\x12\x05ab")
    compressed = protobuf.MAGIC + meta_pb2.Unknown(raw=b"", contentEncoding="gzip").SerializeToString()
    with pytest.raises(ValueError, match="content encoding 'gzip'"):
        protobuf.list_page(compressed)


class _TimedClient(_Client):
    """Records when each request was made."""

    def __init__(self, lists, watches, done):
        super().__init__(lists, watches, done)
        self.times = []

    def get_bytes(self, path, query, headers=None):
        self.times.append(time.monotonic())
        return super().get_bytes(path, query, headers)

    def request(self, method, path, *, query, stream, timeout, headers=None):
        if "watch" in query:  # a list's first answer is timed by get_bytes
            self.times.append(time.monotonic())
        return super().request(method, path, query=query, stream=stream, timeout=timeout, headers=headers)


def test_retry_after_is_waited_for_even_when_the_backoff_is_shorter():
    """A throttled list or watch (429 with Retry-After, as priority and fairness answers) is not
    repeated before the server said: with a 1 ms backoff, the retries still wait 0.3 s."""
    page = {"metadata": {"resourceVersion": "1"}, "items": []}
    throttled = ApiError(429, "Too Many Requests", "", retry_after=0.3)
    done = threading.Event()
    client = _TimedClient([throttled, throttled, page], [ApiError(429, "Too Many Requests", "", 0.3)], done)
    events = _Events()
    reflector = Reflector(client, RT, _Handler(), events=events, backoff=(0.001, 0.002), stale_after=60)
    thread = threading.Thread(target=reflector.run, daemon=True)
    thread.start()
    assert done.wait(5)
    reflector.stop()
    thread.join(5)
    assert [e for e in events.seen if e[0].endswith("error")] == [
        ("list_error", 429),
        ("list_error", 429),
        ("watch_error", 429),
        ("watch_error", 0),  # the script's end
    ]
    gaps = [b - a for a, b in itertools.pairwise(client.times)]
    # list 429, list 429, list ok, watch 429, watch (the script's end): the gap after each 429.
    assert len(gaps) == 4
    assert min(gaps[0], gaps[1], gaps[3]) >= 0.3, gaps
    assert gaps[2] < 0.3, gaps  # no wait after a success


def test_without_retry_after_the_backoff_alone_decides():
    page = {"metadata": {"resourceVersion": "1"}, "items": []}
    done = threading.Event()
    client = _TimedClient([ApiError(429, "Too Many Requests"), page], [], done)
    reflector = Reflector(client, RT, _Handler(), backoff=(0.001, 0.002), stale_after=60)
    thread = threading.Thread(target=reflector.run, daemon=True)
    thread.start()
    assert done.wait(5)
    reflector.stop()
    thread.join(5)
    assert client.times[1] - client.times[0] < 0.2


def test_a_relist_is_not_older_than_what_was_seen_and_falls_back_to_a_quorum_read():
    """The initial list is from the watch cache (resourceVersion 0); a relist asks for nothing older
    than the last version seen (as client-go does), and when the cache cannot serve that version
    (504 after its wait, or 410) the latest is listed by quorum read."""
    page = {"metadata": {"resourceVersion": "20"}, "items": [_obj("a", "1")]}
    watches = [
        [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "25"}}}],
        ApiError(410, "Gone"),
        ApiError(410, "Gone"),
    ]
    client, handler, _events, _ = _run([page, page, ApiError(504, "Timeout"), page], watches)
    lists = [q for kind, q in client.calls if kind == "list"]
    assert lists == [
        {"limit": 2, "resourceVersion": "0"},
        {"limit": 2, "resourceVersion": "25", "resourceVersionMatch": "NotOlderThan"},
        {"limit": 2, "resourceVersion": "20", "resourceVersionMatch": "NotOlderThan"},
        {"limit": 2},
    ]
    assert sorted(handler.objects) == ["a"]


def test_on_connect_runs_before_the_first_list_and_after_each_recovery_not_on_a_normal_reconnect():
    """Where the exporter re-reads the API server's version: at start-up, and once a list or a
    watch succeeds after a failure (an upgrade restarts the API server); a watch that ends at its
    server-side timeout reconnects without it."""
    page = {"metadata": {"resourceVersion": "1"}, "items": [_obj("a", "1")]}
    bookmark = [{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "2"}}}]
    done = threading.Event()
    client = _Client(
        [ApiError(500, "starting"), page],  # the first list fails, the second succeeds
        [bookmark, bookmark, ApiError(0, "connection refused"), bookmark, bookmark],
        done,
    )
    seen: list[list[str]] = []

    def on_connect() -> None:
        seen.append([kind for kind, _ in client.calls])  # what was asked before the hook ran

    reflector = Reflector(client, RT, _Handler(), backoff=(0.001, 0.002), on_connect=on_connect)
    thread = threading.Thread(target=reflector.run, daemon=True)
    thread.start()
    assert done.wait(5)
    reflector.stop()
    thread.join(5)
    assert seen == [
        [],  # before the first list
        ["list", "list"],  # the list that succeeded after the failed one
        ["list", "list", "watch", "watch", "watch", "watch"],  # the watch re-established after the break
    ]


def test_on_connect_failing_is_logged_and_the_reflector_goes_on(caplog):
    import logging

    page = {"metadata": {"resourceVersion": "1"}, "items": [_obj("a", "1")]}
    done = threading.Event()
    client, handler = _Client([page], [], done), _Handler()

    def broken() -> None:
        raise RuntimeError("bug in the hook")

    reflector = Reflector(client, RT, handler, backoff=(0.001, 0.002), on_connect=broken)
    with caplog.at_level(logging.ERROR, logger="otel_dra.kube.reflector"):
        thread = threading.Thread(target=reflector.run, daemon=True)
        thread.start()
        assert done.wait(5)
        reflector.stop()
        thread.join(5)
    assert list(handler.objects) == ["a"]
    assert any("on_connect failed" in r.getMessage() for r in caplog.records)


def test_on_connect_runs_again_when_an_unavailable_resource_comes_back():
    found = ResourceType("devicetaintrules", "resource.k8s.io/v1")
    answers = [None, found]
    page = {"metadata": {"resourceVersion": "3"}, "items": []}
    done = threading.Event()
    client = _Client([page], [], done)
    calls: list[int] = []
    reflector = Reflector(
        client,
        found,
        _Handler(),
        backoff=(0.001, 0.002),
        discover=lambda c: answers.pop(0) if answers else found,
        unavailable_retry=0.01,
        on_connect=lambda: calls.append(len(answers)),
    )
    thread = threading.Thread(target=reflector.run, daemon=True)
    thread.start()
    assert done.wait(5)
    reflector.stop()
    thread.join(5)
    assert calls == [2, 1]  # before the first try (not served), and before the list once served
