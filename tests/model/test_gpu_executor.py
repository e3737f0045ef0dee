"""The executor on a GPU. Skipped without one, as in CI; `.ci/gpu` runs these on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from replicas.model import DecodeSequence, Executor, KVCache, PrefillSequence
from replicas.model.tiny import tiny_model

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is false")
    return torch.device("cuda")


def test_bfloat16_decode_on_a_gpu_does_not_go_through_cudnn_attention(cuda: torch.device) -> None:
    """torch picks cuDNN's SDPA backend for 16-bit inputs on recent GPUs, and it builds an execution plan
    per new shape; a decode step's context grows by a token each step, so each step paid for a plan (56 ms
    a step for the tiny model on an H100, against 2 ms in float32). An executor on a GPU turns it off, and
    still decodes (8 tokens)."""
    model = tiny_model(dtype="bfloat16", device=cuda)
    cache = KVCache.create(model.config, 64, device=cuda)
    executor = Executor(model, cache)
    prompt = [(7 * j) % 200 + 5 for j in range(40)]
    table = cache.pool.allocate(cache.blocks_for(len(prompt) + 8), "r")
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        tokens = [*executor.prefill([PrefillSequence(block_table=table, token_ids=prompt)]).tokens]
        for step in range(7):
            decoded = executor.decode(
                [DecodeSequence(block_table=table, cached_tokens=len(prompt) + step, token_id=tokens[-1])]
            )
            tokens.extend(decoded.tokens)
    ops = {event.key for event in trace.key_averages()}
    assert "aten::scaled_dot_product_attention" in ops
    assert not [op for op in ops if "cudnn_attention" in op]
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert len(tokens) == 8
