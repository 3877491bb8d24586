"""An ``admission.k8s.io/v1`` AdmissionReview: decoded, judged and answered (pure).

What is judged: every opaque configuration entry of ``driver`` in the object under review,
``spec.devices.config[]`` of a ResourceClaim, ``spec.spec.devices.config[]`` of a
ResourceClaimTemplate, ``spec.config[]`` of a DeviceClass (``resource.k8s.io``, any version: the
three have the same shape in v1beta1, v1beta2 and v1), must decode with the plugin's decoder
(:func:`otel_dra.plugin.config.parse_gpu_config`, the one prepare uses), else the review is denied
(code 422, reason ``Invalid``) with a message that names each bad entry and gives the decoder's
reason in the words prepare uses. Entries of other drivers, and entries that are not ``opaque``
(a kind of configuration a newer API may add, which other admission may judge), pass. For a device
profile that takes no opaque parameters (the plugin's cpu and net), every entry of the driver is
refused, as prepare refuses it (:func:`otel_dra.plugin.config.refuse_configs`).

An UPDATE is judged on the entries it brings: one equal to an entry of the old object passes as it
passed before. An object created before the webhook with a bad configuration can still have its
labels, annotations or finalizers changed (the claim controller removes its finalizer on delete, a
write that must not be refused), but a change of its configuration must be a good one. DELETE and
CONNECT have no object to judge, nor do subresources (``status``): all are allowed.

A body that is not an AdmissionReview (not JSON, another apiVersion or kind, no ``request``, no
``uid``) raises :class:`ReviewError`: the server answers 400 with its message, never a verdict.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from otel_dra.plugin.config import ConfigError, parse_gpu_config, refuse_configs
from otel_dra.records import record

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
GROUP = "resource.k8s.io"

CLAIM = "ResourceClaim"
TEMPLATE = "ResourceClaimTemplate"
CLASS = "DeviceClass"
OTHER = "other"  # a kind the webhook does not judge (the webhook configuration sends it by mistake)
KINDS = (CLAIM, TEMPLATE, CLASS)

ALLOWED = "allowed"
DENIED = "denied"
VERDICTS = (ALLOWED, DENIED)

# Where each kind keeps its configuration entries.
CONFIG_PATHS: Mapping[str, tuple[str, ...]] = {
    CLAIM: ("spec", "devices", "config"),
    TEMPLATE: ("spec", "spec", "devices", "config"),
    CLASS: ("spec", "config"),
}

# Operations whose object is judged.
JUDGED_OPERATIONS = ("CREATE", "UPDATE")

# A denial's message lists at most this many entries, then says how many more, each reason cut to
# MAX_REASON characters.
MAX_LISTED = 8
MAX_REASON = 300


class ReviewError(ValueError):
    """The body is not an admission.k8s.io/v1 AdmissionReview with a request; the message says why."""


@record(frozen=True)
class Review:
    """What the webhook reads of an AdmissionReview's request."""

    uid: str
    kind: str  # one of KINDS, or OTHER
    operation: str
    namespace: str = ""
    name: str = ""
    sub_resource: str = ""
    object: Any = None
    old_object: Any = None

    @property
    def what(self) -> str:
        """For logs: ``ResourceClaim team-a/gpu`` (no name for a generateName create)."""
        name = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.kind} {name or '(generated name)'}"


@record(frozen=True)
class Verdict:
    allowed: bool
    message: str = ""
    checked: int = 0  # entries of the driver that were decoded

    @property
    def name(self) -> str:
        return ALLOWED if self.allowed else DENIED


def decode_review(body: bytes) -> Review:
    """The request of an AdmissionReview body; :class:`ReviewError` for anything else."""
    try:
        doc = json.loads(body)
    except RecursionError:  # nesting deeper than the interpreter's stack: never an AdmissionReview
        raise ReviewError("body is not JSON: nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ReviewError(f"body is not JSON: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except ValueError as exc:  # JSONDecodeError, and an integer of more digits than int() takes
        raise ReviewError(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ReviewError(f"body is a JSON {_json_type(doc)}, not an AdmissionReview object")
    if doc.get("apiVersion") != API_VERSION or doc.get("kind") != KIND:
        raise ReviewError(
            f"body is {doc.get('apiVersion')!r}/{doc.get('kind')!r}, not an {API_VERSION} {KIND} "
            "(set admissionReviewVersions: [v1] in the webhook configuration)"
        )
    request = doc.get("request")
    if not isinstance(request, dict):
        raise ReviewError(f"{KIND} has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ReviewError(f"{KIND} request has no uid")
    operation = request.get("operation")
    if not isinstance(operation, str) or not operation:
        raise ReviewError(f"{KIND} request has no operation")
    kind = request.get("kind")
    if not isinstance(kind, dict):
        raise ReviewError(f"{KIND} request has no kind object")
    name = kind.get("kind")
    judged = kind.get("group") == GROUP and name in KINDS
    return Review(
        uid=uid,
        kind=str(name) if judged else OTHER,
        operation=operation,
        namespace=_string(request.get("namespace")),
        name=_string(request.get("name")),
        sub_resource=_string(request.get("subResource")),
        object=request.get("object"),
        old_object=request.get("oldObject"),
    )


def judge(review: Review, driver: str, gpu_config: bool = True) -> Verdict:
    """Whether the object under review may be stored: see the module's notes. ``gpu_config``
    False: the driver's device profile takes no opaque parameters at all (the plugin's cpu and net
    profiles), so every entry of the driver is refused, as prepare refuses it."""
    if review.kind == OTHER or review.operation not in JUDGED_OPERATIONS or review.sub_resource:
        return Verdict(True)
    path = CONFIG_PATHS[review.kind]
    where = ".".join(path)
    entries = _entries(review.object, path)
    if entries is None:
        return Verdict(False, f"{where} must be a list")
    # The old object's entries, as canonical JSON: a set, so that a hostile review of two huge lists
    # costs their length, not its square.
    known = set()
    if review.operation == "UPDATE":
        known = {_canonical(e) for e in _entries(review.old_object, path) or []} - {""}
    problems: list[str] = []
    checked = 0
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping):
            problems.append(f"{where}[{i}]: must be an object")
            continue
        opaque = entry.get("opaque")
        if opaque is None:
            continue  # not opaque: a kind of configuration this driver does not define
        if not isinstance(opaque, Mapping):
            problems.append(f"{where}[{i}].opaque: must be an object")
            continue
        if opaque.get("driver") != driver or (known and _canonical(entry) in known):
            continue
        checked += 1
        try:
            if gpu_config:
                parse_gpu_config(opaque.get("parameters"))
            else:
                refuse_configs([entry], driver)
        except ConfigError as exc:
            # refuse_configs names the entry as prepare does ("config[0]: ..."); ours says where.
            reason = str(exc).removeprefix("config[0]: ")
            problems.append(f"{where}[{i}].opaque.parameters (driver {driver}): {_clip(reason)}")
        except RecursionError:  # the decoder's message quotes a value nested too deeply to print
            problems.append(f"{where}[{i}].opaque.parameters (driver {driver}): nested too deeply")
    if not problems:
        return Verdict(True, checked=checked)
    listed = problems[:MAX_LISTED]
    if len(problems) > MAX_LISTED:
        listed.append(f"and {len(problems) - MAX_LISTED} more")
    return Verdict(False, "; ".join(listed), checked)


def response(uid: str, verdict: Verdict) -> bytes:
    """The AdmissionReview that answers request ``uid``."""
    answer: dict[str, Any] = {"uid": uid, "allowed": verdict.allowed}
    if not verdict.allowed:
        # The API server prefixes the message with 'admission webhook "<name>" denied the request: '
        # and answers the client with this code and reason (422 Invalid, as its own validation does).
        answer["status"] = {"status": "Failure", "code": 422, "reason": "Invalid", "message": verdict.message}
    return json.dumps({"apiVersion": API_VERSION, "kind": KIND, "response": answer}).encode()


def _entries(obj: Any, path: Sequence[str]) -> list[Any] | None:
    """The list at ``path`` of ``obj`` ([] where a level is absent or null; None where the list or a
    level above it has another type: never what the API server sends)."""
    node = obj
    for key in path:
        if node is None:
            return []
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    if node is None:
        return []
    return node if isinstance(node, list) else None


def _clip(reason: str) -> str:
    """The decoder quotes the values it refuses: a long one is cut (the API server puts the whole
    message in the client's error and in events)."""
    return reason if len(reason) <= MAX_REASON else reason[: MAX_REASON - 1] + "…"


def _canonical(value: Any) -> str:
    """One spelling of a decoded JSON value; "" for one nested too deeply to encode again (which is
    then never "known", so it is judged)."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    except RecursionError:
        return ""


def _string(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "boolean" if isinstance(value, bool) else "number"
