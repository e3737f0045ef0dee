"""Fixtures of the end-to-end node tests: real `python -m engine.node` processes and reference models.

Node starts cost seconds (a fresh Python importing torch), so the nodes that several modules share are
session-scoped, and every test that uses one leaves it as it found it: replicas serving, unlocked, no
request live. The function-scoped fixtures check that before each test (`NodeProcess.check_ready`), so
a test that breaks a shared node fails its successors at once instead of letting each time out. A
test whose steps cannot be undone (a replica that fails, a role change, the node's shutdown) starts its
own node.

- `tiny_inproc_node`: tiny model, inproc transport, prefill=1 decode=2, 4 KiB request lines, 16 queued
  replies per client and 40 live requests (so the bad-input tests can reach these limits cheaply);
- `tiny_tcp_node`: tiny model, loopback TCP transport, prefill=2 decode=3 (state machine and Lock).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from replicas.model import Model, load_model, tiny_model
from tests.node.harness import NodeProcess, node_process

MAX_LINE_BYTES = 4096
MAX_OUTBOUND_REPLIES = 16
MAX_QUEUE = 40  # above the 32 concurrent requests of the identity test


@pytest.fixture(scope="session")
def tiny() -> Model:
    """The model the node serves as `tiny`, built here the same way (same seed, same weights)."""
    return tiny_model()


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random tiny Llama and Qwen2 checkpoints (safetensors + tokenizer.json), as the model tests make."""
    from tests.model.helpers import build_hf_model

    root = tmp_path_factory.mktemp("hf-checkpoints")
    for seed, kind in enumerate(("llama", "qwen2"), start=1):
        build_hf_model(kind, root / kind, seed=seed)
    return {"llama": root / "llama", "qwen2": root / "qwen2"}


@pytest.fixture(scope="session")
def hf_models(hf_dirs: dict[str, Path]) -> dict[str, Model]:
    return {kind: load_model(directory) for kind, directory in hf_dirs.items()}


@pytest.fixture
def tiny_inproc_node(tiny_inproc_process: NodeProcess) -> NodeProcess:
    tiny_inproc_process.check_ready()
    return tiny_inproc_process


@pytest.fixture
def tiny_tcp_node(tiny_tcp_process: NodeProcess) -> NodeProcess:
    tiny_tcp_process.check_ready()
    return tiny_tcp_process


@pytest.fixture(scope="session")
def tiny_inproc_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with node_process(
        tmp_path_factory.mktemp("tiny-inproc"),
        "--replicas",
        "prefill=1,decode=2",
        "--transport",
        "inproc",
        "--max-line-bytes",
        str(MAX_LINE_BYTES),
        "--max-outbound-replies",
        str(MAX_OUTBOUND_REPLIES),
        "--max-queue",
        str(MAX_QUEUE),
    ) as node:
        yield node


@pytest.fixture(scope="session")
def tiny_tcp_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with node_process(
        tmp_path_factory.mktemp("tiny-tcp"), "--replicas", "prefill=2,decode=3", "--transport", "tcp"
    ) as node:
        yield node
