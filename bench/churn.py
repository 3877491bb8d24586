"""Object churn for benchmarks: N changes per second on random claims of a workload.

    python -m bench.churn KUBECONFIG CLAIMS NAMESPACES RATE [reserve|realloc] [WORKERS]

``reserve`` (default): each change is one merge-patch of a claim's status that replaces its
reserving pod, the kind of write the scheduler and kubelet make all day. ``realloc``: each change
deallocates a claim and allocates it again on a random device of a random slice (two status
writes, as the allocation is immutable): every change moves devices between slices and pools, so
it exercises the joins (device allocation, pool counts). Claim 0 is left to the lag probes. Runs
until killed; prints the achieved rate on exit. ``WORKERS`` (default 8) threads write
concurrently, with at most four times as many changes queued or running: when the API server (or
the machine) cannot keep up, the generator waits rather than queueing without bound, so the
achieved rate is what got through and it stops promptly when killed."""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from bench.workload import DRIVER
from otel_dra.kube.client import ApiError, KubeClient, load_credentials

WORKERS = 8


def main() -> int:
    kubeconfig, claims, namespaces, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    mode = sys.argv[5] if len(sys.argv) > 5 else "reserve"
    if mode not in ("reserve", "realloc"):
        raise SystemExit(f"unknown churn mode {mode!r}")
    workers = int(sys.argv[6]) if len(sys.argv) > 6 else WORKERS
    slices = max(1, claims // 10)
    client = KubeClient(load_credentials(kubeconfig), max_connections=max(16, workers))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    done = errors = 0
    lock = threading.Lock()
    slots = threading.BoundedSemaphore(4 * workers)

    def change(n: int) -> None:
        nonlocal done, errors
        j = random.randrange(1, claims) if claims > 1 else 0
        path = f"/apis/resource.k8s.io/v1/namespaces/bench-{j % namespaces:03d}/resourceclaims/claim-{j:06d}/status"
        pod = [{"resource": "pods", "name": f"pod-{j:06d}-c{n}", "uid": str(uuid.uuid4())}]
        try:
            if mode == "realloc":
                result = {
                    "request": "gpu",
                    "driver": DRIVER,
                    "pool": f"node-{random.randrange(slices):05d}",
                    "device": f"gpu-{random.randrange(8)}",
                }
                release = {"status": {"allocation": None, "reservedFor": None}}
                client.send_json("PATCH", path, release, content_type="application/merge-patch+json")
                body = {"status": {"allocation": {"devices": {"results": [result]}}, "reservedFor": pod}}
            else:
                body = {"status": {"reservedFor": pod}}
            client.send_json("PATCH", path, body, content_type="application/merge-patch+json")
            with lock:
                done += 1
        except ApiError:
            with lock:
                errors += 1
        finally:
            slots.release()

    start = time.monotonic()
    n = 0
    with ThreadPoolExecutor(workers) as pool:
        while not stop.is_set():
            target = start + n / rate
            delay = target - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            while not slots.acquire(timeout=0.5):
                if stop.is_set():
                    break
            else:
                pool.submit(change, n)
                n += 1
    elapsed = time.monotonic() - start
    print(f"churn: {done} changes, {errors} errors, {done / elapsed:.1f}/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
