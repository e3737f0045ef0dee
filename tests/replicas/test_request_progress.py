"""A request's progress: changed only through its methods, each keeping its invariant, whatever the order
they come in; and a copy of the request on another node, brought up by `merge` from its holder's
reports (late, repeated, out of order), ends with the holder's tokens and never takes any back."""

from __future__ import annotations

import random
from dataclasses import fields
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replicas.model import SamplingParams, TokenLogprobs
from replicas.request import HolderReport, Milestone, RequestSpec, ServingRequest, Stamps

PROMPT = 40
MILESTONES: tuple[Milestone, ...] = get_args(Milestone)
PROGRESS = (
    "eos_token_ids",
    "generated",
    "generated_logprobs",
    "prompt_scores",
    "stamps",
    "token_ids",
    "positions",
    "next_position",
    "prefilled",
    "image_grids",
    "embeds",
    "embed_indices",
    "embedding_route",
    "cached_tokens",
    "cached_from",
    "pull_from",
    "pull_blocks",
    "pulling",
    "cancelled",
    "ended",
    "cancel_reason",
    "final_update",
    "stop_at",
    "grammar_state",
    "holder",
)


def new_request(*, logprobs: int | None = 1) -> ServingRequest:
    spec = RequestSpec.of(
        request_id="r",
        prompt_ids=list(range(1, PROMPT + 1)),
        images=[],
        sampling=SamplingParams(),
        max_tokens=400,
        logprobs=logprobs,
    )
    return ServingRequest(spec, eos_token_ids=(0,))


def score(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -float(token % 7), ())


def test_progress_is_read_only_from_outside() -> None:
    request = new_request()
    for name in PROGRESS:
        with pytest.raises(AttributeError):
            setattr(request, name, getattr(request, name))
    stamps = request.stamps
    with pytest.raises(AttributeError):
        stamps.dispatched = 1.0  # type: ignore[misc]


tokens = st.integers(min_value=1, max_value=50)
operations = st.one_of(
    st.tuples(st.just("hand"), st.sampled_from([None, "prefill-0", "decode-0", "node-b/decode-1"])),
    st.tuples(st.just("token"), tokens, st.booleans()),
    st.tuples(st.just("stamp"), st.sampled_from(MILESTONES), st.floats(min_value=1.0, max_value=2.0)),
    st.tuples(st.just("stamp_first"), st.sampled_from(MILESTONES), st.floats(min_value=1.0, max_value=2.0)),
    st.tuples(st.just("prefill_from"), st.integers(min_value=0, max_value=PROMPT // 16), st.booleans()),
    st.tuples(st.just("prefilled_to"), st.integers(min_value=-4, max_value=PROMPT + 4)),
    st.tuples(st.just("restart")),
    st.tuples(st.just("released")),
    st.tuples(st.just("pull"), st.booleans()),
    st.tuples(st.just("cancel")),
    st.tuples(st.just("stop_early"), st.integers(min_value=0, max_value=20)),
    st.tuples(st.just("finish")),
    st.tuples(st.just("fail")),
    st.tuples(st.just("merge"), st.integers(min_value=0, max_value=20), st.lists(tokens, max_size=6)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operations, max_size=60))
def test_every_progress_method_keeps_the_invariants(ops: list[tuple[object, ...]]) -> None:
    request = new_request()
    holder: str | None = None
    stamped: dict[str, float] = {}  # what each milestone should read now
    arrived = request.stamps.arrived
    for op in ops:
        before = list(request.generated)
        was_cancelled, was_ended, final = request.cancelled, request.ended, request.final_update
        prefilled = request.prefilled
        match op:
            case ("hand", str() | None as name):
                request.hand_to(name)
                holder = name
            case ("token", int(token), bool(scored)):
                request.add_token(token, score(token) if scored else None)
            case ("stamp", str(milestone), float(at)):
                request.stamp(milestone, at)  # type: ignore[arg-type]
                stamped[milestone] = at  # a milestone reached again keeps the latest time
            case ("stamp_first", str(milestone), float(at)):
                request.stamp_first(milestone, at)  # type: ignore[arg-type]
                stamped.setdefault(milestone, at)  # the first time stays
            case ("prefill_from", int(blocks), bool(pulled)):
                request.prefill_from(blocks * 16, "prefill-1" if pulled else "local")
                assert request.prefilled == request.cached_tokens == blocks * 16
            case ("prefilled_to", int(position)):
                if prefilled <= position <= PROMPT:
                    request.prefilled_to(position)
                    assert request.prefilled == position
                else:
                    with pytest.raises(ValueError):
                        request.prefilled_to(position)
                    assert request.prefilled == prefilled
            case ("restart",):
                request.restart_prefill()
                assert request.prefilled == 0 and not request.prompt_scores
            case ("released",):
                request.released_blocks()
                assert request.prefilled == 0
            case ("pull", bool(started)):
                request.pull_started() if started else request.pull_ended()
                assert request.pulling is started
            case ("cancel",):
                request.cancel()
                assert request.cancelled
            case ("stop_early", int(kept)):
                stop_at = request.stop_at
                request.stop_early(kept)
                assert request.cancelled and request.stop_at == (kept if stop_at is None else stop_at)
            case ("finish",):
                request.finish("length")
                if not was_ended and request.stop_at is not None:
                    assert list(request.generated) == before[: request.stop_at]
            case ("fail",):
                request.fail("internal", "a test failure")
            case ("merge", int(start), list(new)):
                request.merge(HolderReport(tokens_from=start, generated=new, emit=False))
                if not was_ended and start <= len(before):
                    assert list(request.generated) == before + new[len(before) - start :]
            case _:
                raise AssertionError(op)
        # Whatever happened: the invariants the request's docstring states.
        assert request.holder == holder
        if op[0] != "finish":
            assert list(request.generated[: len(before)]) == before, "tokens were taken back"
        scored = request.generated_logprobs
        assert len(scored) <= len(request.generated)
        assert all(entry.token_id == token for entry, token in zip(scored, request.generated, strict=False))
        assert 0 <= request.prefilled <= request.prompt_tokens
        assert request.cached_from is None or request.cached_tokens > 0
        assert request.cancelled or not was_cancelled
        assert request.ended or not was_ended
        assert final is None or request.final_update is final
        assert request.ended == (request.final_update is not None)
        assert request.stamps.arrived == arrived
        assert {m: getattr(request.stamps, m) for m in MILESTONES} == {m: stamped.get(m) for m in MILESTONES}
        assert request.ended == (request.stamps.finished is not None)


def test_the_milestones_holders_stamp_are_stamps() -> None:
    assert set(MILESTONES) <= {f.name for f in fields(Stamps)} - {"arrived", "first_token", "finished"}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(tokens, min_size=1, max_size=30),
    st.lists(st.tuples(st.integers(min_value=0, max_value=29), st.integers(min_value=1, max_value=5))),
    st.randoms(use_true_random=False),
)
def test_a_copy_merged_from_the_holders_reports_ends_with_its_tokens(
    generated: list[int], cuts: list[tuple[int, int]], rng: random.Random
) -> None:
    """The holder emits `generated` with their scores; the copy hears of slices of them in any order,
    some twice, then the end: it never takes a token back, never holds one the holder did not emit at
    that index, and ends with exactly the holder's tokens and scores."""
    holder, copy = new_request(), new_request()
    for token in generated:
        holder.add_token(token, score(token))
    reports = [(start, min(start + size, len(generated))) for start, size in cuts if start < len(generated)]
    reports += reports[: len(reports) // 2]  # some arrive twice
    rng.shuffle(reports)
    for start, stop in reports:
        before = list(copy.generated)
        copy.merge(
            HolderReport(
                tokens_from=start,
                generated=generated[start:stop],
                generated_logprobs=[score(t) for t in generated[start:stop]],
                emit=False,
            )
        )
        assert list(copy.generated[: len(before)]) == before
        assert list(copy.generated) == generated[: len(copy.generated)]
        assert len(copy.generated_logprobs) == len(copy.generated)
    end = HolderReport(
        generated=holder.generated,
        generated_logprobs=holder.generated_logprobs,
        stamps={"prefill_started": 1.0, "arrived": 0.5},
        emit=False,
    )
    copy.merge(end)
    copy.merge(end)  # repeated: nothing changes
    assert list(copy.generated) == generated
    assert list(copy.generated_logprobs) == list(holder.generated_logprobs)
    assert copy.stamps.prefill_started == 1.0
    assert copy.stamps.arrived != 0.5, "a milestone this node stamped is kept"
