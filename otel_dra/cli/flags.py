"""Flags backed by environment variables, and the value types every command validates them with.

Every flag of every command is declared through :func:`add_flag`, so that each has an environment
variable, the help text names it, and a bad value (flag or variable) is refused with exit code 2
and a message naming it.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


class UsageError(ValueError):
    """A flag or environment variable with an invalid value (exit code 2)."""


def add_flag(parser: argparse.ArgumentParser, flag: str, env: str, help: str, **kwargs: Any) -> None:
    """A flag whose default comes from ``env``. An invalid value in the environment is reported
    (exit 2, naming the variable) only when this subcommand runs: the plugin's generic names
    (NODE_NAME, METRICS_PORT ...) must not break other subcommands that happen to see them."""
    default = kwargs.pop("default", None)
    raw = os.environ.get(env)
    if raw is not None:
        convert = kwargs.get("type")
        choices = kwargs.get("choices")
        error = None
        if choices is not None and raw not in choices:
            error = f"environment variable {env}={raw!r}: expected one of {', '.join(choices)}"
        else:
            try:
                default = convert(raw) if convert else raw
            except argparse.ArgumentTypeError as exc:
                error = f"environment variable {env}: {exc}"
        if error is not None:
            env_errors(parser).append(error)
    parser.add_argument(flag, default=default, help=f"{help} [env {env}]", **kwargs)


def env_errors(parser: argparse.ArgumentParser) -> list[str]:
    """The environment errors collected for ``parser``'s command; ``main`` reports them once the
    command line is parsed (so only the command that runs complains)."""
    errors: list[str] | None = parser.get_default("env_errors")
    if errors is None:
        errors = []
        parser.set_defaults(env_errors=errors)
    return errors


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """``--log-format`` and ``--log-level``, which every long-running command has."""
    add_flag(parser, "--log-format", "OTEL_DRA_LOG_FORMAT", "text or json", default="text", choices=("text", "json"))
    add_flag(
        parser,
        "--log-level",
        "OTEL_DRA_LOG_LEVEL",
        "debug, info, warning, error",
        default="info",
        choices=("debug", "info", "warning", "error"),
    )


def add_kubeconfig_flag(parser: argparse.ArgumentParser) -> None:
    """``--kubeconfig``. No environment variable of its own: KUBECONFIG already is one, and is
    read with the other credential sources when the flag is absent."""
    parser.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file; default: KUBECONFIG (path list), else in-cluster, else ~/.kube/config",
    )


# --- value types (argparse ``type=``): each raises ArgumentTypeError with the reason ----------------


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value} is outside {lo}..{hi}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    raw = text.strip().removesuffix("s")
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"{text!r} must be between 0 and 86400 seconds")
    return value


def boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


# Object names the API server accepts for nodes and DRA drivers (DNS subdomains; drivers <= 63).
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def dns_subdomain(max_len: int) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip()
        if not value or len(value) > max_len or not _DNS_SUBDOMAIN.match(value):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a lowercase DNS subdomain of at most {max_len} characters"
            )
        return value

    return parse


def directory(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return Path(text).expanduser().absolute()


def http_url(text: str) -> str:
    """An ``http://`` or ``https://`` URL with a host, without its trailing slashes (a base that
    paths are appended to)."""
    value = text.strip().rstrip("/")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL (scheme, host, optional path)")
    return value
