#!/bin/bash
# One exporter from source tree TREE against a held testbed (bench/held.py), measured:
#   bench/held_exporter.sh KUBECONFIG TREE NAME [exporter args...]      (SCRAPES=15 by default)
# Prints: seconds from process start to /readyz 200; CPU seconds by then of the exporter (user and
# system), of kube-apiserver and of etcd (their /proc stat, found by the testbed's ports); the
# scrape p50 (min, max) by curl after two warm-up scrapes, plain and with Accept-Encoding: gzip; the
# API requests (DRA objects and pods) the scrapes caused; VmRSS / VmHWM; the exporter's own
# collection time sums. Logs go to $OUT (default /tmp)/NAME.log. Needs the tree byte-compiled for a
# fair start-up:
#   PYTHONDONTWRITEBYTECODE= python -m compileall -q TREE/otel_dra
set -euo pipefail
kc=$1; tree=$2; out=$3; shift 3
dir=${OUT:-/tmp}
python=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
port=$(python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])')
api_port=$(sed -n 's|.*server: https://127.0.0.1:\([0-9]*\).*|\1|p' "$kc" | head -1)
apid=$(pgrep -f "kube-apiserver.*secure-port=$api_port" | head -1)
etcd_port=$(tr ' ' '\n' < "/proc/$apid/cmdline" 2>/dev/null | tr '\0' '\n' | sed -n 's|--etcd-servers=http://127.0.0.1:\([0-9]*\).*|\1|p' | head -1)
epid=$(pgrep -f "etcd.*127.0.0.1:$etcd_port" | head -1)
cpu() { awk '{print ($14+$15)/100}' "/proc/$1/stat"; }
cpu_split() { awk '{print "user " $14/100 " s, system " $15/100 " s"}' "/proc/$1/stat"; }
a0=$(cpu "$apid"); e0=$(cpu "$epid")
start=$(date +%s.%N)
(cd "$tree" && PYTHONPATH=$tree exec "$python" -m otel_dra exporter --kubeconfig "$kc" --address 127.0.0.1 --port "$port" "$@") > "$dir/$out.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$port/readyz" > /dev/null; do
    kill -0 $pid 2> /dev/null || { echo "exporter exited; see $dir/$out.log"; exit 1; }
    sleep 0.1
done
end=$(date +%s.%N)
echo "$out: initial sync $(echo "$end - $start" | bc) s; CPU: exporter $(cpu $pid) s, apiserver $(echo "$(cpu "$apid") - $a0" | bc) s, etcd $(echo "$(cpu "$epid") - $e0" | bc) s (exporter $(cpu_split $pid))"
# API requests for DRA objects and pods (apiserver_request_total, every verb but WATCH) during
# the scrapes: nothing else uses the held testbed, so the difference is the exporter's.
requests() {
    "$python" - "$kc" <<'PY'
import sys
from otel_dra.kube.client import KubeClient, load_credentials
text = KubeClient(load_credentials(sys.argv[1])).get_bytes("/metrics", {}).decode()
total = 0.0
for line in text.splitlines():
    if line.startswith("apiserver_request_total{") and 'verb="WATCH"' not in line:
        if 'group="resource.k8s.io"' in line or ('group=""' in line and 'resource="pods"' in line):
            total += float(line.rsplit(" ", 1)[1])
print(int(total))
PY
}
# Two warm-up scrapes with the curl options given, then SCRAPES timed ones (sorted into
# $dir/$out.FILE): their p50, min and max, and the size of one more body. Counts them in $scraped.
scraped=0
timed_scrapes() {
    local label=$1 file=$2 unit=$3 url="http://127.0.0.1:$port/metrics" n
    shift 3
    curl -s "$@" -o /dev/null "$url"; curl -s "$@" -o /dev/null "$url"
    for _ in $(seq "${SCRAPES:-15}"); do curl -s "$@" -o /dev/null -w "%{time_total}\n" "$url"; done | sort -n > "$dir/$out.$file"
    n=$(wc -l < "$dir/$out.$file")
    echo "  $label p50 $(sed -n "$(( (n + 1) / 2 ))p" "$dir/$out.$file") s (min $(head -1 "$dir/$out.$file"), max $(tail -1 "$dir/$out.$file")); body $(curl -s "$@" "$url" | wc -c) $unit"
    scraped=$(( scraped + n + 3 ))
}
r0=$(requests)
timed_scrapes scrape scrapes bytes
# The same with Accept-Encoding: gzip, as Prometheus asks (its scrape_configs' enable_compression
# defaults to true): time to the last compressed byte, not decompressed (curl without --compressed).
# Of the two warm-up scrapes the first compresses every segment once; later ones send the cached
# members.
timed_scrapes "gzip scrape" gzip-scrapes "bytes compressed" -H "Accept-Encoding: gzip"
echo "  API requests for DRA objects and pods during the $scraped scrapes: $(( $(requests) - r0 ))"
echo "  $(grep -E 'VmRSS|VmHWM' /proc/$pid/status | tr -s ' \t' ' ' | tr '\n' ' ')"
curl -s "http://127.0.0.1:$port/metrics" | grep -E '^otel_dra_collection_(duration|cpu_time)_seconds_(sum|count)\{exporter="prometheus"' | sed 's/^/  /'
