"""Log-probabilities of tokens: what `logprobs`, `top_logprobs` and `echo` report.

A log-probability is the log-softmax, in float32, of the model's raw logits — before temperature, top-p
and the `min_tokens` ban on end tokens, as vLLM reports them by default: the model's own distribution,
whatever the sampler then did with it. `score(logits, targets, top)` scores one target token per row
and, when `top` > 0, lists the `top` most likely tokens of that row, most likely first.

Plain values, computed in the executor's worker thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, final

import torch

MAX_TOP_LOGPROBS: Final = 20  # as OpenAI's and vLLM's default `max_logprobs`
_ROWS_AT_ONCE: Final = 256  # rows of logits scored together (a prompt's: [rows, vocab] float32)


@final
@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """`token_id`'s log-probability and the `top` alternatives `(token_id, logprob)`, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def score(logits: torch.Tensor, targets: Sequence[int], top: int) -> list[TokenLogprobs]:
    """Row `i` of `logits` `[n, vocab]` scores `targets[i]` (see the module docstring)."""
    if logits.dim() != 2 or logits.shape[0] != len(targets):
        raise ValueError(f"score: logits {list(logits.shape)} for {len(targets)} targets")
    out: list[TokenLogprobs] = []
    for start in range(0, len(targets), _ROWS_AT_ONCE):
        rows = logits[start : start + _ROWS_AT_ONCE].to(dtype=torch.float32)
        logp = torch.log_softmax(rows, dim=-1)
        wanted = torch.tensor(targets[start : start + _ROWS_AT_ONCE], dtype=torch.int64, device=logp.device)
        chosen = logp.gather(1, wanted[:, None]).squeeze(1).cpu().tolist()
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
        if top > 0:
            best = torch.topk(logp, min(top, logp.shape[1]), dim=-1, sorted=True)
            values = best.values.cpu().tolist()
            indices = best.indices.cpu().tolist()
            tops = [tuple(zip(ids, vals, strict=True)) for ids, vals in zip(indices, values, strict=True)]
        for target, logprob, alternatives in zip(wanted.tolist(), chosen, tops, strict=True):
            out.append(TokenLogprobs(target, logprob, alternatives))
    return out
