"""The executor's batch types: the sequences of a prefill or decode call and what each call returns.

Plain values; a caller builds them, the executor validates them before any write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import torch

from replicas.model.executor.logprobs import TokenLogprobs
from replicas.model.sampling import GREEDY, SamplingParams, TokenHistory


@final
@dataclass(frozen=True, slots=True)
class PrefillSequence:
    """One sequence of a prefill batch.

    `token_ids` are the new tokens, written at indices `[cached_tokens, cached_tokens + len)`.
    `positions`: rotary positions, `[T]` or (3-D models) `[T, 3]`; default `cached_tokens + arange(T)`.
    `embeds` `[n, hidden]` replace the token embeddings at `embed_indices` (indices into `token_ids`).
    `logprobs`: score the sampled token with that many alternatives (`replicas.model.executor.logprobs`;
    None: not scored). `prompt_logprobs`: score every token of `token_ids` but the first from the row
    before it, with that many alternatives, and `next_token` — the prompt's token after these (a chunk
    that does not end its prompt) — from the last row. `token_mask`: the tokens the sampled one may be
    (bool `[vocab]`, True = allowed; None: any), as a request's grammar allows them.
    `history`: the prompt's ids and the generated ones, which the sampling's penalties read; set only
    when `sampling.penalized` (None otherwise: no copy for requests that do not need one).
    """

    block_table: Sequence[int]
    token_ids: Sequence[int] | torch.Tensor
    cached_tokens: int = 0
    positions: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    embed_indices: Sequence[int] | torch.Tensor | None = None
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    next_token: int | None = None
    token_mask: torch.Tensor | None = None
    history: TokenHistory | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@final
@dataclass(frozen=True, slots=True)
class PrefillResult:
    """`hidden` (packed `[sum T, hidden]`, sequences in order) when the range stops before the last layer;
    otherwise `logits` `[B, vocab]` float32 of each sequence's last token and the sampled `tokens`.
    `logprobs[b]`: the sampled token's, where sequence b asked; `prompt_logprobs[b]`: its prompt tokens'
    (`PrefillSequence`), where it asked."""

    hidden: torch.Tensor | None
    logits: torch.Tensor | None
    tokens: list[int] | None
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None


@final
@dataclass(frozen=True, slots=True)
class DecodeSequence:
    """Feed `token_id` at index `cached_tokens` (its KV lands there) and sample the token after it.
    `position` is its rotary position (default `cached_tokens`; differs after images). `logprobs`: score
    the sampled token with that many alternatives (None: not scored). `token_mask`: the tokens the sampled
    one may be (bool `[vocab]`, True = allowed; None: any). `history`: as `PrefillSequence`'s (its
    generated ids end with `token_id`)."""

    block_table: Sequence[int]
    cached_tokens: int
    token_id: int
    position: int | None = None
    sampling: SamplingParams = GREEDY
    logprobs: int | None = None
    token_mask: torch.Tensor | None = None
    history: TokenHistory | None = None


@final
@dataclass(frozen=True, slots=True)
class DecodeResult:
    logits: torch.Tensor
    tokens: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
