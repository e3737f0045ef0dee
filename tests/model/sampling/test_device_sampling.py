"""Device sampling: on CPU tensors, exactly the tokens `sample_tokens` picks, with no host sync inside."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.model import sampling
from replicas.model.gpu import sampling as device_sampling
from replicas.model.gpu.sampling import SamplingInputs, sample_on_device, sample_tokens_on_device
from replicas.model.sampling import GREEDY, SamplingParams, sample_tokens, uniform_draw

INF = float("inf")
# Logit values that collide (ties), differ by exact amounts, or are masked; mixed with arbitrary floats.
TIE_POOL = [0.0, 0.0, 1.0, -1.0, 2.0, 0.5, -INF, -INF, math.log(2.0), 30.0]
TEMPERATURES = [5e-324, 1e-300, 1e-30, 1e-8, 0.05, 0.3, 1.0, 2.5, 1e3, 1e300]
TOP_P = [1.0, 1.0, 1e-12, 0.25, 0.5, 0.75, 0.9, 0.999999]
VOCABS = [1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 31, 32, 33, 64, 65, 100]


@st.composite
def batches(
    draw: Any, vocabs: Sequence[int] = VOCABS, kinds: Sequence[str] = ("mixed", "mixed", "ties", "masked")
) -> tuple[torch.Tensor, list[SamplingParams], list[int]]:
    """Random `[B, V]` float32 logits (ties, -inf entries and whole -inf rows included) with per-row
    greedy or sampled parameters, seeds, token indices and EOS bans that do and do not apply. An "equal"
    row has one value and -inf: m equal probabilities 1/m, whose cumulative sums are boundaries that
    simple draws (1/4, 1/3, ...) hit exactly."""
    batch = draw(st.integers(1, 6))
    vocab = draw(st.sampled_from(vocabs))
    value = st.one_of(st.sampled_from(TIE_POOL), st.floats(-40.0, 40.0, width=32))
    rows = []
    for _ in range(batch):
        kind = draw(st.sampled_from(kinds))
        if kind == "equal":
            level = draw(st.sampled_from([0.0, 1.0, -1.0, 2.0, 0.5, 30.0]))
            rows.append(
                [
                    level if keep else -INF
                    for keep in draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab))
                ]
            )
        elif kind == "masked":
            rows.append([-INF] * vocab)
        elif kind == "ties":
            rows.append(draw(st.lists(st.sampled_from(TIE_POOL), min_size=vocab, max_size=vocab)))
        else:
            rows.append(draw(st.lists(value, min_size=vocab, max_size=vocab)))
    params, indices = [], []
    for _ in range(batch):
        greedy = draw(st.integers(0, 3)) == 0
        temperature = (
            0.0 if greedy else draw(st.one_of(st.sampled_from(TEMPERATURES), st.floats(0.01, 100.0)))
        )
        top_p = draw(st.one_of(st.sampled_from(TOP_P), st.floats(1e-6, 1.0, exclude_min=True)))
        eos = tuple(draw(st.lists(st.integers(0, vocab - 1), max_size=3)))
        params.append(
            SamplingParams(
                temperature=temperature,
                top_p=top_p,
                seed=draw(st.integers(0, 2**64 - 1)),
                eos_token_ids=eos,
                eos_banned_before=draw(st.integers(0, 40)),
            )
        )
        indices.append(draw(st.integers(0, 40)))
    return torch.tensor(rows, dtype=torch.float32), params, indices


@contextmanager
def forced_draws(draws: Sequence[float]) -> Iterator[None]:
    """Both modules' `uniform_draw` answers `draws[index]` — to put a draw exactly on a boundary."""

    def fake(seed: int, token_index: int) -> float:
        return draws[token_index]

    with (
        mock.patch.object(sampling, "uniform_draw", fake),
        mock.patch.object(device_sampling, "uniform_draw", fake),
    ):
        yield


@settings(max_examples=400, deadline=None)
@given(batch=batches())
def test_device_picks_equal_sample_tokens_on_cpu(
    batch: tuple[torch.Tensor, list[SamplingParams], list[int]],
) -> None:
    logits, params, indices = batch
    before = logits.clone()
    assert sample_tokens_on_device(logits, params, indices) == sample_tokens(logits, params, indices)
    assert torch.equal(logits, before)  # the caller's logits are left as they were


@settings(max_examples=200, deadline=None)
@given(
    batch=batches(vocabs=[1, 2, 3, 4, 6, 8, 16], kinds=("equal", "equal", "equal", "ties")),
    draws=st.lists(
        st.one_of(
            st.sampled_from([0.0, 0.125, 0.25, 0.5, 0.75, 1 / 3, 2 / 3, 1.0 - 2.0**-53]),
            st.floats(0.0, 1.0, exclude_max=True),
        ),
        min_size=41,
        max_size=41,
    ),
)
def test_draws_on_a_boundary_pick_as_sample_tokens_does(
    batch: tuple[torch.Tensor, list[SamplingParams], list[int]], draws: list[float]
) -> None:
    """Tie-heavy rows have dyadic probabilities (1/2, 1/4, ...) and dyadic cumulative sums, so draws like
    0.25 land exactly on a boundary: the right-sided search must step over it in both, as must a top-p
    equal to a cumulative value."""
    logits, params, indices = batch
    with forced_draws(draws):
        assert sample_tokens_on_device(logits, params, indices) == sample_tokens(logits, params, indices)


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.sampled_from([1, 5, 8, 16, 33, 100, 1000, 4099]),
    rows=st.integers(1, 5),
    scale=st.sampled_from([1e-3, 1.0, 30.0]),
    seed=st.integers(0, 2**31),
)
def test_batched_float64_steps_equal_the_per_row_steps_bitwise(
    vocab: int, rows: int, scale: float, seed: int
) -> None:
    """What the exactness rests on, on CPU: softmax, stable sort and cumsum over the last dim of `[S, V]`
    give each row the bits they give the row alone; the cumsum of a prefix is the prefix of the cumsum;
    dividing by a `[S, 1]` tensor is dividing by the Python float."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, dtype=torch.float64, generator=generator) * scale
    temperatures = torch.rand(rows, dtype=torch.float64, generator=generator) * 3 + 1e-3
    scaled = (x - x.amax(dim=-1, keepdim=True)) / temperatures[:, None]
    probs = torch.softmax(scaled, dim=-1)
    values, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    cumulative = torch.cumsum(values, dim=-1)
    for i in range(rows):
        row_scaled = (x[i] - x[i].max()) / float(temperatures[i])
        assert torch.equal(scaled[i], row_scaled)
        row_probs = torch.softmax(row_scaled, dim=-1)
        assert torch.equal(probs[i], row_probs)
        row_sorted = torch.sort(row_probs, descending=True, stable=True)
        assert torch.equal(order[i], row_sorted.indices)
        assert torch.equal(cumulative[i], torch.cumsum(row_sorted.values, dim=0))
        keep = 1 + seed % vocab
        assert torch.equal(cumulative[i, :keep], torch.cumsum(row_sorted.values[:keep], dim=0))


def test_large_vocabularies_pick_as_sample_tokens_does() -> None:
    generator = torch.Generator().manual_seed(11)
    for vocab in (32_000, 151_936):
        logits = torch.randn(12, vocab, generator=generator) * 4
        params = [
            SamplingParams(temperature=t, top_p=p, seed=vocab + i, eos_token_ids=(2,), eos_banned_before=5)
            for i, (t, p) in enumerate(
                (t, p) for t in (0.0, 0.7, 1.0, 1.5) for p in (1.0, 0.9, 0.3) if (t, p) != (0.0, 0.3)
            )
        ]
        params.append(GREEDY)
        indices = [3 * i for i in range(len(params))]
        assert sample_tokens_on_device(logits, params, indices) == sample_tokens(logits, params, indices)


def test_a_vanishing_temperature_is_the_greedy_limit() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9999], [5.0, -INF, 4.0, 5.0 - 1e-6]])
    for temperature in (5e-324, 1e-300, 1e-30):
        params = [SamplingParams(temperature=temperature, seed=seed) for seed in (1, 2)]
        for index in range(20):
            assert sample_tokens_on_device(logits, params, [index, index]) == [1, 0]


def test_a_tiny_top_p_keeps_only_the_most_probable_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, 2.0, 2.0, 2.0]])
    params = [SamplingParams(temperature=1.0, top_p=1e-9, seed=seed) for seed in (5, 6)]
    for index in range(20):
        assert sample_tokens_on_device(logits, params, [index, index]) == [1, 0]  # ties: the lowest id


def test_ties_are_ordered_by_token_id() -> None:
    """Four equal logits: probabilities 1/4 each, cumulative 1/4, 1/2, 3/4, 1; a draw d picks the
    token floor(4 d) — a draw on a boundary goes to the next token (the search is right-sided)."""
    logits = torch.zeros(1, 4)
    hot = [SamplingParams(temperature=1.0)]
    draws = [0.0, 0.2, 0.25, 0.5, 0.74, 0.75, 1.0 - 2.0**-53]
    with forced_draws(draws):
        picks = [sample_tokens_on_device(logits, hot, [i])[0] for i in range(len(draws))]
    assert picks == [0, 0, 1, 2, 2, 3, 3]
    assert sample_tokens_on_device(logits, [GREEDY], [0]) == [0]


def test_an_all_greedy_batch_is_one_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0], [5.0, 0.0, 5.0], [-INF, -INF, -INF]])
    inputs = SamplingInputs.build([GREEDY] * 3, [1, 2, 3], logits.device)
    assert (inputs.num_sampled, inputs.num_bans) == (0, 0)
    for tensor in (inputs.sampled_rows, inputs.draws, inputs.temperatures, inputs.top_p, inputs.ban_ids):
        assert tensor.numel() == 0

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an all-greedy batch sorted")

    monkeypatch.setattr(torch, "sort", refuse)
    monkeypatch.setattr(torch, "softmax", refuse)
    tokens = sample_on_device(logits, inputs)
    assert tokens.dtype == torch.int64 and tokens.tolist() == [1, 0, 0] == logits.argmax(dim=-1).tolist()


def test_only_the_rows_that_need_it_get_inputs() -> None:
    banned = SamplingParams(eos_token_ids=(2, 7), eos_banned_before=10)
    hot = SamplingParams(temperature=0.8, top_p=0.9, seed=42)
    inputs = SamplingInputs.build(
        [GREEDY, hot, banned, banned, GREEDY], [0, 6, 9, 10, 3], torch.device("cpu")
    )
    assert inputs.batch_size == 5
    assert inputs.sampled_rows.tolist() == [1]
    assert inputs.draws.tolist() == [uniform_draw(42, 6)]
    assert (inputs.temperatures.tolist(), inputs.top_p.tolist()) == ([0.8], [0.9])
    assert (inputs.ban_rows.tolist(), inputs.ban_ids.tolist()) == ([2, 2], [2, 7])  # row 3 is at index 10
    assert (inputs.ban_id_min, inputs.ban_id_max) == (2, 7)
    assert inputs.sampled_rows.dtype == inputs.ban_rows.dtype == torch.int64
    assert inputs.draws.dtype == inputs.top_p.dtype == torch.float64


def test_banned_eos_tokens_are_never_picked_before_their_index() -> None:
    logits = torch.tensor([[0.0, 5.0, 9.0, 1.0]] * 4)  # token 2 (an EOS) is the greedy choice
    banned = SamplingParams(eos_banned_before=10, eos_token_ids=(2,))
    hot = SamplingParams(temperature=50.0, seed=3, eos_banned_before=100, eos_token_ids=(1, 2))
    before = logits.clone()
    assert sample_tokens_on_device(logits, [banned, banned, GREEDY, hot], [9, 10, 9, 4])[:3] == [1, 2, 2]
    assert {sample_tokens_on_device(logits[:1], [hot], [index])[0] for index in range(60)} <= {0, 3}
    assert torch.equal(logits, before)  # the caller's logits are left as they were
    negative = SamplingParams(eos_banned_before=10, eos_token_ids=(-2,))  # counts from the end, as torch does
    two = logits[:2]
    assert sample_tokens_on_device(two, [GREEDY, negative], [0, 0]) == sample_tokens(
        two, [GREEDY, negative], [0, 0]
    )
    assert sample_tokens(two, [GREEDY, negative], [0, 0]) == [2, 1]
    outside = SamplingParams(eos_banned_before=10, eos_token_ids=(4,))
    with pytest.raises(IndexError):
        sample_tokens(logits[:1], [outside], [0])
    with pytest.raises(IndexError, match="outside a vocabulary of 4"):
        sample_tokens_on_device(logits[:1], [outside], [0])


def test_a_row_does_not_depend_on_the_rest_of_the_batch() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(9, 50, generator=generator) * 3
    params = [SamplingParams(temperature=0.2 * (i % 5), top_p=0.5 + 0.05 * i, seed=i) for i in range(9)]
    indices = list(range(100, 109))
    together = sample_tokens_on_device(logits, params, indices)
    alone = [
        sample_tokens_on_device(logits[i : i + 1], params[i : i + 1], indices[i : i + 1])[0] for i in range(9)
    ]
    assert together == alone
    reversed_rows = sample_tokens_on_device(logits.flip(0), params[::-1], indices[::-1])
    assert reversed_rows[::-1] == together


def test_sampling_reads_nothing_back_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU: every way a tensor's value reaches Python raises inside `sample_on_device` (on CUDA,
    `test_device_picks_on_cuda_equal_sample_tokens_on_cpu` runs it under sync debug mode "error")."""
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(5))
    params = [
        GREEDY,
        SamplingParams(temperature=1.0, top_p=0.7, seed=1),
        SamplingParams(temperature=0.5, seed=2, eos_token_ids=(3,), eos_banned_before=9),
        SamplingParams(eos_token_ids=(0, 1), eos_banned_before=9),
        SamplingParams(temperature=1e-300, seed=4),
        SamplingParams(temperature=3.0, top_p=0.2, seed=5),
    ]
    indices = [1, 2, 3, 4, 5, 6]
    inputs = SamplingInputs.build(params, indices, logits.device)
    expected = sample_tokens(logits, params, indices)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a tensor value was read on the host")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    tokens = sample_on_device(logits, inputs)
    monkeypatch.undo()
    assert tokens.tolist() == expected


def test_logits_that_do_not_fit_the_inputs_are_refused() -> None:
    inputs = SamplingInputs.build([GREEDY, GREEDY], [0, 1], torch.device("cpu"))
    with pytest.raises(ValueError, match=r"logits \[3, 5\] for a batch of 2"):
        sample_on_device(torch.zeros(3, 5), inputs)
    with pytest.raises(ValueError, match="logits"):
        sample_on_device(torch.zeros(5), inputs)
    with pytest.raises(ValueError, match="2 params, 1 indices"):
        SamplingInputs.build([GREEDY, GREEDY], [0], torch.device("cpu"))
    with pytest.raises(ValueError, match="sample_tokens_on_device"):
        sample_tokens_on_device(torch.zeros(2, 5), [GREEDY], [0])


@pytest.mark.gpu
def test_device_picks_on_cuda_equal_sample_tokens_on_cpu() -> None:
    """Many rows on CUDA against `sample_tokens` on CPU. The GPU's float64 softmax / cumsum may round
    differently in the last bit, so a pick may differ only where the draw lands within ~1e-15 of a
    boundary (about one in 1e13): every mismatch is reported, and one away from a boundary fails."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is false")
    cuda = torch.device("cuda")
    generator = torch.Generator().manual_seed(17)
    mismatches: list[str] = []
    far: list[str] = []
    total = 0
    for vocab, batch in ((50, 512), (32_000, 256), (151_936, 64)):
        cpu_logits = torch.randn(batch, vocab, generator=generator) * (1.0 + 4.0 * torch.rand(batch, 1))
        params = [
            SamplingParams(
                temperature=(0.0, 0.3, 0.7, 1.0, 1.5, 1e-300)[i % 6],
                top_p=(1.0, 0.95, 0.5, 0.05)[i % 4],
                seed=1000 * vocab + i,
                eos_token_ids=(i % vocab,),
                eos_banned_before=(i % 3) * 10,
            )
            for i in range(batch)
        ]
        indices = [7 + (i % 11) for i in range(batch)]
        expected = sample_tokens(cpu_logits, params, indices)
        device_logits = cpu_logits.to(cuda)
        inputs = SamplingInputs.build(params, indices, cuda)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tokens = sample_on_device(device_logits, inputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert tokens.device.type == "cuda" and tokens.dtype == torch.int64
        got = tokens.tolist()
        assert torch.equal(device_logits.cpu(), cpu_logits)
        total += batch
        for row, (want, have) in enumerate(zip(expected, got, strict=True)):
            if want == have:
                continue
            gap = _distance_to_a_boundary(cpu_logits[row], params[row], indices[row])
            line = f"V={vocab} row {row}: cpu {want}, cuda {have}, draw's distance to a boundary {gap:.3g}"
            mismatches.append(line)
            if gap > 1e-12:
                far.append(line)
    print(f"{len(mismatches)} mismatches in {total} rows", *mismatches, sep="\n")
    assert not far, "picks differ away from a boundary:\n" + "\n".join(far)
    assert len(mismatches) <= 1, "\n".join(mismatches)


def _distance_to_a_boundary(logits: torch.Tensor, params: SamplingParams, index: int) -> float:
    """How far (relative) the draw's target is from the nearest kept cumulative value, or the top-p cut from
    the nearest value it is compared with, on CPU."""
    row = logits.double()
    if params.eos_token_ids and index < params.eos_banned_before:
        row = row.clone()
        row[list(params.eos_token_ids)] = -INF
    probs = torch.softmax((row - row.max()) / params.temperature, dim=-1)
    values = torch.sort(probs, descending=True, stable=True).values
    cumulative = torch.cumsum(values, dim=0)
    cut = INF
    if params.top_p < 1.0:
        before = cumulative - values
        keep = max(int((before < params.top_p).sum()), 1)
        cumulative = cumulative[:keep]
        cut = float((before - params.top_p).abs().min())
    target = uniform_draw(params.seed, index) * float(cumulative[-1])
    return min(cut, float((cumulative - target).abs().min()) / float(cumulative[-1]))
