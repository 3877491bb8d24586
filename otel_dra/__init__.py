"""otel-dra: OpenTelemetry-native observability for Kubernetes Dynamic Resource Allocation."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("otel-dra")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"
