"""Penalties and logit bias: `adjust_logits` against a direct reimplementation of vLLM's `apply_penalties`
(bias added first), on random logits and histories; the host sampler and the device sampler (run on CPU
tensors) pick the same tokens; the params refuse values out of vLLM's ranges."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.model.gpu.sampling import sample_tokens_on_device
from replicas.model.sampling import (
    LogitAdjustments,
    SamplingError,
    SamplingParams,
    TokenHistory,
    adjust_logits,
    sample_tokens,
    token_history,
)
from tests.model.helpers import vllm_apply_penalties


@st.composite
def cases(draw: Any) -> tuple[torch.Tensor, list[SamplingParams], list[TokenHistory | None], list[int]]:
    batch = draw(st.integers(1, 5))
    vocab = draw(st.integers(2, 40))
    values = st.floats(-30.0, 30.0, width=32) | st.sampled_from([0.0, -float("inf"), 1.0, -1.0])
    logits = torch.tensor(draw(st.lists(values, min_size=batch * vocab, max_size=batch * vocab)))
    logits = logits.reshape(batch, vocab)
    ids = st.integers(0, vocab - 1)
    penalty = st.sampled_from([0.0, 0.0, -2.0, 2.0, 0.5, -0.7]) | st.floats(-2.0, 2.0)
    params: list[SamplingParams] = []
    histories: list[TokenHistory | None] = []
    for _ in range(batch):
        bias_ids = draw(st.lists(ids, unique=True, max_size=4))
        p = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.0, 0.7, 1.0])),
            seed=draw(st.integers(0, 1000)),
            presence_penalty=draw(penalty),
            frequency_penalty=draw(penalty),
            repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3, 0.8, 2.0]) | st.floats(0.05, 5.0)),
            logit_bias=tuple((t, draw(st.floats(-100.0, 100.0))) for t in bias_ids),
        )
        params.append(p)
        history = token_history(
            p, draw(st.lists(ids, min_size=1, max_size=8)), draw(st.lists(ids, max_size=8))
        )
        histories.append(history)
    indices = [draw(st.integers(0, 50)) for _ in range(batch)]
    return logits, params, histories, indices


def expected(
    logits: torch.Tensor, params: list[SamplingParams], histories: list[TokenHistory | None]
) -> torch.Tensor:
    biased = logits.clone()
    for row, p in enumerate(params):
        for token, value in p.logit_bias:
            biased[row, token] += torch.tensor(value, dtype=torch.float32)
    empty = TokenHistory((), ())
    rows = [h if h is not None else empty for h in histories]
    return vllm_apply_penalties(
        biased,
        [list(h.prompt) for h in rows],
        [list(h.generated) for h in rows],
        [p.presence_penalty for p in params],
        [p.frequency_penalty for p in params],
        [p.repetition_penalty for p in params],
    )


@settings(max_examples=150, deadline=None)
@given(cases())
def test_adjust_logits_is_vllms_formula(
    case: tuple[torch.Tensor, list[SamplingParams], list[TokenHistory | None], list[int]],
) -> None:
    logits, params, histories, _ = case
    before = logits.clone()
    adjustments = LogitAdjustments.build(params, histories, "cpu")
    got = logits if adjustments is None else adjust_logits(logits, adjustments)
    torch.testing.assert_close(got, expected(logits, params, histories), rtol=0, atol=0, equal_nan=True)
    assert torch.equal(logits, before)


@settings(max_examples=150, deadline=None)
@given(cases())
def test_the_host_and_the_device_sampler_agree(
    case: tuple[torch.Tensor, list[SamplingParams], list[TokenHistory | None], list[int]],
) -> None:
    logits, params, histories, indices = case
    host = sample_tokens(logits, params, indices, histories=histories)
    assert sample_tokens_on_device(logits, params, indices, histories=histories) == host
    greedy = [row for row, p in enumerate(params) if p.greedy]
    adjusted = expected(logits, params, histories)
    for row in greedy:
        assert host[row] == int(adjusted[row].argmax())


def test_a_repeated_token_is_penalised_and_a_bias_wins() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.0]])
    history = TokenHistory(prompt=(0,), generated=())
    rep = SamplingParams(repetition_penalty=2.0)
    assert sample_tokens(logits, [rep], [1], histories=[history]) == [1]  # 2.0 / 2 < 1.9
    freq = SamplingParams(frequency_penalty=1.0)
    assert sample_tokens(logits, [freq], [1], histories=[TokenHistory((), (0,))]) == [1]
    assert sample_tokens(logits, [freq], [1], histories=[TokenHistory((0,), ())]) == [
        0
    ]  # the prompt is not counted
    bias = SamplingParams(logit_bias=((2, 100.0),))
    assert sample_tokens(logits, [bias], [1]) == [2]  # bias alone needs no history


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("logit_bias", ((3, 101.0),)),
        ("logit_bias", ((-1, 1.0),)),
        ("logit_bias", ((3, 1.0), (3, 2.0))),
    ],
)
def test_values_out_of_range_are_refused(field: str, value: object) -> None:
    with pytest.raises(SamplingError, match=field.split("_")[0]):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_a_penalty_without_a_history_or_an_id_past_the_vocabulary_is_refused() -> None:
    logits = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="no token history"):
        sample_tokens(logits, [SamplingParams(presence_penalty=1.0)], [0])
    with pytest.raises(SamplingError, match="outside a vocabulary of 4"):
        sample_tokens(logits, [SamplingParams(logit_bias=((4, 1.0),))], [0])
    assert token_history(SamplingParams(logit_bias=((1, 1.0),)), [1, 2], [3]) is None
