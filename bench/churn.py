"""Object churn for benchmarks: N status changes per second on random claims of a workload.

    python -m bench.churn KUBECONFIG CLAIMS NAMESPACES RATE

Each change is one merge-patch of a claim's status (its reserving pod is replaced), the kind of
write the scheduler and kubelet make all day. Runs until killed; prints achieved rate on exit."""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from otel_dra.kube.client import ApiError, KubeClient, load_credentials


def main() -> int:
    kubeconfig, claims, namespaces, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    client = KubeClient(load_credentials(kubeconfig), max_connections=16)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    done = errors = 0
    lock = threading.Lock()

    def change(n: int) -> None:
        nonlocal done, errors
        j = random.randrange(claims)
        path = f"/apis/resource.k8s.io/v1/namespaces/bench-{j % namespaces:03d}/resourceclaims/claim-{j:06d}/status"
        body = {
            "status": {"reservedFor": [{"resource": "pods", "name": f"pod-{j:06d}-c{n}", "uid": str(uuid.uuid4())}]}
        }
        try:
            client.send_json("PATCH", path, body, content_type="application/merge-patch+json")
            with lock:
                done += 1
        except ApiError:
            with lock:
                errors += 1

    start = time.monotonic()
    n = 0
    with ThreadPoolExecutor(8) as pool:
        while not stop.is_set():
            target = start + n / rate
            delay = target - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            pool.submit(change, n)
            n += 1
    elapsed = time.monotonic() - start
    print(f"churn: {done} changes, {errors} errors, {done / elapsed:.1f}/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
