"""Choosing the next token: greedy, or temperature / top-p with randomness fixed by (seed, index).

The random draw for the token at index `i` of a sequence (prompt tokens count, so the first generated
token of a 10-token prompt has index 10) is one uniform number derived from a hash of `(seed, i)`. It does
not depend on the batch, the replica, the device or how many tokens were sampled before — so a prefill
replica can sample the first token and a decode replica the rest, with the same result as one replica.
The choice itself is an inverse-CDF lookup over the probabilities in float64 on CPU, sorted by
probability (ties by token id), after the top-p cut.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from typing import Literal, final

import msgspec
import torch

from messages.grammar import Grammar
from replicas.model.errors import ModelInputError

FinishReason = Literal["stop", "length"]


@final
class SamplingError(ModelInputError, ValueError):
    """Sampling parameters out of range (temperature < 0, top_p outside (0, 1])."""


@final
class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`temperature` 0 means greedy (then `top_p` and `seed` do not matter).

    `min_tokens`: the tokens at indices below `eos_banned_before` (the prompt's length plus the request's
    `min_tokens`) are never one of `eos_token_ids` — their logits are masked before greedy or sampled
    choice, as vLLM's `min_tokens` does — so a generation runs at least that long.

    `grammar`: the output's structure (`messages.grammar`); each step's allowed tokens come as a mask
    (`replicas.model.text.grammar`), applied to the logits after the EOS ban, before the choice.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    eos_banned_before: int = 0
    eos_token_ids: tuple[int, ...] = ()
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def uniform_draw(seed: int, token_index: int) -> float:
    """The uniform number in [0, 1) used to sample the token at `token_index` under `seed`."""
    digest = hashlib.blake2b(f"{seed}:{token_index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def mask_logits(logits: torch.Tensor, masks: Sequence[torch.Tensor | None] | None) -> torch.Tensor:
    """`logits` `[batch, vocab]` with the tokens `masks[b]` (bool `[vocab]`, True = allowed; None: all)
    disallows set to -inf in row b — a copy when any row has a mask, on the logits' device."""
    if masks is None or all(mask is None for mask in masks):
        return logits
    if len(masks) != logits.shape[0]:
        raise ValueError(f"mask_logits: {len(masks)} masks for logits {list(logits.shape)}")
    rows = [row for row, mask in enumerate(masks) if mask is not None]
    allowed = torch.stack([mask for mask in masks if mask is not None])
    if allowed.shape[1] != logits.shape[1]:
        raise ValueError(f"mask_logits: masks of {allowed.shape[1]} tokens for logits {list(logits.shape)}")
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    allowed = allowed.to(logits.device, non_blocking=True)
    picked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy(0, index, picked)


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_indices: Sequence[int],
    masks: Sequence[torch.Tensor | None] | None = None,
) -> list[int]:
    """One token per row of `logits` `[batch, vocab]`; row b is the token at `token_indices[b]`, chosen
    among the tokens `masks[b]` allows (`mask_logits`; None: all)."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(token_indices):
        raise ValueError(
            f"sample_tokens: logits {list(logits.shape)}, {len(params)} params, {len(token_indices)} indices"
        )
    banned = [
        row
        for row, (p, index) in enumerate(zip(params, token_indices, strict=True))
        if p.eos_token_ids and index < p.eos_banned_before
    ]
    if banned:
        logits = logits.clone()
        for row in banned:
            logits[row, list(params[row].eos_token_ids)] = float("-inf")
    logits = mask_logits(logits, masks)
    chosen = logits.argmax(dim=-1).tolist()
    for row, (p, index) in enumerate(zip(params, token_indices, strict=True)):
        if not p.greedy:
            chosen[row] = sample_one(logits[row], p, index)
    return chosen


def sample_one(logits: torch.Tensor, params: SamplingParams, token_index: int) -> int:
    """Temperature / top-p sampling of one `[vocab]` row with the (seed, index) draw."""
    row = logits.detach().to(device="cpu", dtype=torch.float64)
    # Shifted so the largest is 0 before dividing: a tiny temperature (5e-324 passes the bounds) then gives
    # 0 and -inf — the greedy limit — where the unshifted logits overflowed to inf and softmax to NaN.
    scaled = (row - row.max()) / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    order = torch.sort(probs, descending=True, stable=True)
    sorted_probs = order.values
    if params.top_p < 1.0:
        before = torch.cumsum(sorted_probs, dim=0) - sorted_probs
        keep = int((before < params.top_p).sum().item())
        sorted_probs = sorted_probs[: max(keep, 1)]
    cumulative = torch.cumsum(sorted_probs, dim=0)
    target = uniform_draw(params.seed, token_index) * cumulative[-1].item()
    position = int(
        torch.searchsorted(cumulative, torch.tensor([target], dtype=torch.float64), right=True).item()
    )
    position = min(position, sorted_probs.shape[0] - 1)
    return int(order.indices[position].item())


def finish_reason(
    generated: Sequence[int], params: SamplingParams, eos_token_ids: Collection[int], max_tokens: int
) -> FinishReason | None:
    """Why a generation that produced `generated` must stop now, or None to go on."""
    if generated and not params.ignore_eos and generated[-1] in eos_token_ids:
        return "stop"
    if len(generated) >= max_tokens:
        return "length"
    return None
