"""Certificates for TLS tests, made with the ``openssl`` command (the venv has no ``cryptography``)."""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed:\n{result.stderr.strip()}")


@dataclass(frozen=True)
class CA:
    dir: Path
    name: str

    @property
    def cert(self) -> Path:
        return self.dir / f"{self.name}.crt"

    @property
    def key(self) -> Path:
        return self.dir / f"{self.name}.key"

    def issue(self, name: str, *, san: str = "IP:127.0.0.1,DNS:localhost", client: bool = False) -> tuple[Path, Path]:
        """A leaf certificate and key (``name.crt``, ``name.key`` next to the CA's); a serving
        certificate unless ``client``. Returns (cert, key)."""
        cert, key, csr, ext = (self.dir / f"{name}.{suffix}" for suffix in ("crt", "key", "csr", "ext"))
        _openssl("req", *_EC_KEY, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}", cwd=self.dir)
        usage = "clientAuth" if client else "serverAuth"
        ext.write_text(
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
            f"extendedKeyUsage={usage}\n" + (f"subjectAltName={san}\n" if san else "")
        )
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
            "-set_serial", "0x" + secrets.token_hex(16), "-days", "2", "-extfile", str(ext), "-out", str(cert),
            cwd=self.dir,
        )  # fmt: skip
        return cert, key


def make_ca(dir: Path, name: str = "ca") -> CA:
    dir.mkdir(parents=True, exist_ok=True)
    ca = CA(dir, name)
    _openssl(
        "req", "-x509", *_EC_KEY, "-keyout", str(ca.key), "-out", str(ca.cert), "-days", "2",
        "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=dir,
    )  # fmt: skip
    return ca


def serial(cert: Path) -> int:
    """The serial number of a PEM certificate file."""
    out = subprocess.run(
        ["openssl", "x509", "-in", str(cert), "-noout", "-serial"], capture_output=True, text=True, check=True
    ).stdout
    return int(out.strip().split("=", 1)[1], 16)


def served_serial(port: int, ca: CA, host: str = "127.0.0.1") -> int:
    """The serial number of the certificate a TLS server on ``host:port`` serves (verified with ``ca``)."""
    import socket
    import ssl

    ctx = ssl.create_default_context(cafile=str(ca.cert))
    with socket.create_connection((host, port), timeout=10) as raw, ctx.wrap_socket(raw, server_hostname=host) as sock:
        der = sock.getpeercert(binary_form=True)
    assert der is not None
    path = ca.dir / f"served-{port}.pem"
    path.write_text(ssl.DER_cert_to_PEM_cert(der))
    return serial(path)
