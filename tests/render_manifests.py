"""Render deploy/manifests/ from the Helm chart (``make manifests``); the chart tests check that
the committed files equal a fresh render."""

from __future__ import annotations

import subprocess
from pathlib import Path

from otel_dra.testbed.build import find_helm

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "otel-dra"
OUT = ROOT / "deploy" / "manifests"
HEADER = "# Rendered from deploy/helm/otel-dra by `make manifests`; edit the chart, not this file.\n"

# file name -> extra `helm template` arguments
PROFILES = {
    "otel-dra.yaml": [],
    "otel-dra-sharded.yaml": ["--set", "sharding.enabled=true", "--set", "sharding.shards=3"],
    # The exporter plus the kubelet plugin DaemonSet (with its RBAC, admission policy, DeviceClass and
    # metrics Service) and the Grafana dashboard ConfigMap.
    "otel-dra-with-plugin.yaml": ["--set", "plugin.enabled=true", "--set", "dashboards.enabled=true"],
}


def render(helm: Path, extra: list[str]) -> str:
    out = subprocess.run(
        [
            str(helm),
            "template",
            "otel-dra",
            str(CHART),
            "--namespace",
            "monitoring",
            "--kube-version",
            "1.34.0",
            *extra,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return HEADER + out


def main() -> None:
    helm = find_helm()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, extra in PROFILES.items():
        (OUT / name).write_text(render(helm, extra))
        print(OUT / name)


if __name__ == "__main__":
    main()
