"""The executor on a GPU. Skipped without one, as in CI; `.ci/gpu` runs these on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from replicas.model import (
    GREEDY,
    DecodeSequence,
    Executor,
    KVCache,
    PrefillSequence,
    SamplingParams,
    token_history,
)
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


def _generate_on(
    executor: Executor, prompts: list[list[int]], steps: int, sampling: SamplingParams = GREEDY
) -> list[list[int]]:
    cache = executor.cache
    tables = [cache.pool.allocate(cache.blocks_for(len(p) + steps), f"r{i}") for i, p in enumerate(prompts)]
    first = executor.prefill(
        [
            PrefillSequence(
                block_table=t, token_ids=p, sampling=sampling, history=token_history(sampling, p, ())
            )
            for t, p in zip(tables, prompts)
        ]
    )
    assert first.tokens is not None
    outputs = [[token] for token in first.tokens]
    for step in range(steps - 1):
        decoded = executor.decode(
            [
                DecodeSequence(
                    block_table=t,
                    cached_tokens=len(p) + step,
                    token_id=out[-1],
                    sampling=sampling,
                    history=token_history(sampling, p, out),
                )
                for t, p, out in zip(tables, prompts, outputs)
            ]
        )
        for out, token in zip(outputs, decoded.tokens):
            out.append(token)
    for index, table in enumerate(tables):
        cache.pool.free(table, f"r{index}")
    return outputs


PROMPTS = [[(7 * j + 3 * i) % 250 + 5 for j in range(n)] for i, n in enumerate([5, 23, 16, 41, 9, 30, 2])]


PENALIZED = SamplingParams(
    temperature=0.8,
    seed=5,
    repetition_penalty=1.4,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    logit_bias=((17, 2.0),),
)


@pytest.mark.parametrize("sampling", [SamplingParams(), PENALIZED], ids=["greedy", "penalized"])
@pytest.mark.parametrize("batch", [1, 3, 7])
def test_decode_graphs_replay_the_tokens_of_the_eager_kernels(
    cuda: torch.device, batch: int, sampling: SamplingParams
) -> None:
    """float32: graphs (bucket padding included) and the eager kernels give the same tokens; with
    penalties and bias too (the graph returns logits; the rows are sampled after the replay)."""
    model = tiny_model(device=cuda)
    graphs = Executor(model, KVCache.create(model.config, 64, device=cuda), cuda_graphs="auto", max_batch=8)
    assert graphs.needs_prepare
    assert graphs.prepare() == "graphs", graphs.fallbacks
    eager = Executor(model, KVCache.create(model.config, 64, device=cuda), cuda_graphs="off")
    assert eager.path == "kernels"
    prompts = PROMPTS[:batch]
    assert _generate_on(graphs, prompts, 6, sampling) == _generate_on(eager, prompts, 6, sampling)
    graphs.release()
    assert graphs.path == "kernels"


def test_a_batch_invariant_bfloat16_model_generates_in_a_batch_what_it_generates_alone(
    cuda: torch.device,
) -> None:
    """The property the demo's N/N parity rests on: in bf16, with graphs and their padded buckets."""
    model = tiny_model(dtype="bfloat16", device=cuda, batch_invariant=True)
    executor = Executor(model, KVCache.create(model.config, 64, device=cuda), cuda_graphs="auto", max_batch=8)
    assert executor.prepare() == "graphs", executor.fallbacks
    together = _generate_on(executor, PROMPTS, 8)
    alone = [_generate_on(executor, [prompt], 8)[0] for prompt in PROMPTS]
    assert together == alone


def test_the_kernels_pass_their_start_up_check_in_bfloat16_and_float32(cuda: torch.device) -> None:
    from replicas.model.gpu.check import kernels_problem

    for dtype in (torch.float32, torch.bfloat16):
        assert kernels_problem(cuda, dtype, 32, 4, 64, invariant=True) is None
        assert kernels_problem(cuda, dtype, 14, 2, 64, invariant=False) is None
