"""The validating admission webhook for the example driver's opaque device configuration
(``otel-dra webhook``): claims, claim templates and device classes whose ``GpuConfig`` the plugin
could not decode at prepare are rejected when they are created or changed, with the reason prepare
would give.

:mod:`otel_dra.admission.review` decodes an ``admission.k8s.io/v1`` AdmissionReview and judges it
(pure: no I/O, no telemetry), with the plugin's own decoder (:mod:`otel_dra.plugin.config`, the one
import of the plugin allowed here: pyproject.toml's layer contract names it);
:mod:`otel_dra.admission.server` serves it over HTTPS on the project's connection engine
(:mod:`otel_dra.telemetry.httpserver`); :mod:`otel_dra.admission.metrics` holds its instruments.
:mod:`otel_dra.cli` wires it.
"""
