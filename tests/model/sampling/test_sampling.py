"""Sampling: greedy, temperature / top-p with randomness fixed by (seed, token index)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.model import (
    DecodeSequence,
    Executor,
    KVCache,
    Model,
    PrefillSequence,
    SamplingError,
    SamplingParams,
    finish_reason,
    generate_in_one_piece,
    sample_tokens,
    uniform_draw,
)
from replicas.model.sampling import GREEDY, sample_one
from tests.model.helpers import allocate, generate_batch

HOT = SamplingParams(temperature=2.5, top_p=0.95, seed=1234, ignore_eos=True)


def test_uniform_draw_is_a_pure_function_of_seed_and_index() -> None:
    draws = [uniform_draw(7, i) for i in range(200)]
    assert draws == [uniform_draw(7, i) for i in range(200)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert len(set(draws)) == 200
    assert uniform_draw(8, 3) != uniform_draw(7, 3)
    assert 0.4 < sum(draws) / len(draws) < 0.6


def test_prefill_on_one_replica_and_decode_on_another_equals_one_piece(tiny: Model) -> None:
    assert tiny.tokenizer is not None
    prompt = tiny.tokenizer.encode("sampling across replicas")
    reference = generate_in_one_piece(tiny, prompt, sampling=HOT, max_tokens=16)
    assert len(set(reference)) > 4, "temperature sampling should not look greedy"
    assert reference != generate_in_one_piece(
        tiny, prompt, max_tokens=16, sampling=SamplingParams(ignore_eos=True)
    )

    prefill_cache = KVCache.create(tiny.config, 8)
    table = allocate(prefill_cache, "p", len(prompt))
    first = Executor(tiny, prefill_cache).prefill(
        [PrefillSequence(block_table=table, token_ids=prompt, sampling=HOT)]
    )
    assert first.tokens is not None
    decode_cache = KVCache.create(tiny.config, 8)
    decode_cache.pool.allocate(3, "other")
    decode_table = allocate(decode_cache, "d", len(prompt) + 16)
    decode_cache.import_kv(
        decode_table, prefill_cache.export_kv(table, len(prompt), range(tiny.config.num_layers))
    )
    executor = Executor(tiny, decode_cache)
    generated = [first.tokens[0]]
    while len(generated) < 16:
        step = executor.decode(
            [
                DecodeSequence(
                    block_table=decode_table,
                    cached_tokens=len(prompt) + len(generated) - 1,
                    token_id=generated[-1],
                    sampling=HOT,
                )
            ]
        )
        generated.append(step.tokens[0])
    assert generated == reference


def test_batch_composition_does_not_change_sampled_output(tiny: Model) -> None:
    assert tiny.tokenizer is not None
    prompts = [tiny.tokenizer.encode(text) for text in ("one", "two two", "three three three")]
    together = generate_batch(tiny, prompts, 12, sampling=HOT)
    assert together[1] == generate_batch(tiny, [prompts[1]], 12, sampling=HOT)[0]
    assert (
        together[0]
        != generate_batch(tiny, [prompts[0]], 12, sampling=SamplingParams(temperature=2.5, seed=99))[0]
    )


def test_greedy_rows_and_sampled_rows_mix_in_one_call() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    assert sample_tokens(logits, [SamplingParams(), SamplingParams()], [4, 9]) == [1, 0]
    tiny_top_p = SamplingParams(temperature=1.0, top_p=1e-9, seed=3)
    assert sample_tokens(logits, [tiny_top_p, tiny_top_p], [4, 9]) == [1, 0]


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.floats(-20, 20, allow_nan=False), min_size=2, max_size=40),
    temperature=st.floats(0.05, 5.0),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**62),
    index=st.integers(0, 100_000),
)
def test_sampled_token_is_inside_the_top_p_set(
    logits: list[float], temperature: float, top_p: float, seed: int, index: int
) -> None:
    row = torch.tensor(logits, dtype=torch.float32)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
    token = sample_one(row, params, index)
    assert token == sample_one(row, params, index)
    probs = torch.softmax(row.double() / temperature, dim=0)
    mass_above = float(probs[probs > probs[token]].sum())
    assert mass_above < top_p + 1e-9, "a token outside the nucleus was sampled"


@settings(max_examples=60, deadline=None)
@given(
    logits=st.lists(st.integers(-10_000, 10_000), min_size=2, max_size=40, unique=True),  # gaps of >= 1
    temperature=st.sampled_from([5e-324, 1e-300, 1e-30, 1e-12]),
    seed=st.integers(0, 2**62),
)
def test_a_vanishing_temperature_samples_the_greedy_token(
    logits: list[int], temperature: float, seed: int
) -> None:
    """Any temperature the bounds admit is a distribution: near 0, the argmax (a review found 5e-324
    overflowed the scaled logits to inf, softmax to NaN, and every token to the first id)."""
    row = torch.tensor(logits, dtype=torch.float64)
    params = SamplingParams(temperature=temperature, seed=seed)
    assert sample_one(row, params, 7) == int(row.argmax())


def test_finish_reason_stops_on_eos_unless_ignored() -> None:
    eos = {2}
    assert finish_reason([5, 2], SamplingParams(), eos, 10) == "stop"
    assert finish_reason([5, 2], SamplingParams(ignore_eos=True), eos, 10) is None
    assert finish_reason([5, 2, 2], SamplingParams(ignore_eos=True), eos, 3) == "length"
    assert finish_reason([5], SamplingParams(), eos, 10) is None


def test_generation_stops_at_eos(tiny: Model) -> None:
    for seed in range(40):
        out = generate_in_one_piece(
            tiny, [256, 65 + seed], sampling=SamplingParams(temperature=3.0, seed=seed), max_tokens=64
        )
        if out[-1] in tiny.eos_token_ids:
            assert len(out) < 64 and all(t not in tiny.eos_token_ids for t in out[:-1])
            return
    pytest.fail("no generation reached EOS")


def test_bad_sampling_parameters_are_refused() -> None:
    with pytest.raises(SamplingError, match=r"^temperature must be >= 0, got -1.0$"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(SamplingError, match=r"^top_p must be in \(0, 1\], got 0.0$"):
        SamplingParams(top_p=0.0)


def test_min_tokens_masks_the_eos_tokens_until_their_index() -> None:
    """`eos_banned_before`: below that token index, an EOS token is never chosen, greedy or sampled."""
    logits = torch.tensor([[0.0, 5.0, 9.0, 1.0]] * 3)  # token 2 (an EOS) is the greedy choice
    banned = SamplingParams(eos_banned_before=10, eos_token_ids=(2,))
    assert sample_tokens(logits, [banned, banned, GREEDY], [9, 10, 9]) == [1, 2, 2]
    hot = SamplingParams(temperature=50.0, seed=3, eos_banned_before=100, eos_token_ids=(1, 2))
    assert {sample_tokens(logits[:1], [hot], [index])[0] for index in range(60)} <= {0, 3}
    assert logits[0, 2] == 9.0  # the caller's logits are left as they were
