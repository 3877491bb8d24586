"""``otel-dra kubelet-sim``: plays the kubelet's DRA part for nodes that have no kubelet.

A real kubelet needs a container runtime and cgroups; this emulator does only what DRA drivers see
of it, over their real gRPC sockets, so the example plugin can be driven end to end against a real
API server, kube-scheduler and kube-controller-manager:

- it creates Ready Node objects (``nodes``);
- it discovers plugins in each node's registry directory (``registry``: GetInfo, then
  NotifyRegistrationStatus), as the kubelet's plugin watcher does;
- it watches the pods bound to its nodes (``pods``): before "starting" a pod it calls
  NodePrepareResources for the pod's claims not yet prepared on the node and then reports the pod
  Running; when the pod is being deleted it calls NodeUnprepareResources for the claims no other
  pod there uses, removes the pod from the claims' ``reservedFor`` and finishes the deletion.

tests/integration/test_node.py runs one pod scenario here and on a real kubelet and checks that the
plugin gets the same calls from both.
"""

from otel_dra.kubeletsim.nodes import ensure_node
from otel_dra.kubeletsim.pods import PodSync
from otel_dra.kubeletsim.registry import PluginWatcher

__all__ = ["PluginWatcher", "PodSync", "ensure_node"]
