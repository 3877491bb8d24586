"""What the kubelet accepts in a DRA plugin's registration, checked before the plugin starts.

From 1.38 on the kubelet validates what a plugin's ``GetInfo`` returns before it registers the
plugin (``DRAPluginManager.ValidatePlugin`` and ``RegisterPlugin`` in
``pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go``, k8s.io/kubernetes v1.38.0-beta.0; v1.37.2 has
neither check): the driver name by the CSI driver-name rules (:func:`driver_name_problem`) and the
endpoint, our ``dra.sock``, as an absolute path under 108 bytes that URL parsing leaves unchanged
(:func:`endpoint_problem`). A refused plugin only hears so in ``NotifyRegistrationStatus`` and is
never called, so the plugin applies the same rules at start-up and refuses to start, naming the
rule and the value. The rules are the kubelet's, not stricter: what passes them registers on 1.38
(and on older kubelets, which check less). Each function is a port of the Go function named in its
comments; the Go sources are under ``$(go env GOMODCACHE)/k8s.io/kubernetes@v1.38.0-beta.0``.

One more check is about reaching the plugin rather than validating it: the kubelet dials the
registration socket it finds in its ``plugins_registry`` directory (:func:`registration_socket_problem`).

Cheap to import (the standard library only): the command line checks ``--driver-name`` with it
while parsing.
"""

from __future__ import annotations

import re
from pathlib import Path

# pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go, `const unixPathMax = 108`: the size of Linux's
# sockaddr_un.sun_path, which holds the path *and* its terminating NUL. The kubelet refuses
# `len(endpoint) >= unixPathMax` (len: bytes of the Go string, no NUL counted), so the longest
# endpoint is 107 bytes, and 107 bytes plus the NUL fill sun_path exactly.
UNIX_PATH_MAX = 108
MAX_SOCKET_PATH_BYTES = UNIX_PATH_MAX - 1

# pkg/apis/core/validation/validation.go, ValidateCSIDriverName: `len(driverName) > 63` is too long
# (bytes of the Go string).
MAX_DRIVER_NAME_BYTES = 63

# k8s.io/apimachinery/pkg/util/validation/validation.go (v0.38.0-beta.0): dns1123LabelFmt and
# dns1123SubdomainFmt, copied as they are. Go anchors them with ^...$, where $ is the end of the text;
# Python's $ would also match before a final newline, so the pattern is used with fullmatch.
_DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(_DNS1123_LABEL + r"(\." + _DNS1123_LABEL + ")*")

# Go's strings.ToLower maps each rune with unicode.ToLower (simple case mapping). Besides A-Z, the
# only runes it maps into ASCII are U+0130 (İ -> i) and U+212A (KELVIN SIGN -> k), so these are all
# the characters that ToLower can turn into what the regular expression accepts; every other
# non-ASCII character stays non-ASCII and fails it either way. (Python's str.lower() differs: it
# turns U+0130 into "i" + U+0307.)
_GO_LOWER = {**{c: c + 32 for c in range(ord("A"), ord("Z") + 1)}, 0x130: ord("i"), 0x212A: ord("k")}

# The kubelet's URL parsing (see _url_problem): characters that make Go's url.Parse fail or end the
# path, and what they are to it.
_URL_SPECIAL = {"#": "starts a fragment", "?": "starts a query", "%": "starts a percent-escape"}


def _utf8_len(text: str) -> int:
    """Bytes of ``text`` as the kubelet counts them: the length of the Go string, i.e. UTF-8 bytes
    (a path decoded with surrogateescape counts the bytes it came from)."""
    try:
        return len(text.encode("utf-8", "surrogateescape"))
    except UnicodeEncodeError:  # a lone surrogate that no byte decodes to: 3 bytes, as Go would count
        return len(text.encode("utf-8", "surrogatepass"))


def go_to_lower(text: str) -> str:
    """Go's ``strings.ToLower`` for what matters to the name rules: the same ASCII letters result."""
    return text.translate(_GO_LOWER)


def driver_name_problem(name: str) -> str | None:
    """Why the kubelet refuses ``name`` as a DRA driver name, or None.

    ``validateDriverName`` (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go) is
    ``corevalidation.ValidateCSIDriverName`` (pkg/apis/core/validation/validation.go), the rule the
    API server also applies to a ResourceSlice's ``spec.driver``: not empty, at most 63 bytes, and
    ``IsDNS1123Subdomain(strings.ToLower(name))`` (k8s.io/apimachinery/pkg/util/validation). The
    lowering makes upper case letters valid: ``GPU.Example.com`` registers.
    """
    if not name:
        return "must not be empty (kubelet: ValidateCSIDriverName)"
    problems = []
    size = _utf8_len(name)
    if size > MAX_DRIVER_NAME_BYTES:
        problems.append(f"is {size} bytes long, more than {MAX_DRIVER_NAME_BYTES}")
    # IsDNS1123Subdomain's own limit, 253 bytes, cannot fail where 63 did not.
    if not _DNS1123_SUBDOMAIN.fullmatch(go_to_lower(name)):
        problems.append(
            "is not a DNS-1123 subdomain, case aside: letters, digits, '-' and '.', "
            "starting and ending with a letter or digit, no '..' (and no '_')"
        )
    if not problems:
        return None
    return " and ".join(problems) + " (kubelet: ValidateCSIDriverName)"


def _url_problem(path: str) -> str | None:
    """How Go's ``url.Parse("unix:" + path)`` fails on, or changes, an absolute ``path``; None when
    it gives back exactly ``path``.

    net/url/url.go (Go 1.27.3), in the order it reads: ``Parse`` cuts at the first '#' (fragment);
    ``parse`` fails on a control byte (``stringContainsCTLByte``: below 0x20, or 0x7f), takes
    "unix" as the scheme, cuts at the first '?' (query), takes a leading "//" as an authority (host)
    and ``setPath`` percent-decodes the rest (``unescape``: a malformed escape fails, a valid one is
    decoded, so '%' always changes the path). Nothing else alters a path that starts with a single
    '/': '..', '//' inside, a trailing '/', spaces, '+' and non-ASCII letters all stay as they are,
    so the kubelet accepts them.
    """
    for char in path:
        if ord(char) < 0x20 or ord(char) == 0x7F:
            return f"contains the control character {char!r}, which URL parsing refuses"
        if char in _URL_SPECIAL:
            return f"contains {char!r}, which {_URL_SPECIAL[char]} in a URL"
    if path.startswith("//"):
        return "starts with '//', which starts a host in a URL"
    return None


def endpoint_problem(endpoint: str) -> str | None:
    """Why the kubelet refuses ``endpoint`` (the path of dra.sock a plugin registers), or None.

    ``validateEndpoint`` (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go), rule by rule, in its
    order:
    """
    # `endpoint == ""`. (The kubelet's plugin manager puts the registration socket's path in an
    # empty endpoint before validating it, so a plugin never meets this one; kept for the port.)
    if endpoint == "":
        return "must not be empty (kubelet: validateEndpoint)"
    # `!filepath.IsAbs(endpoint)`: on Linux, IsAbs is `strings.HasPrefix(path, "/")`.
    if not endpoint.startswith("/"):
        return "must be an absolute path (kubelet: validateEndpoint)"
    # `len(endpoint) >= unixPathMax`.
    size = _utf8_len(endpoint)
    if size >= UNIX_PATH_MAX:
        return (
            f"is {size} bytes long; the kubelet takes at most {MAX_SOCKET_PATH_BYTES} "
            f"(sun_path is {UNIX_PATH_MAX} bytes with the NUL) (kubelet: validateEndpoint)"
        )
    # `u, err := url.Parse("unix:" + endpoint)`; refused when err != nil, u.Host, u.RawQuery or
    # u.Fragment is set, or when u.Path (u.Opaque when empty: never, for a path starting with '/')
    # differs from the endpoint ("must be a plain path"): gRPC dials what url.Parse gives.
    problem = _url_problem(endpoint)
    if problem is not None:
        return f"must be a plain path: it {problem} (kubelet: validateEndpoint)"
    return None


def registration_socket_problem(path: str) -> str | None:
    """Why the kubelet could not reach a registration socket at ``path``, or None.

    Not a validation: the kubelet dials the socket it finds (``dial`` in
    pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go) with grpc-go, which turns the
    path into the target ``passthrough:///<path>`` and dials that URL's path (``parseTarget`` in
    google.golang.org/grpc clientconn.go; Go's url.Parse as for the endpoint, so the same
    characters change it), through Go's ``net`` package, which refuses a path that leaves no room
    for the NUL in sun_path (``SockaddrUnix.sockaddr`` in syscall/syscall_linux.go). The same holds
    for the path as the plugin spells it when ``--kubelet-registrar-directory-path`` is the
    kubelet's ``plugins_registry`` directory itself.
    """
    size = _utf8_len(path)  # the file name's bytes (os.fsencode, with a UTF-8 file system encoding)
    if size >= UNIX_PATH_MAX:
        return (
            f"is {size} bytes long; the kubelet can dial at most {MAX_SOCKET_PATH_BYTES} "
            f"(sun_path is {UNIX_PATH_MAX} bytes with the NUL)"
        )
    # Only the characters matter here: a leading '//' makes grpc-go's target an authority and path
    # that still name the same file.
    for char in path:
        if ord(char) < 0x20 or ord(char) == 0x7F or char in _URL_SPECIAL:
            return f"contains {char!r}, which the kubelet's gRPC dial parses as URL syntax"
    return None


def dra_socket(plugins_dir: Path, driver_name: str) -> Path:
    """The DRA service socket: the endpoint the plugin registers."""
    return plugins_dir / driver_name / "dra.sock"


def registration_socket(registrar_dir: Path, driver_name: str) -> Path:
    """The socket the kubelet's plugin watcher finds (the upstream drivers' name for it)."""
    return registrar_dir / f"{driver_name}-reg.sock"


def startup_problem(driver_name: str, plugins_dir: Path, registrar_dir: Path) -> str | None:
    """The first reason the kubelet would refuse or could not reach this plugin, naming the flag,
    its value and the rule; None when it would register it. The driver name comes first: the two
    paths are made from it."""
    problem = driver_name_problem(driver_name)
    if problem is not None:
        return f"--driver-name {driver_name!r} {problem}"
    endpoint = str(dra_socket(plugins_dir, driver_name))
    try:
        # Not the kubelet's rule but the wire's: PluginInfo.endpoint is a protobuf string, which
        # must be UTF-8, so a path that is not (undecodable bytes in a directory name) cannot be sent.
        endpoint.encode("utf-8")
    except UnicodeEncodeError:
        problem = "is not valid UTF-8, which the registration (a protobuf string) requires"
    else:
        problem = endpoint_problem(endpoint)
    if problem is not None:
        return f"--kubelet-plugins-directory-path {str(plugins_dir)!r}: the DRA endpoint {endpoint!r} {problem}"
    socket = str(registration_socket(registrar_dir, driver_name))
    problem = registration_socket_problem(socket)
    if problem is not None:
        return (
            f"--kubelet-registrar-directory-path {str(registrar_dir)!r}: the registration socket {socket!r} {problem}"
        )
    return None
