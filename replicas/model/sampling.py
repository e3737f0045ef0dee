"""Choosing the next token: greedy, or temperature / top-p with randomness fixed by (seed, index).

The random draw for the token at index `i` of a sequence (prompt tokens count, so the first generated
token of a 10-token prompt has index 10) is one uniform number derived from a hash of `(seed, i)`. It does
not depend on the batch, the replica, the device or how many tokens were sampled before — so a prefill
replica can sample the first token and a decode replica the rest, with the same result as one replica.
The choice itself is an inverse-CDF lookup over the probabilities in float64 on CPU, sorted by
probability (ties by token id), after the top-p cut.

Before the EOS ban and the choice, a row's logits are adjusted as vLLM adjusts them (`adjust_logits`):
`logit_bias` added by token id, then the repetition penalty over the prompt and the generated tokens
(a seen token's logit divided by it when positive, multiplied when not), then the frequency penalty
times each token's count among the generated tokens and the presence penalty once for each generated
token, both subtracted. The adjustment is a function of the params and the row's `TokenHistory` (the
prompt's ids and the ids generated before the token sampled), which the sequence carries — so it stays
as pure as the draw, and whichever replica samples gets the same token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Final, Literal, final

import msgspec
import torch

from messages.grammar import Grammar
from replicas.model.errors import ModelInputError

FinishReason = Literal["stop", "length"]

MAX_PENALTY: Final = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's
MAX_LOGIT_BIAS: Final = 100.0  # a logit bias lies in [-100, 100], as OpenAI's


@final
class SamplingError(ModelInputError, ValueError):
    """Sampling parameters out of range (temperature < 0, top_p outside (0, 1], a penalty or bias outside
    its range, a biased token id outside the vocabulary)."""


@final
class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`temperature` 0 means greedy (then `top_p` and `seed` do not matter).

    `min_tokens`: the tokens at indices below `eos_banned_before` (the prompt's length plus the request's
    `min_tokens`) are never one of `eos_token_ids` — their logits are masked before greedy or sampled
    choice, as vLLM's `min_tokens` does — so a generation runs at least that long.

    `grammar`: the output's structure (`messages.grammar`); each step's allowed tokens come as a mask
    (`replicas.model.text.grammar`), applied to the logits after the EOS ban, before the choice.
    Penalties and bias, as vLLM's (see the module docstring): `presence_penalty` and `frequency_penalty`
    in [-2, 2] (0: off), `repetition_penalty` > 0 (1: off), `logit_bias` (token id, value) pairs with
    ids >= 0, distinct, and values in [-100, 100]. Rows whose params set a penalty need their sequence's
    `TokenHistory`; bias alone does not.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    eos_banned_before: int = 0
    eos_token_ids: tuple[int, ...] = ()
    grammar: Grammar | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise SamplingError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise SamplingError(f"{name} must be in [-2, 2], got {value}")
        if not (self.repetition_penalty > 0.0 and self.repetition_penalty < float("inf")):
            raise SamplingError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        ids = [token for token, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise SamplingError("logit_bias names a token id twice")
        for token, value in self.logit_bias:
            if token < 0:
                raise SamplingError(f"logit_bias token id {token} is negative")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise SamplingError(f"logit_bias[{token}] must be in [-100, 100], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """A penalty is set: sampling this row reads its `TokenHistory`."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """A penalty or a bias is set: `adjust_logits` changes this row."""
        return self.penalized or bool(self.logit_bias)


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


@final
@dataclass(frozen=True, slots=True)
class TokenHistory:
    """What a row's penalties look at: the prompt's token ids and the ids generated before the sampled
    token (none for a prefill's first token; a decode step's include the token it feeds)."""

    prompt: Sequence[int]
    generated: Sequence[int]


def token_history(
    params: SamplingParams, prompt: Sequence[int], generated: Sequence[int]
) -> TokenHistory | None:
    """A sequence's `history`: copies of `prompt` and `generated` when `params` sets a penalty, else None
    (nothing copied for a request that does not need it)."""
    return TokenHistory(tuple(prompt), tuple(generated)) if params.penalized else None


@final
@dataclass(frozen=True, slots=True)
class LogitAdjustments:
    """The per-step inputs of `adjust_logits`, built on the host once (`build`; no device reads).

    Invariants: all tensors on one device, 1-D; `rows` int64 `[R]` are the batch rows whose params adjust
    logits, ascending; `presence`, `frequency`, `repetition` float32 `[R]` aligned with it. The pairs
    (`bias_rows`, `bias_ids`) → `bias_values`, (`seen_rows`, `seen_ids`) (prompt and generated tokens) and
    (`out_rows`, `out_ids`) (generated tokens, repeated as often as generated) index `[R, vocab]`: their
    rows are positions in `rows`. `max_id` is the largest id of any pair (-1 when none), on the host, so
    ids are checked against the vocabulary without a read.
    """

    rows: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor
    bias_rows: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    seen_rows: torch.Tensor
    seen_ids: torch.Tensor
    out_rows: torch.Tensor
    out_ids: torch.Tensor
    max_id: int

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        histories: Sequence[TokenHistory | None] | None,
        device: torch.device | str,
    ) -> LogitAdjustments | None:
        """The adjustments of a batch (None when no row has any). A penalized row without a history is
        a caller's bug: `ValueError`."""
        rows = [row for row, p in enumerate(params) if p.adjusts_logits]
        if not rows:
            return None
        if histories is not None and len(histories) != len(params):
            raise ValueError(f"LogitAdjustments: {len(params)} params, {len(histories)} histories")
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        seen_rows: list[int] = []
        seen_ids: list[int] = []
        out_rows: list[int] = []
        out_ids: list[int] = []
        for position, row in enumerate(rows):
            p = params[row]
            for token, value in p.logit_bias:
                bias_rows.append(position)
                bias_ids.append(token)
                bias_values.append(value)
            if not p.penalized:
                continue
            history = None if histories is None else histories[row]
            if history is None:
                raise ValueError(f"row {row} sets a penalty but its sequence carries no token history")
            for ids in (history.prompt, history.generated):
                seen_rows.extend([position] * len(ids))
                seen_ids.extend(ids)
            out_rows.extend([position] * len(history.generated))
            out_ids.extend(history.generated)
        floats = [params[r].presence_penalty for r in rows]
        floats += [params[r].frequency_penalty for r in rows]
        floats += [params[r].repetition_penalty for r in rows]
        floats += bias_values
        device = torch.device(device)
        pin = device.type == "cuda"
        ints = rows + bias_rows + bias_ids + seen_rows + seen_ids + out_rows + out_ids
        host_ints = torch.tensor(ints, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=True)
        host_floats = torch.tensor(floats, dtype=torch.float32, pin_memory=pin).to(device, non_blocking=True)
        r, b, k, o = len(rows), len(bias_rows), len(seen_rows), len(out_rows)
        cuts = [0, r, r + b, r + 2 * b, r + 2 * b + k, r + 2 * b + 2 * k, r + 2 * b + 2 * k + o, len(ints)]
        pieces = [host_ints[cuts[i] : cuts[i + 1]] for i in range(7)]
        return cls(
            rows=pieces[0],
            presence=host_floats[:r],
            frequency=host_floats[r : 2 * r],
            repetition=host_floats[2 * r : 3 * r],
            bias_rows=pieces[1],
            bias_ids=pieces[2],
            bias_values=host_floats[3 * r :],
            seen_rows=pieces[3],
            seen_ids=pieces[4],
            out_rows=pieces[5],
            out_ids=pieces[6],
            max_id=max(max(bias_ids, default=-1), max(seen_ids, default=-1)),
        )


def adjust_logits(logits: torch.Tensor, adjustments: LogitAdjustments) -> torch.Tensor:
    """`[B, vocab]` logits with bias and penalties applied to the adjusted rows (a new tensor; the
    caller's is never modified), vLLM's formula in float32:

        x += bias;  x = x / r if x > 0 else x * r  (r = repetition where the token was seen, else 1)
        x -= frequency * count_generated;  x -= presence * (count_generated > 0)

    The same tensor ops on every device (no host sync, Python branches on sizes only), so the host's
    and a device's picks agree. `SamplingError` for an id outside the vocabulary.
    """
    vocab = int(logits.shape[1])
    if adjustments.max_id >= vocab:
        raise SamplingError(
            f"token id {adjustments.max_id} (logit_bias or history) is outside a vocabulary of {vocab}"
        )
    a = adjustments
    x = logits.index_select(0, a.rows).to(torch.float32)
    if a.bias_rows.shape[0]:
        x.index_put_((a.bias_rows, a.bias_ids), a.bias_values, accumulate=True)
    counts = torch.zeros_like(x)
    counts.index_put_(
        (a.out_rows, a.out_ids), torch.ones_like(a.out_ids, dtype=torch.float32), accumulate=True
    )
    seen = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    seen[a.seen_rows, a.seen_ids] = True
    repetition = torch.where(seen, a.repetition[:, None], torch.ones_like(x))
    x = torch.where(x > 0, x / repetition, x * repetition)
    x = x - a.frequency[:, None] * counts
    x = x - a.presence[:, None] * (counts > 0).to(torch.float32)
    out = logits.clone()
    out.index_copy_(0, a.rows, x.to(out.dtype))
    return out


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_indices: Sequence[int],
    *,
    histories: Sequence[TokenHistory | None] | None = None,
    masks: Sequence[torch.Tensor | None] | None = None,
) -> list[int]:
    """One token per row of `logits` `[batch, vocab]`; row b is the token at `token_indices[b]`, its
    penalties reading `histories[b]` (needed only for rows that set a penalty), chosen among the tokens
    `masks[b]` allows (`mask_logits`; None: all)."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(token_indices):
        raise ValueError(
            f"sample_tokens: logits {list(logits.shape)}, {len(params)} params, {len(token_indices)} indices"
        )
    adjustments = LogitAdjustments.build(params, histories, logits.device)
    if adjustments is not None:
        logits = adjust_logits(logits, adjustments)
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
