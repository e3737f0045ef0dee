"""The executor's kernel path on the tiny model: paged-attention kernels, step buffers with padded buckets,
device sampling, batch-invariant kernels. Without a GPU the Triton kernels run in Triton's interpreter
on CPU tensors (`tests/conftest.py`); `.ci/gpu` runs the same tests on a GPU, plus the graph tests in
test_gpu_executor.py."""

from __future__ import annotations

import pytest
import torch

from replicas.model import (
    DecodeSequence,
    Executor,
    KVCache,
    Model,
    PrefillSequence,
    SamplingParams,
    generate_in_one_piece,
    tiny_model,
    token_history,
)
from replicas.model.gpu.decode import KernelDecoder
from replicas.model.gpu.options import bucket_for, graph_buckets
from tests.model.helpers import allocate

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
PENALIZED = SamplingParams(
    temperature=0.8,
    seed=5,
    ignore_eos=True,
    repetition_penalty=1.4,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    logit_bias=((17, 2.0), (40, -3.0)),
)


@pytest.fixture(scope="module")
def plain() -> Model:
    return tiny_model(kernels="plain", device=DEVICE)


@pytest.fixture(scope="module")
def invariant() -> Model:
    return tiny_model(batch_invariant=True, device=DEVICE)


def _prompts() -> list[list[int]]:
    return [[(7 * j + 3 * i) % 250 + 5 for j in range(n)] for i, n in enumerate([5, 23, 16, 41])]


def _fragmented(model: Model, blocks: int) -> KVCache:
    """A cache whose free list is shuffled: every sequence gets scattered, out-of-order blocks."""
    cache = KVCache.create(model.config, blocks, device=DEVICE)
    taken = cache.pool.allocate(blocks, "shuffle")
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(3)).tolist()
    cache.pool.free([taken[i] for i in order], "shuffle")
    return cache


def _generate(
    executor: Executor, prompts: list[list[int]], steps: int, sampling: SamplingParams
) -> list[list[int]]:
    cache = executor.cache
    tables = [allocate(cache, f"r{i}", len(p) + steps) for i, p in enumerate(prompts)]
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
    return outputs


def test_graph_buckets_cover_every_batch_size_up_to_the_largest() -> None:
    assert graph_buckets(1) == (1,)
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert graph_buckets(100) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100)
    assert graph_buckets(10_000)[-1] == 256
    buckets = graph_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 3, 9, 64)] == [1, 4, 16, 64]
    assert bucket_for(65, buckets) is None
    with pytest.raises(ValueError, match=r"^graph_buckets: max_batch must be >= 1, got 0$"):
        graph_buckets(0)


def test_the_path_follows_the_device_and_the_options(plain: Model) -> None:
    cache = KVCache.create(plain.config, 8, device=DEVICE)
    torch_path = Executor(plain, cache, attention="torch")
    assert torch_path.path == "eager" and not torch_path.fallbacks
    kernels = Executor(plain, cache, attention="kernels", cuda_graphs="auto")
    assert kernels.path == "kernels" and not kernels.fallbacks
    assert kernels.needs_prepare == (DEVICE.type == "cuda")
    if DEVICE.type == "cpu":
        assert Executor(plain, cache).path == "eager"  # "auto" on CPU: torch's path
        assert kernels.prepare() == "kernels"  # nothing to capture without CUDA


@pytest.mark.parametrize(
    "sampling", [SamplingParams(ignore_eos=True), SAMPLED, PENALIZED], ids=["greedy", "sampled", "penalized"]
)
def test_the_kernel_path_generates_the_tokens_of_the_torch_path(
    plain: Model, sampling: SamplingParams
) -> None:
    """Mixed prompt lengths (one prefill launch for all), scattered blocks, batched decode steps."""
    prompts = _prompts()
    eager = _generate(Executor(plain, _fragmented(plain, 32), attention="torch"), prompts, 4, sampling)
    kernels = _generate(Executor(plain, _fragmented(plain, 32), attention="kernels"), prompts, 4, sampling)
    assert kernels == eager


def test_a_prefill_over_cached_prefixes_matches_the_torch_path(plain: Model) -> None:
    """Sequence 0 had 11 tokens prefilled before; sequence 1 is fresh: one batch, one launch per layer."""
    prompts = _prompts()
    results = []
    for attention in ("torch", "kernels"):
        executor = Executor(plain, _fragmented(plain, 16), attention=attention)  # type: ignore[arg-type]
        tables = [allocate(executor.cache, f"r{i}", len(p)) for i, p in enumerate(prompts[2:])]
        executor.prefill([PrefillSequence(block_table=tables[0], token_ids=prompts[2][:11])])
        results.append(
            executor.prefill(
                [
                    PrefillSequence(block_table=tables[0], token_ids=prompts[2][11:], cached_tokens=11),
                    PrefillSequence(block_table=tables[1], token_ids=prompts[3]),
                ]
            )
        )
    eager, kernels = results
    assert eager.logits is not None and kernels.logits is not None
    torch.testing.assert_close(kernels.logits, eager.logits, rtol=1e-4, atol=1e-4)
    assert kernels.tokens == eager.tokens


def test_padded_bucket_rows_write_no_cache_row_and_leave_real_rows_bitwise_alone(invariant: Model) -> None:
    """What a CUDA graph replays: 3 sequences in the bucket of 8. Padded rows have slot -1 and no context."""
    cache = _fragmented(invariant, 16)
    decoder = KernelDecoder(invariant, cache, max_batch=8, ops=invariant.ops)
    prompts = _prompts()[:3]
    tables = [allocate(cache, f"r{i}", len(p) + 1) for i, p in enumerate(prompts)]
    executor = Executor(invariant, cache)
    executor.prefill([PrefillSequence(block_table=t, token_ids=p) for t, p in zip(tables, prompts)])
    rows = [
        DecodeSequence(block_table=t, cached_tokens=len(p), token_id=p[-1]) for t, p in zip(tables, prompts)
    ]
    decoder.inputs.fill(rows, 8)
    sent = decoder.inputs.host_view(8)
    assert sent[2, 3:].tolist() == [-1] * 5 and sent[3, 3:].tolist() == [0] * 5
    before = [t.clone() for t in cache.storage.tensors.values()]
    padded = decoder.forward(8)
    written = {t[len(p) // 16] * 16 + len(p) % 16 for t, p in zip(tables, prompts)}
    for old, new in zip(before, cache.storage.tensors.values()):
        changed = (old != new).flatten(2).any(-1).nonzero().tolist()
        assert {block * 16 + row for block, row in changed} <= written
    decoder.inputs.fill(rows, 3)
    assert torch.equal(padded[:3], decoder.forward(3))


def test_a_batch_invariant_model_gives_a_sequence_the_same_logits_in_any_batch(invariant: Model) -> None:
    prompts = _prompts()
    alone_cache, batch_cache = _fragmented(invariant, 32), _fragmented(invariant, 32)
    alone, batch = Executor(invariant, alone_cache), Executor(invariant, batch_cache)
    table = allocate(alone_cache, "r", len(prompts[1]) + 1)
    tables = [allocate(batch_cache, f"r{i}", len(p) + 1) for i, p in enumerate(prompts)]
    first = alone.prefill([PrefillSequence(block_table=table, token_ids=prompts[1])])
    firsts = batch.prefill([PrefillSequence(block_table=t, token_ids=p) for t, p in zip(tables, prompts)])
    assert first.logits is not None and firsts.logits is not None
    assert torch.equal(first.logits[0], firsts.logits[1])
    step = alone.decode([DecodeSequence(block_table=table, cached_tokens=len(prompts[1]), token_id=9)])
    steps = batch.decode(
        [DecodeSequence(block_table=t, cached_tokens=len(p), token_id=9) for t, p in zip(tables, prompts)]
    )
    assert torch.equal(step.logits[0], steps.logits[1])


def test_a_batch_invariant_model_generates_in_a_batch_what_it_generates_in_one_piece(
    invariant: Model,
) -> None:
    prompts = _prompts()[1:3]
    batched = _generate(Executor(invariant, _fragmented(invariant, 24)), prompts, 3, SAMPLED)
    for prompt, got in zip(prompts, batched):
        assert got == generate_in_one_piece(invariant, prompt, sampling=SAMPLED, max_tokens=3)


def test_layer_ranges_on_the_kernels_equal_the_whole_at_every_split(plain: Model) -> None:
    """ZigZag's handover on the kernel path: `[0, n)` on one cache, `[n, L)` on another, the two empty
    ends included, give bit-identical logits to `[0, L)`, and no KV outside each range."""
    prompts = _prompts()[:3]
    layers = plain.config.num_layers
    whole_cache = _fragmented(plain, 24)
    tables = [allocate(whole_cache, f"r{i}", len(p)) for i, p in enumerate(prompts)]
    whole = Executor(plain, whole_cache, attention="kernels").prefill(
        [PrefillSequence(block_table=t, token_ids=p) for t, p in zip(tables, prompts)]
    )
    assert whole.logits is not None
    for split in range(layers + 1):
        first, second = (Executor(plain, _fragmented(plain, 24), attention="kernels") for _ in range(2))
        heads = [allocate(first.cache, f"r{i}", len(p)) for i, p in enumerate(prompts)]
        tails = [allocate(second.cache, f"r{i}", len(p)) for i, p in enumerate(prompts)]
        head = first.prefill(
            [PrefillSequence(block_table=t, token_ids=p) for t, p in zip(heads, prompts)],
            layers=range(0, split),
            head=False,
        )
        tail = second.prefill(
            [PrefillSequence(block_table=t, token_ids=p) for t, p in zip(tails, prompts)],
            layers=range(split, layers),
            hidden=head.hidden,
        )
        assert tail.logits is not None and torch.equal(tail.logits, whole.logits), f"split at {split}"
        if split:
            untouched = second.cache.export_kv(tails[0], len(prompts[0]), range(0, split))
            assert all(not tensor.any() for tensor in untouched.values()), "KV written outside the range"
