"""The testbed's addresses: the Service range of the control plane, the node's pod network, and
free loopback ports for whatever listens. The control plane's serving certificate and the node's
bridge must agree on where pods reach the API server, so that address lives here, below both."""

from __future__ import annotations

import contextlib
import socket

SERVICE_CLUSTER_IP_RANGE = "10.0.0.0/24"
# The pods' network: an isolated bridge with no masquerade and no routes, so pod traffic never
# leaves the machine (a CNI network is required even for host-network pods: without one the Node
# stays NotReady). The bridge holds BRIDGE_ADDRESS on the host: the kubelet's HTTP and gRPC probes
# and a Prometheus on the host reach pod IPs through it, and pods reach services the host offers on
# that address (nothing else: a pod has no default route). The address is on-link only, so nothing
# of the pods' subnet is routed anywhere but this bridge.
BRIDGE = "otel-dra0"
POD_SUBNET = "10.244.240.0/24"
BRIDGE_ADDRESS = "10.244.240.1"
# Where a node's pods reach the API server (through otel_dra.testbed.forward, listening on the
# bridge): the API server's serving certificate names it.
NODE_POD_API_IP = BRIDGE_ADDRESS


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports: all sockets are held open together so none is handed out twice."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
