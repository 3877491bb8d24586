"""The API server's version (``GET /version``) and the order of Kubernetes versions.

``gitVersion`` is what a release says it is: ``v1.37.2``, ``v1.38.0-beta.0``, a build between two
tags ``v1.38.0-beta.0.123+0123456789ab``, and on managed clusters the vendor's suffix:
``v1.37.2-gke.1100``, ``v1.37.2-eks-0123456``, ``v1.37.2+k3s1``. Kubernetes orders them as semantic
versions of which only ``alpha``, ``beta`` and ``rc`` are pre-releases: ``v1.38.0-alpha.1 <
v1.38.0-beta.0 < v1.38.0-rc.0 < v1.38.0``, and every 1.38 pre-release is newer than every 1.37
release. A vendor's suffix is not a pre-release: ``v1.37.2-gke.1100`` is built from v1.37.2 and
behaves as it does (strict semver would put it before v1.37.2, and a release-dependent rule would
then take a GKE 1.37.2 for a 1.37.1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from otel_dra.kube.client import KubeClient

# major.minor.patch, then a Kubernetes pre-release (alpha, beta, rc; number optional), then
# anything (a build's commit count and hash, a vendor's suffix) that does not change the order.
_GIT_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)(?:-(alpha|beta|rc)(?:\.(\d+))?)?(?:[-+.].*)?", re.ASCII)
_STAGES = {"alpha": 0, "beta": 1, "rc": 2}
_RELEASE = 3  # after every pre-release of the same major.minor.patch


@dataclass(frozen=True, order=True)
class KubeVersion:
    """A Kubernetes version, ordered as Kubernetes orders releases (see the module notes)."""

    major: int
    minor: int
    patch: int
    stage: int = _RELEASE  # 0 alpha, 1 beta, 2 rc, 3 the release itself
    number: int = 0  # of the pre-release (beta.2: 2)
    text: str = field(default="", compare=False)  # as the server wrote it

    def __str__(self) -> str:
        return self.text or f"v{self.major}.{self.minor}.{self.patch}"


def parse_git_version(text: Any) -> KubeVersion:
    """A ``gitVersion`` as a :class:`KubeVersion`; ValueError (saying why) when it is not one.

    ``v0.0.0`` is refused too: it is what a build without version stamping reports
    (``v0.0.0-master+$Format:%H$``), which says nothing about the code it runs."""
    if not isinstance(text, str):
        raise ValueError(f"gitVersion is not a string: {text!r}")
    m = _GIT_VERSION.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"gitVersion {text!r} is not a Kubernetes version (vMAJOR.MINOR.PATCH)")
    major, minor, patch = int(m[1]), int(m[2]), int(m[3])
    if (major, minor, patch) == (0, 0, 0):
        raise ValueError(f"gitVersion {text!r} is an unversioned build")
    stage = _STAGES[m[4]] if m[4] else _RELEASE
    return KubeVersion(major, minor, patch, stage, int(m[5] or 0), text.strip())


def read_server_version(client: KubeClient) -> KubeVersion:
    """The API server's version, from ``GET /version``. Raises ApiError when the request fails
    (403 where RBAC does not allow the non-resource URL, 0 when there is no answer) and ValueError
    when the answer is not a version document."""
    answer = client.get_json("/version", timeout=(5.0, 10.0))  # json.loads: ValueError for garbage
    if not isinstance(answer, dict):
        raise ValueError(f"GET /version answered {type(answer).__name__}, not an object")
    return parse_git_version(answer.get("gitVersion"))
