"""The exporter when the API server fails: killed and restarted, a watch resumed after etcd
compaction (410 Gone), throttled by priority and fairness (429 with Retry-After), slow.

Every request an exporter makes is in the fault testbed's audit log (tests/faults/conftest.py), so
these tests count what the API server really received instead of trusting the client's view.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import time
import urllib.error
import urllib.request
from collections import Counter, defaultdict
from typing import Any

import pytest

from otel_dra.fixtures import apply_all, create, sample_objects
from otel_dra.kube.client import ApiError
from tests.faults.conftest import NAMESPACE, FaultTestbed, TcpProxy, sample_value, state_series
from tests.helpers import http_get, scrape, wait_until

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims"
# The resources an exporter without pods or DeviceTaintRule RBAC lists and watches.
WATCHED = ("resourceclaims", "resourceslices", "deviceclasses")


@pytest.fixture(scope="module")
def world(fault_testbed: FaultTestbed) -> FaultTestbed:
    """The sample objects (claims allocated and reserved, slices, classes) in the fault testbed."""
    apply_all(fault_testbed.admin, sample_objects())
    return fault_testbed


def _claim(namespace: str, name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations or {}},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}},
    }


def _namespace(ft: FaultTestbed, name: str, claims: int) -> None:
    with contextlib.suppress(ApiError):
        ft.admin.send_json("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    for i in range(claims):
        create(ft.admin, _claim(name, f"c{i}"))


def _duplicates(series: list[tuple[str, Any, float]]) -> list[Any]:
    counts = Counter((name, labels) for name, labels, _ in series)
    return [key for key, n in counts.items() if n > 1]


def _same_as_fresh(app: Any, fresh: Any) -> bool:
    return state_series(app.port) == state_series(fresh.port)


def _synced(app: Any) -> bool:
    return app.state.not_synced() is None


def _resource(uri: str) -> str:
    return uri.split("?")[0].rsplit("/", 1)[-1]


def _claim_names(series: Any, namespace: str) -> set[str | None]:
    """The resourceclaim_name labels of the series in ``namespace``."""
    return {
        dict(labels).get("resourceclaim_name") for _, labels, _ in series if dict(labels).get("namespace") == namespace
    }


# --- kube-apiserver killed and restarted ------------------------------------------------------------------


def test_apiserver_killed_and_restarted(world, exporters):
    """SIGKILL: /metrics keeps serving the cache for --stale-after, then answers 500 (no partial
    data; /readyz 503, /healthz 200); once the API server is back the exporter recovers by itself
    and serves exactly the series of an exporter started afterwards, changes made right after the
    restart included."""
    ft = world
    _namespace(ft, "faults-outage", 3)
    kubeconfig = ft.exporter_kubeconfig("outage")
    stale_after = 3.0
    app = exporters(kubeconfig, stale_after=stale_after)
    wait_until(lambda: _synced(app), what="sync")
    before = state_series(app.port)
    assert any(labels and dict(labels).get("namespace") == "faults-outage" for _, labels, _ in before)

    ft.testbed.kill_apiserver()
    killed = time.monotonic()
    try:
        codes: list[tuple[float, int]] = []

        def served_500() -> tuple[int, str] | None:
            """The answer once /metrics answers 500; every answer before it must be a 200."""
            code, body = scrape(app.port)
            codes.append((time.monotonic() - killed, code))
            assert code in (200, 500), codes[-5:]
            return (code, body) if code == 500 else None

        _code, body = wait_until(served_500, timeout=stale_after + 10, interval=0.05, what="/metrics to answer 500")
        to_500 = codes[-1][0]
        print(f"\n/metrics 500 after {to_500:.2f} s (--stale-after {stale_after}); 200 until then")
        assert stale_after - 0.5 <= to_500 <= stale_after + 1.5, to_500
        assert "kube_" not in body  # no partial data
        assert http_get(f"http://127.0.0.1:{app.port}/healthz")[0] == 200
        assert http_get(f"http://127.0.0.1:{app.port}/readyz")[0] == 503
    finally:
        ft.testbed.start_apiserver()
    back = time.monotonic()
    # Changed right after the restart, while the exporter is still backing off.
    ft.admin.request("DELETE", CLAIMS.format(ns="faults-outage") + "/c0")
    create(ft.admin, _claim("faults-outage", "after-restart"))
    wait_until(lambda: scrape(app.port)[0] == 200, timeout=60, what="recovery")
    print(f"recovered {time.monotonic() - back:.2f} s after the API server was ready")
    fresh = exporters(kubeconfig)
    wait_until(lambda: _synced(fresh), what="fresh sync")
    wait_until(lambda: _same_as_fresh(app, fresh), timeout=30, what="the series of a fresh exporter")
    series = state_series(app.port)
    assert not _duplicates(series)
    names = _claim_names(series, "faults-outage")
    assert names == {"c1", "c2", "after-restart"}


# --- a watch resumed after etcd compaction (410 Gone) ---------------------------------------------------------


def test_watch_resumes_after_etcd_compaction_with_one_relist(world, exporters, proxy):
    """The exporter's connection is cut (a partition) while claims are deleted, changed and
    created and etcd is compacted past its resourceVersion; the API server restarts, so its watch
    cache cannot serve that version either. The resumed watches get 410 Gone: each resource is
    relisted exactly once, and the exporter serves what a fresh one does, nothing lost, nothing
    twice."""
    ft = world
    _namespace(ft, "faults-resume", 4)
    link: TcpProxy = proxy()
    app = exporters(ft.exporter_kubeconfig("resume", server=link.url), stale_after=120.0)
    wait_until(lambda: _synced(app), what="sync")
    old_version = ft.admin.get_json(CLAIMS.format(ns="faults-resume"))["metadata"]["resourceVersion"]

    link.cut()
    claims = CLAIMS.format(ns="faults-resume")
    ft.admin.request("DELETE", f"{claims}/c0")
    ft.admin.request("DELETE", f"{claims}/c1")
    ft.admin.send_json(
        "PATCH",
        f"{claims}/c2",
        {"metadata": {"annotations": {"changed": "yes"}}},
        content_type="application/merge-patch+json",
    )
    for name in ("n0", "n1"):
        create(ft.admin, _claim("faults-resume", name))
    revision = ft.compact_etcd()
    assert revision > int(old_version)
    ft.testbed.stop_apiserver()
    ft.testbed.start_apiserver()
    # The exporter's version is gone from etcd (and the new watch cache starts after it).
    with pytest.raises(ApiError) as gone:
        ft.admin.request("GET", claims, query={"resourceVersion": old_version, "resourceVersionMatch": "Exact"})
    assert gone.value.status == 410
    resumed = time.time()
    link.heal()

    wait_until(
        lambda: all(
            sample_value(app.port, "otel_dra_relists_total", resource=r, reason="expired") >= 1 for r in WATCHED
        ),
        timeout=60,
        what="a relist of each resource after 410",
    )
    fresh = exporters(ft.exporter_kubeconfig("resume-fresh"))
    wait_until(lambda: _synced(fresh) and _synced(app), what="both in sync")
    wait_until(lambda: _same_as_fresh(app, fresh), timeout=30, what="the series of a fresh exporter")
    series = state_series(app.port)
    assert not _duplicates(series)
    names = _claim_names(series, "faults-resume")
    assert names == {"c2", "c3", "n0", "n1"}
    for r in WATCHED:
        assert sample_value(app.port, "otel_dra_relists_total", resource=r, reason="expired") == 1

    # What the API server saw after the partition healed: per resource, watches that ended in
    # 410 (an HTTP 410, or a 200 stream carrying the ERROR event), then one list, then a watch.
    # The client can hold a list's answer before the server has written its audit event: read the
    # log once it shows, for every resource, a list and the watch that follows it.
    def relisted_and_watching() -> list[dict[str, Any]] | None:
        requests = [r for r in ft.audit("resume", since=resumed) if _resource(r["uri"]) in WATCHED]
        listed = {_resource(r["uri"]): r["time"] for r in requests if r["verb"] == "list"}
        watching = {
            resource
            for resource, at in listed.items()
            if any(r["verb"] == "watch" and _resource(r["uri"]) == resource and r["time"] >= at for r in requests)
        }
        return requests if watching == set(WATCHED) else None

    requests = wait_until(
        relisted_and_watching, timeout=30, what="a list, then a watch, of each resource in the audit log"
    )
    lists = Counter(_resource(r["uri"]) for r in requests if r["verb"] == "list")
    print(f"\nafter the partition: {len(requests)} requests, lists {dict(lists)}")
    assert lists == dict.fromkeys(WATCHED, 1), requests
    assert all(r["code"] in (200, 410, None) for r in requests), requests


# --- throttling: 429 with Retry-After from priority and fairness -----------------------------------------------

THROTTLE = f"""
apiVersion: v1
kind: ServiceAccount
metadata: {{name: hog, namespace: {NAMESPACE}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {{name: probe, namespace: {NAMESPACE}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: faults-hog, namespace: {NAMESPACE}}}
rules:
- {{apiGroups: [""], resources: [configmaps], verbs: [list]}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: faults-hog, namespace: {NAMESPACE}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: faults-hog}}
subjects:
- {{kind: ServiceAccount, name: hog, namespace: {NAMESPACE}}}
- {{kind: ServiceAccount, name: probe, namespace: {NAMESPACE}}}
---
# A priority level with no seats of its own and none to borrow: it runs one request at a time and
# rejects (429) whatever comes while that one runs.
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {{name: faults-throttled}}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 0
    lendablePercent: 0
    borrowingLimitPercent: 0
    limitResponse: {{type: Reject}}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {{name: faults-throttled}}
spec:
  priorityLevelConfiguration: {{name: faults-throttled}}
  matchingPrecedence: 500
  distinguisherMethod: {{type: ByUser}}
  rules:
  - subjects:
    - {{kind: ServiceAccount, serviceAccount: {{name: throttled, namespace: {NAMESPACE}}}}}
    - {{kind: ServiceAccount, serviceAccount: {{name: hog, namespace: {NAMESPACE}}}}}
    - {{kind: ServiceAccount, serviceAccount: {{name: probe, namespace: {NAMESPACE}}}}}
    resourceRules: [{{verbs: ["*"], apiGroups: ["*"], resources: ["*"], clusterScope: true, namespaces: ["*"]}}]
    nonResourceRules: [{{verbs: ["*"], nonResourceURLs: ["*"]}}]
"""


class SeatHog:
    """Holds the throttled priority level's one seat: a list of ~11 MB read by nobody, through a
    socket with a 4 KiB receive buffer, keeps its handler blocked in a write until ``release()``."""

    def __init__(self, ft: FaultTestbed, token: str) -> None:
        # The small receive buffer before connecting: the TCP window is agreed in the handshake, and
        # set afterwards the kernel could take most of the list in, freeing the seat (the probe then
        # never saw a 429).
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.connect(("127.0.0.1", ft.testbed.ports["apiserver"]))
        context = ft.testbed.api_ssl_context()
        context.set_alpn_protocols(["http/1.1"])
        self._sock = context.wrap_socket(raw, server_hostname="127.0.0.1")
        self._sock.sendall(
            f"GET /api/v1/namespaces/{NAMESPACE}/configmaps HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {token}\r\n\r\n".encode()
        )
        self._sock.recv(64)  # the status line: the request runs

    def release(self) -> None:
        self._sock.close()


def _probe(ft: FaultTestbed, token: str) -> tuple[int, str | None]:
    status, retry_after, _level = _probe_level(ft, token)
    return status, retry_after


def _probe_level(ft: FaultTestbed, token: str) -> tuple[int, str | None, str | None]:
    """Status, Retry-After, and the UID of the priority level that handled the request (the API
    server's priority and fairness names it in every answer)."""
    request = urllib.request.Request(
        ft.testbed.server + f"/api/v1/namespaces/{NAMESPACE}/configmaps?limit=1",
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, context=ft.testbed.api_ssl_context(), timeout=10) as response:
            return response.status, None, response.headers.get("X-Kubernetes-PF-PriorityLevel-UID")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Retry-After"), exc.headers.get("X-Kubernetes-PF-PriorityLevel-UID")


def test_throttled_exporter_waits_as_long_as_retry_after_says(world, exporters):
    """The API server's priority and fairness rejects every request of the exporter (429,
    Retry-After 1 s and more) while another client of its priority level holds the only seat.
    Counted in the audit log: each reflector asks again no sooner than Retry-After (before the
    reflector honoured it, its jittered backoff asked again after 0-0.5 s), so the requests stay
    few; once the seat is free the exporter syncs by itself."""
    ft = world
    kubeconfig = ft.exporter_kubeconfig("throttled")
    ft.testbed.kubectl("apply", "-f", "-", input=THROTTLE)
    blob = "x" * 900_000
    # ~11 MB: more than the API server's socket can buffer, so its handler stays in a write.
    for i in range(12):
        with contextlib.suppress(ApiError):
            ft.admin.send_json(
                "POST",
                f"/api/v1/namespaces/{NAMESPACE}/configmaps",
                {"metadata": {"name": f"big-{i}"}, "data": {"d": blob}},
            )
    hog_token, probe_token = ft.testbed.mint_token(NAMESPACE, "hog"), ft.testbed.mint_token(NAMESPACE, "probe")
    # In force only once the probe's requests land in the throttled level: a 200 alone is also what
    # the default level answers, and a hog started before that would hold a seat of another level.
    level = ft.admin.get_json("/apis/flowcontrol.apiserver.k8s.io/v1/prioritylevelconfigurations/faults-throttled")
    wait_until(
        lambda: _probe_level(ft, probe_token)[::2] == (200, level["metadata"]["uid"]), what="the flow schema in force"
    )
    hogs = [SeatHog(ft, hog_token)]

    def throttled() -> tuple[int, str | None] | None:
        answer = _probe(ft, probe_token)
        if answer[0] == 429:
            return answer
        # That hog's request did not keep the seat (seen in about half the runs after the other
        # tests of this module, cause not found): hold it with another one.
        hogs.append(SeatHog(ft, hog_token))
        return None

    try:
        _status, retry_after = wait_until(throttled, timeout=60, interval=1, what="429")
        assert retry_after is not None and int(retry_after) >= 1  # the real server says how long
        start = time.time()
        app = exporters(kubeconfig)
        window = 10.0
        time.sleep(window)
        assert not _synced(app)
        assert scrape(app.port)[0] == 500
    finally:
        for hog in hogs:
            hog.release()
        released = time.time()
    wait_until(lambda: _synced(app), timeout=60, what="sync once the seat is free")
    print(f"\nsynced {time.time() - released:.1f} s after the seat was freed")
    assert sum(sample_value(app.port, n, code="429") for n in ("otel_dra_list_errors_total",)) >= len(WATCHED)

    requests = [r for r in ft.audit("throttled", since=start) if r["time"] < released]
    by_path: dict[str, list[float]] = defaultdict(list)
    for r in requests:
        assert r["code"] == 429, r
        by_path[r["uri"].split("?")[0]].append(r["time"])
    gaps = {path: [b - a for a, b in itertools.pairwise(times)] for path, times in by_path.items()}
    print(
        f"throttled for {window:.0f} s: {len(requests)} requests ("
        + ", ".join(f"{p.rsplit('/', 1)[-1]} {len(t)}" for p, t in by_path.items())
        + f"); shortest gap {min(g for v in gaps.values() for g in v):.2f} s"
    )
    assert set(WATCHED) <= {p.rsplit("/", 1)[-1] for p in by_path}
    for path, between in gaps.items():
        # Every reflector asked again, no sooner than Retry-After (at least 1 s); the server's
        # /version, read once when the DeviceTaintRule reflector connects, may have no second ask.
        assert between or path == "/version", (path, between)
        assert not between or min(between) >= 0.95, (path, between)
    # No storm: at most one request per reflector and second (plus the first).
    assert len(requests) <= len(by_path) * (window + 2), len(requests)


# --- a slow API server ---------------------------------------------------------------------------------------------


def test_slow_apiserver_gets_no_repeated_requests(world, exporters, proxy):
    """0.5 s added to every packet each way (a TLS request takes seconds): the exporter syncs
    slowly but with the requests of a normal sync, every one answered 200, none repeated, and
    nothing more while it is in sync; its scrapes are not slowed (served from the cache)."""
    ft = world
    link: TcpProxy = proxy(latency=0.5)
    start = time.time()
    app = exporters(ft.exporter_kubeconfig("slow", server=link.url))
    wait_until(lambda: _synced(app), timeout=90, what="sync through the slow link")
    synced = time.time()
    quiet = 6.0
    latencies = []
    deadline = time.monotonic() + quiet
    while time.monotonic() < deadline:
        began = time.monotonic()
        assert scrape(app.port)[0] == 200
        latencies.append(time.monotonic() - began)
        time.sleep(0.2)
    requests = ft.audit("slow", since=start)
    ours = [r for r in requests if _resource(r["uri"]) in WATCHED]
    kinds = Counter((_resource(r["uri"]), r["verb"]) for r in ours)
    latencies.sort()
    print(
        f"\nsynced in {synced - start:.1f} s through the slow link; {len(requests)} requests "
        f"({dict(kinds)}); {link.connections} connections; scrape p50 {latencies[len(latencies) // 2] * 1000:.1f} ms"
    )
    assert kinds == {(r, verb): 1 for r in WATCHED for verb in ("list", "watch")}, kinds
    assert all(r["code"] in (200, 403, None) for r in requests), requests  # 403: DeviceTaintRules, no RBAC
    assert not [r for r in requests if r["time"] > synced + 1], "requests while in sync"
    assert latencies[len(latencies) // 2] < 0.25
