"""load_credentials reads simple kubeconfigs and the in-cluster service account itself (no
``kubernetes`` import at start-up): it must give exactly what the kubernetes client's loaders give,
and leave everything else to them."""

from __future__ import annotations

import ast
import base64
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from otel_dra.kube import client as kube_client
from otel_dra.kube.client import CredentialsError, load_credentials

CA = b"-----BEGIN CERTIFICATE-----\nca\n-----END CERTIFICATE-----\n"


def _library(kubeconfig: str) -> dict[str, Any]:
    """What the kubernetes client's own loader makes of the file."""
    from kubernetes import client as k8s_client
    from kubernetes import config as k8s_config

    cfg = k8s_client.Configuration()
    k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    headers = {s["key"]: s["value"] for s in cfg.auth_settings().values() if s.get("in") == "header" and s.get("value")}
    return {
        "host": cfg.host.rstrip("/"),
        "ca": cfg.ssl_ca_cert and Path(cfg.ssl_ca_cert).read_bytes(),
        "cert": cfg.cert_file and Path(cfg.cert_file).read_bytes(),
        "key": cfg.key_file and Path(cfg.key_file).read_bytes(),
        "verify": bool(cfg.verify_ssl),
        "tls_server_name": getattr(cfg, "tls_server_name", None),
        "headers": headers,
    }


def _ours(kubeconfig: str) -> dict[str, Any]:
    creds = kube_client._simple_kubeconfig(kubeconfig, "test")
    assert creds is not None, "the fast path should take this kubeconfig"
    return {
        "host": creds.host,
        "ca": creds.ca_file and Path(creds.ca_file).read_bytes(),
        "cert": creds.cert_file and Path(creds.cert_file).read_bytes(),
        "key": creds.key_file and Path(creds.key_file).read_bytes(),
        "verify": creds.verify,
        "tls_server_name": creds.tls_server_name,
        "headers": creds.auth_headers(),
    }


def _write(path: Path, cluster: dict[str, Any], user: dict[str, Any] | None) -> str:
    config: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "other", "cluster": {"server": "https://wrong:1"}}, {"name": "c", "cluster": cluster}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", **({"user": "u"} if user is not None else {})}}],
        "current-context": "ctx",
    }
    if user is not None:
        config["users"] = [{"name": "u", "user": user}]
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.parametrize(
    ("cluster", "user"),
    [
        # The testbed's admin kubeconfig: inline CA, bearer token.
        (
            {"server": "https://127.0.0.1:6443/", "certificate-authority-data": base64.b64encode(CA).decode()},
            {"token": "t0k"},
        ),
        # A node's kubeconfig: files relative to the kubeconfig's directory, client certificate.
        (
            {"server": "https://127.0.0.1:6443", "certificate-authority": "pki/ca.crt", "tls-server-name": "api"},
            {"client-certificate": "pki/node.crt", "client-key": "pki/node.key"},
        ),
        ({"server": "https://h:1", "insecure-skip-tls-verify": True}, {"tokenFile": "pki/token"}),
        ({"server": "http://127.0.0.1:8080"}, None),
        (
            {"server": "https://h:1", "certificate-authority": "pki/ca.crt"},
            {
                "client-certificate-data": base64.b64encode(b"CERT").decode(),
                "client-key-data": base64.b64encode(b"KEY").decode(),
            },
        ),
    ],
)
def test_simple_kubeconfigs_read_like_the_kubernetes_client(tmp_path: Path, cluster: dict[str, Any], user: Any) -> None:
    (tmp_path / "pki").mkdir()
    for name, content in (("ca.crt", CA), ("node.crt", b"CERT"), ("node.key", b"KEY"), ("token", b"file-token")):
        (tmp_path / "pki" / name).write_bytes(content)
    path = _write(tmp_path / "kubeconfig", cluster, user)
    assert _ours(path) == _library(path)
    assert load_credentials(path).source == f"--kubeconfig {path}"


def test_other_kubeconfigs_go_to_the_kubernetes_client(tmp_path: Path) -> None:
    exec_user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "true"}}
    path = _write(tmp_path / "exec", {"server": "https://h:1", "insecure-skip-tls-verify": True}, exec_user)
    assert kube_client._simple_kubeconfig(path, "x") is None
    basic = _write(tmp_path / "basic", {"server": "http://h:1"}, {"username": "a", "password": "b"})
    assert kube_client._simple_kubeconfig(basic, "x") is None
    # The library's answer for basic auth: taken when the fast path declines.
    assert load_credentials(basic).auth_headers() == {"authorization": "Basic " + base64.b64encode(b"a:b").decode()}
    assert kube_client._simple_kubeconfig(f"{basic}{os.pathsep}{path}", "x") is None  # several files: merged there
    missing = _write(
        tmp_path / "missing", {"server": "https://h:1", "certificate-authority": "nope.crt"}, {"token": "t"}
    )
    assert kube_client._simple_kubeconfig(missing, "x") is None
    with pytest.raises(CredentialsError, match=r"nope\.crt"):
        load_credentials(missing)
    (tmp_path / "broken").write_text("current-context: [\n")
    assert kube_client._simple_kubeconfig(str(tmp_path / "broken"), "x") is None
    with pytest.raises(CredentialsError, match="cannot load Kubernetes credentials"):
        load_credentials(str(tmp_path / "broken"))


def test_in_cluster_service_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("first")
    ca.write_bytes(CA)
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    creds = kube_client._in_cluster(env, token, ca)
    assert creds is not None
    assert (creds.host, creds.ca_file, creds.verify) == ("https://[fd00::1]:443", str(ca), True)
    assert creds.auth_headers() == {"authorization": "bearer first"}  # the kubernetes loader's spelling
    token.write_text("rotated")
    assert creds.auth_headers() == {"authorization": "bearer first"}  # re-read once a minute, not per request
    monkeypatch.setattr(kube_client, "IN_CLUSTER_TOKEN_REFRESH", 0.0)
    assert creds.auth_headers() == {"authorization": "bearer rotated"}
    token.write_text("")
    assert kube_client._in_cluster(env, token, ca) is None  # an empty token: the library's error


def _imported_after(code: str, *args: str) -> list[str]:
    """The unwanted modules a fresh interpreter has imported after ``code``."""
    unwanted = (
        "print(sorted(m for m in sys.modules if m == 'yaml' or m.startswith(('kubernetes', 'otel_dra.testbed', "
        "'otel_dra.kubeletsim', 'otel_dra.cluster', 'otel_dra.cli.demo', 'otel_dra.cli.testbed'))))"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", f"import sys\n{code}\n{unwanted}", *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    return list(ast.literal_eval(out.stdout))


# What `otel-dra plugin` imports on its way to serving (cli/plugin.py's start_plugin).
_PLUGIN_PATH = """
import otel_dra.cli
otel_dra.cli.build_parser("plugin")
from otel_dra.plugin import cdi, checkpoint, devices, driver, metrics, server, slices
from otel_dra.telemetry import exposition, http, provider, tracing
from otel_dra.cli import web
"""


def test_the_plugin_in_a_pod_imports_neither_kubernetes_nor_yaml(tmp_path: Path) -> None:
    """Start-up CPU (docs/benchmarks.md, real kubelet): the kubernetes package alone was 0.36 s."""
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("t")
    ca.write_bytes(CA)
    code = (
        "from pathlib import Path\nfrom otel_dra.kube import client\n"
        "env = {'KUBERNETES_SERVICE_HOST': '10.0.0.1', 'KUBERNETES_SERVICE_PORT': '443'}\n"
        "assert client._in_cluster(env, Path(sys.argv[1]), Path(sys.argv[2])) is not None\n" + _PLUGIN_PATH
    )
    assert _imported_after(code, str(token), str(ca)) == []


def test_a_kubeconfig_needs_yaml_but_not_the_kubernetes_package(tmp_path: Path) -> None:
    path = _write(tmp_path / "kubeconfig", {"server": "https://h:1", "insecure-skip-tls-verify": True}, {"token": "t"})
    code = "from otel_dra.kube.client import load_credentials\nload_credentials(sys.argv[1])\n" + _PLUGIN_PATH
    assert _imported_after(code, path) == ["yaml"]
