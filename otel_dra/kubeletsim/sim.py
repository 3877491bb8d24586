"""One emulated kubelet per node, in one process."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from otel_dra.kube.client import KubeClient
from otel_dra.kubeletsim.nodes import ensure_node
from otel_dra.kubeletsim.pods import PodSync
from otel_dra.kubeletsim.registry import PluginWatcher

log = logging.getLogger(__name__)

DEFAULT_REGISTRY_DIR = Path("/var/lib/kubelet/plugins_registry")


class KubeletSim:
    """``nodes``: node name -> the registry directory its plugins register in."""

    def __init__(
        self,
        client: KubeClient,
        nodes: Mapping[str, Path],
        *,
        workers: int = 4,
        tracer: Any = None,
        on_rpc: Callable[[str, int, float], None] | None = None,
    ) -> None:
        if not nodes:
            raise ValueError("kubelet-sim needs at least one node")
        self.client = client
        self.nodes = dict(nodes)
        self.watchers = {node: PluginWatcher(node, path) for node, path in self.nodes.items()}
        self.pods = PodSync(client, self.watchers, workers=workers, tracer=tracer, on_rpc=on_rpc)

    def start(self) -> KubeletSim:
        for node in self.nodes:
            ensure_node(self.client, node)
        for watcher in self.watchers.values():
            watcher.start()
        self.pods.start()
        log.info("kubelet-sim running nodes %s", ", ".join(self.nodes))
        return self

    def stop(self) -> None:
        self.pods.stop()
        for watcher in self.watchers.values():
            watcher.stop()
