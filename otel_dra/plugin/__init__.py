"""An example DRA kubelet plugin, instrumented with OpenTelemetry metrics and traces.

Split like kubernetes-sigs/dra-example-driver: device profiles (:mod:`.devices`, :mod:`.nvml`),
CDI spec files (:mod:`.cdi`) with what each device sets from the claim's opaque configuration
(:mod:`.config`), the checkpoint of prepared claims (:mod:`.checkpoint`), prepare and
unprepare (:mod:`.driver`), ResourceSlice publishing (:mod:`.slices`), the kubelet-facing gRPC
servers (:mod:`.server`) and what the kubelet accepts in their registration
(:mod:`.registration`). It is given a KubeClient and telemetry providers; only
:mod:`otel_dra.cli` wires the parts together.
"""
