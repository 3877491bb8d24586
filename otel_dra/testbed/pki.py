"""The testbed's certificates, made with the ``openssl`` command: the control plane's CA, the API
server's serving certificate and the ServiceAccount signing key, and client certificates the CA
signs (a node's kubelet identity)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path

from otel_dra.testbed.network import NODE_POD_API_IP
from otel_dra.testbed.state import TestbedError

_DAYS = "3650"
_EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise TestbedError(f"openssl {' '.join(args[:2])} failed:\n{result.stderr.strip()}")


def make_pki(pki: Path) -> None:
    """A CA, an API server serving certificate signed by it, and a ServiceAccount signing key."""
    shutil.rmtree(pki, ignore_errors=True)
    pki.mkdir(parents=True, mode=0o700)
    openssl(
        "req", "-x509", *_EC_KEY, "-keyout", "ca.key", "-out", "ca.crt", "-days", _DAYS,
        "-subj", "/CN=otel-dra-testbed-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=pki,
    )  # fmt: skip
    openssl(
        "req", *_EC_KEY, "-keyout", "apiserver.key", "-out", "apiserver.csr", "-subj", "/CN=kube-apiserver",
        cwd=pki,
    )  # fmt: skip
    # 10.0.0.1 is the `kubernetes` Service's cluster IP in SERVICE_CLUSTER_IP_RANGE; NODE_POD_API_IP
    # is where a testbed node's pods reach the API server (through otel_dra.testbed.forward).
    (pki / "apiserver.ext").write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName=IP:127.0.0.1,DNS:localhost,IP:10.0.0.1,IP:{NODE_POD_API_IP},DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc\n"
    )
    openssl(
        "x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-set_serial", "0x" + secrets.token_hex(16), "-days", _DAYS, "-extfile", "apiserver.ext",
        "-out", "apiserver.crt",
        cwd=pki,
    )  # fmt: skip
    # RSA: RS256 is the one algorithm every ServiceAccount-token consumer (OIDC discovery) accepts.
    openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", "sa.key", cwd=pki)
    openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def client_certificate(pki: Path, ca_dir: Path, *, subject: str, stem: str) -> tuple[Path, Path]:
    """A client certificate for ``subject`` (``/O=group/CN=user``) signed by the CA in ``ca_dir``:
    ``PKI/STEM.crt`` and ``PKI/STEM.key``, returned in that order."""
    openssl(
        "req", *_EC_KEY, "-keyout", f"{stem}.key", "-out", f"{stem}.csr", "-subj", subject,
        cwd=pki,
    )  # fmt: skip
    (pki / f"{stem}.ext").write_text(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
    )
    openssl(
        "x509", "-req", "-in", f"{stem}.csr", "-CA", str(ca_dir / "ca.crt"), "-CAkey", str(ca_dir / "ca.key"),
        "-set_serial", "0x" + secrets.token_hex(16), "-days", _DAYS, "-extfile", f"{stem}.ext",
        "-out", f"{stem}.crt",
        cwd=pki,
    )  # fmt: skip
    return pki / f"{stem}.crt", pki / f"{stem}.key"
