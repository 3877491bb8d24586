# otel-dra developer entry points. Everything installs into .venv from the pinned requirements.lock;
# the Kubernetes/etcd binaries are built once into ~/.cache/otel-dra (OTEL_DRA_CACHE overrides).
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: install node-prereqs image peers protos lint test test-quick test-unit test-faults fuzz golden run sandbox bench bench-scale bench-plugin bench-plugin-real bench-soak manifests ci clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c requirements.lock -e '.[dev]'
	$(BIN)/pip check
	touch $@

# Debian packages of the real node (tests marked `node`) and of the image build: runc and the CNI
# plugins beside the containerd and kubelet built from Go modules, a static busybox for the node's
# images, iptables/iproute2, and buildah + debootstrap (`make image`). Installed only when missing,
# and only as root (apt-get); without root the node tests skip themselves and `make image` says why.
NODE_DEBS = runc containernetworking-plugins busybox-static iptables iproute2 buildah debootstrap
node-prereqs:
	@missing=""; for pkg in $(NODE_DEBS); do dpkg -s $$pkg >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then echo "not root: not installing$$missing (the real-node tests and make image need them)"; exit 0; fi; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing

# etcd, kube-apiserver/scheduler/controller-manager/kubectl/kubelet, helm, the OpenTelemetry
# Collector (ocb), Jaeger and containerd (the node tests), all from Go modules into ~/.cache/otel-dra
# (each skipped when already built), and the node's locally made images.
peers: install node-prereqs
	$(BIN)/otel-dra testbed build --helm --otelcol --jaeger --node

# The project's image from the Dockerfile, without a registry or daemon: buildah (vfs, chroot) on a
# local Debian base with Python 3.11 (debootstrap, cached by its recipe's digest), written as an OCI
# archive under ~/.cache/otel-dra/images (rebuilt only when the Dockerfile or a file it copies
# changed). Root. Load it into a testbed node with
# `otel-dra testbed image --dir D --node n1`; with a registry, build as usual (docs/deploy.md, "Container image").
image: install node-prereqs
	$(BIN)/otel-dra testbed image

# Python gRPC stubs under otel_dra/_generated from proto/ (committed; tests/unit/test_protos.py
# fails when they drift from the .proto files).
protos: install
	$(BIN)/python proto/generate.py

# ruff, mypy, and the import contracts of pyproject.toml ([tool.importlinter]: which layer may
# import which, see "Where things live" in docs/design.md).
lint: install
	$(BIN)/ruff check otel_dra tests bench proto
	$(BIN)/ruff format --check otel_dra tests bench proto
	$(BIN)/mypy
	$(BIN)/lint-imports

test-unit: install
	$(BIN)/pytest -m "not testbed" $(PYTEST_ARGS)

# The one-minute check while you work (55 s on 2 cores, warm, measured while a CI run shared them):
# lint as `make lint` does, then the unit tests (tests/unit) without the fuzz suite or the testbed.
# `make test` runs all of it.
test-quick: lint
	$(BIN)/pytest -m "not testbed and not fuzz" tests/unit $(PYTEST_ARGS)

# The fuzz suite (tests/fuzz) at depth: 100,000 examples per watched kind and property, and for the
# plugin's RPCs (hours on 2 cores). `make test` and `make test-unit` run it with the CI profile (2,000
# per kind); HYPOTHESIS_PROFILE=dev is a quick run of 200.
fuzz: install
	HYPOTHESIS_PROFILE=deep $(BIN)/pytest -m fuzz tests/fuzz $(PYTEST_ARGS)

# The fault-injection suite (tests/faults, marker `faults`; part of `make test`): kube-apiserver killed
# and restarted, a watch resumed after etcd compaction (410), priority-and-fairness throttling (429
# with Retry-After) and a slow link, the OTLP endpoint down, black-holed and answering 503, the plugin
# SIGKILLed between prepare and unprepare, a truncated checkpoint, a read-only or full CDI directory.
test-faults: peers
	$(BIN)/pytest -m faults tests/faults $(PYTEST_ARGS)

# Regenerate the golden expositions (tests/golden/*.prom) from the real testbed, after a change to
# a family or to the golden objects. Review `git diff tests/golden` line by line before committing.
golden: install
	UPDATE_GOLDEN=1 $(BIN)/pytest tests/integration/test_golden.py tests/integration/test_golden_state.py $(PYTEST_ARGS)

# The whole suite: lint, then unit tests, the fuzz suite (CI profile) and integration tests against
# the real testbed.
# The fuzz suite runs in a pytest process of its own: collected together with
# tests/integration/test_kubelet_sim.py, Hypothesis once reported inconsistent data generation in
# tests/fuzz/test_fuzz_cluster.py (FlakyStrategyDefinition). The likely cause, Hypothesis' pool of
# constants from the loaded modules, and what was done about it are in tests/fuzz/conftest.py.
test: lint peers
	$(BIN)/pytest $(PYTEST_ARGS) tests/fuzz
	$(BIN)/pytest $(PYTEST_ARGS) --ignore=tests/fuzz

# The integration tests against another Kubernetes minor's control plane and kubelet (built into the
# cache the first time, about 11 minutes on 2 cores): `make test-integration KUBERNETES_MINOR=1.34`.
# `otel-dra testbed releases` lists the minors; 1.38 builds with Go 1.27 (GOTOOLCHAIN, set by the build).
KUBERNETES_MINOR ?= 1.34
test-integration: peers
	$(BIN)/otel-dra testbed build --kubernetes-version $(KUBERNETES_MINOR)
	OTEL_DRA_KUBERNETES_VERSION=$(KUBERNETES_MINOR) $(BIN)/pytest -m testbed $(PYTEST_ARGS)

# The integration tests on every supported minor, one after the other (the release table's minors).
KUBERNETES_MINORS ?= $(shell $(BIN)/otel-dra testbed releases --minors 2>/dev/null)
test-versions: peers
	@set -e; for minor in $(KUBERNETES_MINORS); do \
		echo "=== Kubernetes $$minor"; \
		$(MAKE) --no-print-directory test-integration KUBERNETES_MINOR=$$minor; \
	done

# The demo: a local control plane, simulated GPU nodes running the instrumented plugin, the kubelet
# emulator, a cycling workload, and the exporter on :8080 (plugins' metrics on :8081, :8082).
# Needs only etcd and the Kubernetes binaries, which the command builds itself when missing (not the
# Collector, Jaeger or helm that `peers` adds for the tests).
run: install
	$(BIN)/otel-dra demo

# The sandbox: a local API server with sample DRA objects and the exporter on :8080.
sandbox: install
	$(BIN)/otel-dra sandbox

bench: peers
	$(BIN)/python -m bench.exporter --claims 1000 10000 --json bench/results/exporter/exporter.json

# Issue #5's targets: 1k/10k/100k claims, churn, lag, OTLP, baseline (about 15 minutes on 2 cores).
bench-scale: peers
	$(BIN)/python -m bench.scale --claims 1000 10000 100000 --json bench/results/scale/scale.json

# Issue #3: prepare/unprepare latency through the kubelet emulator, tracing off and on.
bench-plugin: peers
	$(BIN)/python -m bench.plugin --json bench/results/plugin/plugin.json

# A real kubelet + containerd node (root; takes /tmp/otel-dra-node.flock) and the upstream Go driver,
# which the bench builds into the peer cache on first use (never part of `make peers` or CI).
bench-plugin-real: peers
	$(BIN)/python -m bench.plugin --kubelet real --json bench/results/plugin-real/plugin-real.json

# One exporter with OTLP on for 30 minutes at 10,000 claims and 200 changes/s: RSS slope after
# warm-up (target <= 1 MiB per 10 minutes), threads, fds, scrape p95 over time, and the plot.
bench-soak: peers
	$(BIN)/python -m bench.soak --claims 10000 --rate 200 --minutes 30 --json bench/results/soak/soak.json --plot bench/results/soak/soak.png

# Plain YAML for users without Helm, rendered from the chart (a test fails when they drift apart).
manifests: peers
	$(BIN)/python -m tests.render_manifests

ci: test

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
