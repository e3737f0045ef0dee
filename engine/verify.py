"""Checking the node's output against the model run in one piece (docs/architecture.md: token-identical output).

`compare` runs `generate_in_one_piece` for the same prompt, images and sampling, and reports whether
the node's tokens are identical. A divergence is forgiven only when it is a genuine greedy tie: at the
first differing position the reference's top-2 logits (after the request's bias and penalties) are
within `TIE_TOLERANCE` of each other (two equally good tokens; which one wins depends on rounding, not
on a bug).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import numpy as np
import torch

from replicas.model import (
    DEFAULT_KV_BLOCK_SIZE,
    Executor,
    KVCache,
    LogitAdjustments,
    Model,
    PrefillSequence,
    SamplingParams,
    adjust_logits,
    generate_in_one_piece,
    token_history,
)

TIE_TOLERANCE = 1e-4


@final
@dataclass(frozen=True, slots=True)
class Verdict:
    identical: bool
    tie: bool
    reference: list[int]
    first_difference: int | None

    @property
    def accepted(self) -> bool:
        return self.identical or self.tie


def compare(
    model: Model,
    prompt_ids: Sequence[int],
    got: Sequence[int],
    *,
    sampling: SamplingParams,
    max_tokens: int,
    images: Sequence[np.ndarray] = (),
) -> Verdict:
    """Compare the node's `got` tokens with the reference (see the module docstring)."""
    reference = generate_in_one_piece(
        model, prompt_ids, images=images, sampling=sampling, max_tokens=max_tokens
    )
    if list(got) == reference:
        return Verdict(True, False, reference, None)
    first = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), min(len(got), len(reference)))
    tie = False
    if sampling.greedy and not images and first < min(len(got), len(reference)):
        tie = top2_gap(model, prompt_ids, reference[:first], sampling) <= TIE_TOLERANCE
    return Verdict(False, tie, reference, first)


def top2_gap(
    model: Model, prompt_ids: Sequence[int], generated: Sequence[int], sampling: SamplingParams
) -> float:
    """The gap between the two largest next-token logits after the prompt and `generated` (one sequence,
    one piece), `sampling`'s bias and penalties applied."""
    token_ids = [*prompt_ids, *generated]
    total = len(token_ids)
    block_size = DEFAULT_KV_BLOCK_SIZE
    cache = KVCache.create(model.config, -(-total // block_size), block_size=block_size, device=model.device)
    table = cache.pool.allocate(cache.blocks_for(total), "tie-check")
    try:
        result = Executor(model, cache).prefill(
            [PrefillSequence(block_table=table, token_ids=list(token_ids))]
        )
        assert result.logits is not None
        logits = result.logits[:1].float()
        history = token_history(sampling, prompt_ids, generated)
        adjustments = LogitAdjustments.build([sampling], [history], logits.device)
        if adjustments is not None:
            logits = adjust_logits(logits, adjustments)
        top = torch.topk(logits[0], 2).values
        return float(top[0] - top[1])
    finally:
        cache.pool.free(table, "tie-check")
