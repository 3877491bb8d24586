"""The binding-condition controller (``otel-dra binding-controller``): it plays the part of the
component that attaches a device before its pod may be bound (a fabric manager, a network
controller), which DRA models with binding conditions.

kube-scheduler allocates a device that publishes ``bindingConditions`` but holds the pod in PreBind
until each of them is True in the claim's ``status.devices`` entry for that device, and gives the
devices up when one of ``bindingFailureConditions`` turns True (or after its binding timeout). This
controller watches ResourceClaims and, for every allocation result of its driver that waits, sets
those conditions after an attachment delay, failing a deterministic fraction of them.

:mod:`otel_dra.binding.claims` decides (pure: what waits, which outcome, the apply body);
:mod:`otel_dra.binding.controller` does the I/O (watch, timers, the status writes, spans);
:mod:`otel_dra.binding.metrics` holds its instruments. Like the cluster exporter and the plugin, it
stands on :mod:`otel_dra.kube` and :mod:`otel_dra.telemetry` only; :mod:`otel_dra.cli` wires it.
"""
