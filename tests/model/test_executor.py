"""The executor's batch API on the tiny model: layer splits, KV export/import, block-table independence."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replicas.model import (
    DecodeSequence,
    Executor,
    InvalidBatchError,
    KVCache,
    Model,
    PrefillResult,
    PrefillSequence,
    SamplingParams,
    generate_in_one_piece,
    layer_buffer_names,
    layout_prompt,
)
from tests.model.helpers import allocate, generate_batch

IGNORE_EOS = SamplingParams(ignore_eos=True)


def _prompts(model: Model) -> list[list[int]]:
    assert model.tokenizer is not None
    texts = ["Hello", "The quick brown fox jumps over the lazy dog", "zigzag!", "a" * 37]
    return [model.tokenizer.encode(text) for text in texts]


def _prefill_all(
    executor: Executor,
    tables: list[list[int]],
    prompts: list[list[int]],
    layers: range | None = None,
    hidden: torch.Tensor | None = None,
) -> PrefillResult:
    sequences = [PrefillSequence(block_table=t, token_ids=p) for t, p in zip(tables, prompts)]
    return executor.prefill(sequences, layers=layers, hidden=hidden)


def test_layer_split_equals_the_whole_for_every_split_point(tiny: Model) -> None:
    """Every ZigZag handover point, the two ends included: `range(0, 0)` gives the input embeddings,
    `range(L, L)` runs only the norm and head."""
    prompts = _prompts(tiny)
    layers = tiny.config.num_layers
    whole_cache = KVCache.create(tiny.config, 32)
    whole_tables = [allocate(whole_cache, f"r{i}", len(p)) for i, p in enumerate(prompts)]
    whole = _prefill_all(Executor(tiny, whole_cache), whole_tables, prompts)
    assert whole.logits is not None
    for split in range(0, layers + 1):
        first_cache, second_cache = KVCache.create(tiny.config, 32), KVCache.create(tiny.config, 32)
        first_tables = [allocate(first_cache, f"r{i}", len(p)) for i, p in enumerate(prompts)]
        second_tables = [allocate(second_cache, f"r{i}", len(p) + 8)[::-1] for i, p in enumerate(prompts)]
        first = Executor(tiny, first_cache)
        sequences = [PrefillSequence(block_table=t, token_ids=p) for t, p in zip(first_tables, prompts)]
        head = first.prefill(sequences, layers=range(0, split), head=False)
        assert head.hidden is not None and head.logits is None
        assert list(head.hidden.shape) == [sum(map(len, prompts)), tiny.config.hidden_size]
        tail = _prefill_all(
            Executor(tiny, second_cache), second_tables, prompts, range(split, layers), head.hidden
        )
        assert tail.logits is not None
        assert torch.equal(tail.logits, whole.logits), f"split at {split}"
        assert tail.tokens == whole.tokens
        for i, prompt in enumerate(prompts):
            reference = whole_cache.export_kv(whole_tables[i], len(prompt), range(layers))
            got = first_cache.export_kv(first_tables[i], len(prompt), range(0, split)) if split else {}
            if split < layers:
                got |= second_cache.export_kv(second_tables[i], len(prompt), range(split, layers))
            assert set(got) == set(reference)
            for name in reference:
                assert torch.equal(got[name], reference[name]), f"{name} split at {split}"
            untouched = (
                second_cache.export_kv(second_tables[i], len(prompt), range(0, split)) if split else {}
            )
            assert all(not tensor.any() for tensor in untouched.values()), (
                "KV written outside the layer range"
            )


def test_kv_exported_in_two_halves_continues_identically_in_another_cache(tiny: Model) -> None:
    prompts = _prompts(tiny)
    steps = 12
    reference = [generate_in_one_piece(tiny, p, max_tokens=steps + 1, sampling=IGNORE_EOS) for p in prompts]
    split = 1
    caches = [KVCache.create(tiny.config, 32), KVCache.create(tiny.config, 32)]
    tables = [[allocate(c, f"r{i}", len(p)) for i, p in enumerate(prompts)] for c in caches]
    head = _prefill_all(Executor(tiny, caches[0]), tables[0], prompts, range(0, split))
    tail = _prefill_all(
        Executor(tiny, caches[1]), tables[1], prompts, range(split, tiny.config.num_layers), head.hidden
    )
    assert tail.tokens == [r[0] for r in reference]
    decode_cache = KVCache.create(tiny.config, 64)
    decode_cache.pool.allocate(5, "someone-else")
    decode_tables = [allocate(decode_cache, f"d{i}", len(p) + steps) for i, p in enumerate(prompts)]
    for i, prompt in enumerate(prompts):
        decode_cache.import_kv(
            decode_tables[i], caches[0].export_kv(tables[0][i], len(prompt), range(0, split))
        )
        halves = caches[1].export_blocks(tables[1][i], range(split, tiny.config.num_layers))
        staging = KVCache.create(tiny.config, len(tables[1][i]))
        staging.import_blocks(list(range(len(tables[1][i]))), halves)
        decode_cache.import_kv(
            decode_tables[i],
            staging.export_kv(
                list(range(len(tables[1][i]))), len(prompt), range(split, tiny.config.num_layers)
            ),
        )
    executor = Executor(tiny, decode_cache)
    outputs = [[token] for token in tail.tokens or []]
    for _ in range(steps):
        result = executor.decode(
            [
                DecodeSequence(block_table=t, cached_tokens=len(p) + len(o) - 1, token_id=o[-1])
                for t, p, o in zip(decode_tables, prompts, outputs)
            ]
        )
        for out, token in zip(outputs, result.tokens):
            out.append(token)
    assert outputs == reference


def test_fragmented_block_tables_give_the_same_tokens_as_contiguous_ones(tiny: Model) -> None:
    prompts = _prompts(tiny)
    contiguous = generate_batch(tiny, prompts, 20)
    fragmented = generate_batch(tiny, prompts, 20, fragment=True)
    assert fragmented == contiguous


def test_batch_composition_does_not_change_greedy_output(tiny: Model) -> None:
    prompts = _prompts(tiny)
    batched = generate_batch(tiny, prompts, 24)
    for prompt, together in zip(prompts, batched):
        alone = generate_batch(tiny, [prompt], 24)[0]
        assert together == alone


def test_chunked_prefill_over_cached_tokens_equals_one_prefill(tiny: Model) -> None:
    prompt = _prompts(tiny)[1]
    cache = KVCache.create(tiny.config, 16)
    table = allocate(cache, "a", len(prompt))
    executor = Executor(tiny, cache)
    whole = executor.prefill(
        [PrefillSequence(block_table=table, token_ids=prompt, logprobs=3, prompt_logprobs=2)]
    )
    other = allocate(cache, "b", len(prompt))
    scored = []  # the prompt's log-probabilities, chunk by chunk (each scores the next chunk's first)
    for start, stop in ((0, 7), (7, 30), (30, len(prompt))):
        last = stop == len(prompt)
        part = executor.prefill(
            [
                PrefillSequence(
                    block_table=other,
                    token_ids=prompt[start:stop],
                    cached_tokens=start,
                    logprobs=3 if last else None,
                    prompt_logprobs=2,
                    next_token=None if last else prompt[stop],
                )
            ]
        )
        assert part.prompt_logprobs is not None and part.prompt_logprobs[0] is not None
        scored += part.prompt_logprobs[0]
    assert part.logits is not None and whole.logits is not None
    torch.testing.assert_close(part.logits, whole.logits, atol=1e-4, rtol=1e-5)
    assert part.tokens == whole.tokens
    assert whole.prompt_logprobs is not None and whole.prompt_logprobs[0] is not None
    assert [s.token_id for s in scored] == [s.token_id for s in whole.prompt_logprobs[0]] == prompt[1:]
    for mine, reference in zip(scored, whole.prompt_logprobs[0], strict=True):
        assert abs(mine.logprob - reference.logprob) < 1e-4 and len(mine.top) == 2
    assert whole.logprobs is not None and part.logprobs is not None and whole.logprobs[0] is not None
    assert part.logprobs[0] is not None and part.logprobs[0].token_id == whole.tokens[0]
    assert abs(part.logprobs[0].logprob - whole.logprobs[0].logprob) < 1e-4
    expected = torch.log_softmax(whole.logits[0], dim=-1)
    assert abs(whole.logprobs[0].logprob - float(expected[whole.tokens[0]])) < 1e-6
    assert [t for t, _ in whole.logprobs[0].top] == expected.topk(3).indices.tolist()


def test_decode_with_mixed_context_lengths_matches_each_alone(tiny: Model) -> None:
    prompts = _prompts(tiny)
    reference = [generate_in_one_piece(tiny, p, max_tokens=6, sampling=IGNORE_EOS) for p in prompts]
    cache = KVCache.create(tiny.config, 40)
    tables = [allocate(cache, f"r{i}", len(p) + 6) for i, p in enumerate(prompts)]
    executor = Executor(tiny, cache)
    for table, prompt, ref in zip(tables, prompts, reference):
        executor.prefill([PrefillSequence(block_table=table, token_ids=prompt)])
        executor.decode([DecodeSequence(block_table=table, cached_tokens=len(prompt), token_id=ref[0])])
    # Contexts now differ per sequence (5, 44, 8, 38 tokens + 1): one batched step must match each reference.
    result = executor.decode(
        [
            DecodeSequence(block_table=t, cached_tokens=len(p) + 1, token_id=ref[1])
            for t, p, ref in zip(tables, prompts, reference)
        ]
    )
    assert result.tokens == [ref[2] for ref in reference]


def test_images_in_a_batch_match_the_reference(tiny: Model) -> None:
    assert tiny.vision is not None and tiny.tokenizer is not None
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    marker = tiny.config.image_token_id
    assert marker is not None
    with_image = [*tiny.tokenizer.encode("look: "), marker, *tiny.tokenizer.encode(" what is it?")[1:]]
    text_only = tiny.tokenizer.encode("plain text prompt")
    max_tokens = 10
    reference_image = generate_in_one_piece(
        tiny, with_image, images=[image], max_tokens=max_tokens, sampling=IGNORE_EOS
    )
    reference_text = generate_in_one_piece(tiny, text_only, max_tokens=max_tokens, sampling=IGNORE_EOS)

    (embedding,) = tiny.vision.encode([image])
    layout = layout_prompt(with_image, [embedding.grid], marker)
    (start, rows) = layout.image_spans[0]
    cache = KVCache.create(tiny.config, 32)
    tables = [
        allocate(cache, "img", len(layout.token_ids) + max_tokens),
        allocate(cache, "txt", len(text_only) + max_tokens),
    ]
    executor = Executor(tiny, cache)
    first = executor.prefill(
        [
            PrefillSequence(
                block_table=tables[0],
                token_ids=layout.token_ids,
                positions=layout.positions,
                embeds=embedding.embeds,
                embed_indices=range(start, start + rows),
            ),
            PrefillSequence(block_table=tables[1], token_ids=text_only),
        ]
    )
    assert first.tokens is not None
    outputs = [[token] for token in first.tokens]
    lengths = [len(layout.token_ids), len(text_only)]
    next_positions = [layout.next_position, len(text_only)]
    for step in range(max_tokens - 1):
        result = executor.decode(
            [
                DecodeSequence(block_table=t, cached_tokens=n + step, token_id=o[-1], position=pos + step)
                for t, n, o, pos in zip(tables, lengths, outputs, next_positions)
            ]
        )
        for out, token in zip(outputs, result.tokens):
            out.append(token)
    assert outputs == [reference_image, reference_text]
    assert layout.next_position < len(layout.token_ids)


def test_layer_range_inputs_are_checked(tiny: Model) -> None:
    cache = KVCache.create(tiny.config, 4)
    table = allocate(cache, "a", 4)
    executor = Executor(tiny, cache)
    seq = [PrefillSequence(block_table=table, token_ids=[1, 2, 3, 4])]
    with pytest.raises(
        InvalidBatchError, match=r"^layer range \[2, 9\) is not a non-empty part of \[0, 4\)$"
    ):
        executor.prefill(seq, layers=range(2, 9))
    with pytest.raises(
        InvalidBatchError, match=r"^prefill from layer 2: hidden states None, expected \[4, 128\]$"
    ):
        executor.prefill(seq, layers=range(2, 4))
    with pytest.raises(
        InvalidBatchError, match=r"^prefill from layer 2: hidden states \[3, 128\], expected \[4, 128\]$"
    ):
        executor.prefill(seq, layers=range(2, 4), hidden=torch.zeros(3, 128))
    with pytest.raises(
        InvalidBatchError, match=r"^prefill from layer 0: hidden states \[3, 128\], expected \[4, 128\]$"
    ):
        executor.prefill(seq, layers=range(0, 2), hidden=torch.zeros(3, 128))


def test_kv_layout_is_what_the_pool_storage_holds(tiny: Model) -> None:
    layout = tiny.kv_layout()
    assert layout.block_size == 16
    assert [b.name for b in layout.buffers] == layer_buffer_names(range(tiny.config.num_layers))
    assert [b.name for b in layout.buffers][:4] == ["k0", "v0", "k1", "v1"]
    assert {(b.shape, b.dtype) for b in layout.buffers} == {((2, 32), "float32")}
    cache = KVCache.create(tiny.config, 3)
    assert cache.storage.tensors["k3"].shape == (3, 16, 2, 32)
    assert cache.storage.layout == layout
    assert layout.bytes_per_token == 4 * 2 * 2 * 32 * 4


async def test_replicas_sharing_one_model_run_concurrently_in_threads(tiny: Model) -> None:
    """As the node runs them: two executors (own caches, shared weights) off the event loop at once."""
    import trio

    prompts = _prompts(tiny)
    reference = generate_batch(tiny, prompts, 8)
    results: dict[int, list[list[int]]] = {}

    async def replica(index: int) -> None:
        results[index] = await trio.to_thread.run_sync(generate_batch, tiny, prompts, 8)

    async with trio.open_nursery() as nursery:
        for index in range(3):
            nursery.start_soon(replica, index)
    assert results == {0: reference, 1: reference, 2: reference}
