"""Certificates for a local cluster — a CA, and certificates it signs — made with the `openssl` command.

For the places that start a cluster themselves: `engine.hosts` (etcd requiring client certificates,
`open_host_cluster(..., secure_etcd=True)`), the cluster demo (`--demo --nodes N --secure`) and the tests.
A production cluster brings its own CA; nothing here is used by a node.

Keys are EC P-256, unencrypted, written 0600; certificates last `days` (2 by default: these are for a
run, not for keeping). `make_certificate` names its subject by `name` (the commonName) and by the
`dns` names and `ips` given as subjectAltNames — a client that dials an address checks it against them.
With `common_name=False` the subject has no commonName (`/O=zigzag`): etcd's JSON gateway, when etcd
requires both client certificates and a user and password, refuses any client certificate with one (it
would name a user the gateway cannot pass on).
`CertificatesUnavailable` when there is no `openssl` command.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import final


@final
class CertificatesUnavailable(Exception):
    """There is no `openssl` command to make certificates with (the message says so)."""


@final
@dataclass(frozen=True, slots=True)
class Authority:
    """A CA: its certificate and its key."""

    cert_file: Path
    key_file: Path


@final
@dataclass(frozen=True, slots=True)
class Certificate:
    """A certificate signed by `ca_file`'s CA, with its key."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def openssl_missing() -> str | None:
    """Why certificates cannot be made here (None: they can)."""
    return None if shutil.which("openssl") is not None else "no openssl command to make certificates with"


def _openssl(*args: str, cwd: Path) -> None:
    why = openssl_missing()
    if why is not None:
        raise CertificatesUnavailable(why)
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(directory: Path, name: str = "zigzag-local-ca", *, days: int = 2) -> Authority:
    """A self-signed CA in `directory` (created when missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key.name, "-out", cert.name, "-days", str(days), "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    key.chmod(0o600)
    return Authority(cert, key)


def make_certificate(
    directory: Path,
    ca: Authority,
    name: str,
    *,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
    days: int = 2,
    common_name: bool = True,
) -> Certificate:
    """A certificate for `name` signed by `ca`, valid for server and client use; its subjectAltNames are
    `dns` (default: `name`) and `ips`; its subject `/CN=name`, or `/O=zigzag` without `common_name`."""
    directory.mkdir(parents=True, exist_ok=True)
    key, request, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    names = [f"DNS:{entry}" for entry in (dns or [name])] + [f"IP:{entry}" for entry in ips]
    extensions = directory / f"{name}.ext"
    extensions.write_text(
        f"subjectAltName={','.join(names)}\nextendedKeyUsage=serverAuth,clientAuth\n", encoding="ascii"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key.name, "-out", request.name, "-subj", f"/CN={name}" if common_name else "/O=zigzag",
        cwd=directory,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", request.name, "-CA", str(ca.cert_file), "-CAkey", str(ca.key_file),
        "-CAcreateserial", "-out", cert.name, "-days", str(days), "-extfile", extensions.name,
        cwd=directory,
    )  # fmt: skip
    key.chmod(0o600)
    return Certificate(ca.cert_file, cert, key)
