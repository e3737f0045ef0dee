"""Test certificates (`engine.cluster.certificates`, the `openssl` command): a cluster CA and one
certificate per node, each naming its node by a DNS subjectAltName and its commonName
(transport.auth.tls). Tests that need them skip, with the reason, where there is no `openssl`."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cluster.certificates import Authority, make_certificate, openssl_missing
from engine.cluster.certificates import make_ca as make_authority
from transport.auth.tls import TlsFiles


def make_ca(directory: Path, name: str = "zigzag-test-ca") -> tuple[Path, Path]:
    """A self-signed CA in `directory`: (its certificate, its key). Skips without `openssl`."""
    if (why := openssl_missing()) is not None:
        pytest.skip(why)
    ca = make_authority(directory, name)
    return ca.cert_file, ca.key_file


def make_node_cert(directory: Path, ca: tuple[Path, Path], node: str) -> TlsFiles:
    """A certificate for `node` signed by `ca` (from `make_ca`), with the files a node is given."""
    made = make_certificate(directory, Authority(*ca), node)
    return TlsFiles(ca_file=str(made.ca_file), cert_file=str(made.cert_file), key_file=str(made.key_file))
