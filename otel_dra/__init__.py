"""otel-dra: OpenTelemetry-native observability for Kubernetes Dynamic Resource Allocation."""

# The one place the version is written: pyproject.toml reads it from here (setuptools' `attr:`,
# without importing the package). A constant, not importlib.metadata.version(): that lookup scans
# the installed distributions at every start of every command (the plugin's start-up CPU, issue 12).
__version__ = "0.1.0"
