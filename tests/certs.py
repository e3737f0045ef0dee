"""Test certificates made with the `openssl` command: a cluster CA and one certificate per node, each
naming its node by a DNS subjectAltName and its commonName (transport.auth.tls)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from transport.auth.tls import TlsFiles


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str = "zigzag-test-ca") -> tuple[Path, Path]:
    """A self-signed CA in `directory`: (its certificate, its key). Skips without `openssl`."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates")
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key.name, "-out", cert.name, "-days", "2", "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    return cert, key


def make_node_cert(directory: Path, ca: tuple[Path, Path], node: str) -> TlsFiles:
    """A certificate for `node` signed by `ca` (from `make_ca`), with the files a node is given."""
    ca_cert, ca_key = ca
    key, request, cert = directory / f"{node}.key", directory / f"{node}.csr", directory / f"{node}.crt"
    extensions = directory / f"{node}.ext"
    extensions.write_text(f"subjectAltName=DNS:{node}\n")
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key.name, "-out", request.name, "-subj", f"/CN={node}",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", request.name, "-CA", str(ca_cert), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", cert.name, "-days", "2", "-extfile", extensions.name,
        cwd=directory,
    )  # fmt: skip
    return TlsFiles(ca_file=str(ca_cert), cert_file=str(cert), key_file=str(key))
