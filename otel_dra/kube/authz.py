"""``--authorization=kubernetes``: who may read ``/metrics``, decided by the API server.

As kube-rbac-proxy and controller-runtime's metrics filter do it: the scraper's bearer token is
checked with a TokenReview (authentication.k8s.io/v1), and the user it names with a
SubjectAccessReview (authorization.k8s.io/v1) for verb ``get`` on the non-resource URL
``/metrics``. Grant it with a ClusterRole rule ``nonResourceURLs: ["/metrics"], verbs: ["get"]``.

Answers are cached per token (by its SHA-256, never the token itself): an allowed token for
``allow_ttl`` (2 minutes by default), a rejected or forbidden one for ``deny_ttl`` (30 s), so a
scraper every few seconds costs two API calls per ``allow_ttl``, not two per scrape. Concurrent
first requests with one token share one review. An API error is not cached: the request is answered
503 and the next one asks again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from otel_dra.kube.client import ApiError, KubeClient

log = logging.getLogger(__name__)

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
SUBJECT_ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


class ReviewUnavailable(RuntimeError):
    """The API server could not review the token now (unreachable, or refused the review itself)."""


@dataclass(frozen=True)
class Review:
    """What the API server said of a token: ``authenticated`` (TokenReview) and ``allowed``
    (SubjectAccessReview); ``user`` is the authenticated user name, ``reason`` the API's words."""

    authenticated: bool
    allowed: bool
    user: str = ""
    reason: str = ""


class TokenReviewer:
    """One TokenReview and, for an authenticated token, one SubjectAccessReview per :meth:`review`."""

    def __init__(
        self,
        client: KubeClient,
        *,
        path: str = "/metrics",
        verb: str = "get",
        audiences: Sequence[str] = (),
        timeout: tuple[float, float] = (5.0, 10.0),
    ) -> None:
        self._client = client
        self._path = path
        self._verb = verb
        self._audiences = list(audiences)
        self._timeout = timeout
        self.api_calls = 0  # requests sent to the API server (for tests and debugging)

    def review(self, token: str) -> Review:
        spec: dict[str, Any] = {"token": token}
        if self._audiences:
            spec["audiences"] = self._audiences
        status = self._create(
            TOKEN_REVIEWS, {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": spec}
        )
        if not status.get("authenticated"):
            return Review(False, False, reason=str(status.get("error") or "token not authenticated"))
        user = status.get("user") or {}
        name = str(user.get("username") or "")
        sar_spec: dict[str, Any] = {
            "user": name,
            "groups": list(user.get("groups") or []),
            "nonResourceAttributes": {"path": self._path, "verb": self._verb},
        }
        if user.get("uid"):
            sar_spec["uid"] = user["uid"]
        if user.get("extra"):
            sar_spec["extra"] = user["extra"]
        sar = self._create(
            SUBJECT_ACCESS_REVIEWS,
            {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview", "spec": sar_spec},
        )
        allowed = bool(sar.get("allowed")) and not sar.get("denied")
        reason = str(sar.get("reason") or sar.get("evaluationError") or "")
        if not allowed and not reason:
            reason = f"{name} may not {self._verb} {self._path}"
        return Review(True, allowed, name, reason)

    def _create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.api_calls += 1
        try:
            answer = json.loads(self._client.request("POST", path, body=body, timeout=self._timeout).data)
        except ApiError as exc:
            hint = ""
            if exc.status == 403:
                kind = body["kind"].lower() + "s"
                hint = f" (this identity needs `create` on {body['apiVersion'].split('/')[0]} {kind})"
            raise ReviewUnavailable(f"{body['kind']}: {exc}{hint}") from exc
        except ValueError as exc:  # not JSON
            raise ReviewUnavailable(f"{body['kind']}: unreadable answer: {exc}") from exc
        status = answer.get("status") if isinstance(answer, dict) else None
        return status if isinstance(status, dict) else {}


class ReviewCache:
    """Remembers :class:`Review` answers per token: allowed ones for ``allow_ttl`` seconds, the
    others for ``deny_ttl``; at most ``max_entries`` tokens (the least recently used go first)."""

    def __init__(
        self,
        review: Callable[[str], Review],
        *,
        allow_ttl: float = 120.0,
        deny_ttl: float = 30.0,
        max_entries: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._review = review
        self._allow_ttl = allow_ttl
        self._deny_ttl = deny_ttl
        self._max = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, tuple[float, Review]] = OrderedDict()
        self._inflight: dict[bytes, threading.Event] = {}
        self.reviews = 0  # reviews asked of the API server (for tests and debugging)

    def __call__(self, token: str) -> Review:
        key = hashlib.sha256(token.encode()).digest()
        while True:
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None and entry[0] > self._clock():
                    self._entries.move_to_end(key)
                    return entry[1]
                waiting = self._inflight.get(key)
                if waiting is None:
                    done = self._inflight[key] = threading.Event()
                    self.reviews += 1
                    break
            waiting.wait()  # another request is reviewing this token; then read its answer
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    return entry[1]
            # its review failed: try ourselves
        try:
            result = self._review(token)
            ttl = self._allow_ttl if result.allowed else self._deny_ttl
            with self._lock:
                self._entries[key] = (self._clock() + ttl, result)
                self._entries.move_to_end(key)
                while len(self._entries) > self._max:
                    self._entries.popitem(last=False)
            return result
        finally:
            with self._lock:
                del self._inflight[key]
            done.set()


class KubernetesAuthorizer:
    """A :class:`TokenReviewer` behind a :class:`ReviewCache`: ``authorizer(token)`` is a Review."""

    def __init__(
        self,
        client: KubeClient,
        *,
        allow_ttl: float = 120.0,
        deny_ttl: float = 30.0,
        path: str = "/metrics",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.reviewer = TokenReviewer(client, path=path)
        self.cache = ReviewCache(self.reviewer.review, allow_ttl=allow_ttl, deny_ttl=deny_ttl, clock=clock)

    def __call__(self, token: str) -> Review:
        return self.cache(token)

    @property
    def api_calls(self) -> int:
        return self.reviewer.api_calls
