"""Fixtures of the model tests: the tiny model and HF checkpoints (built once per session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from replicas.model import Model, tiny_model
from tests.model.helpers import build_hf_model


@pytest.fixture(scope="session")
def tiny() -> Model:
    return tiny_model()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """name → (checkpoint directory, the HF model saved there). `llama-sharded` is the llama model saved in shards."""
    root = tmp_path_factory.mktemp("hf")
    llama = build_hf_model("llama", root / "llama", seed=1)
    qwen2 = build_hf_model("qwen2", root / "qwen2", seed=2)
    llama.save_pretrained(root / "llama-sharded", max_shard_size="60KB")
    return {
        "llama": (root / "llama", llama),
        "qwen2": (root / "qwen2", qwen2),
        "llama-sharded": (root / "llama-sharded", llama),
    }
