"""Sampling on the logits' own device: the tokens `sample_tokens` picks, batched, with no host sync.

`sample_tokens` (replicas/model/sampling.py) reads every sampled row back to the host and picks one row at a
time; a GPU decode step cannot afford those syncs. Here the host builds the step's small inputs once
(`SamplingInputs.build`: the (seed, index) draws, temperatures, top-p, which rows are sampled, the EOS
bans, the bias and penalties' `LogitAdjustments`; it reads no device memory) and `sample_on_device` picks every row with tensor ops on the logits'
device; the caller reads the `[batch]` result once.

Invariants:
- On CPU tensors the picks are exactly `sample_tokens`'s, row for row: the float64 arithmetic of
  `sample_one` is done in the same order on the same values, batched over rows (see `_sample_rows`).
- A row's pick depends on its own logits and parameters only, never on the other rows of the batch.
- Greedy rows are `argmax` of the (EOS-banned) logits, first maximum wins, as in `sample_tokens`; only the
  sampled rows go through the float64 softmax and sort, so an all-greedy batch costs one argmax.
- The caller's logits are never modified (bias, penalties and the EOS ban write into a copy).
- Bias and penalties are `adjust_logits`, the very function `sample_tokens` calls, applied first.

On a GPU the float64 softmax and cumsum may round differently from the CPU's in the last bit (another
reduction order, another `exp`), so a pick can differ from `sample_tokens`'s only where the draw lands
within ~1e-15 (relative) of a boundary between two tokens' cumulative probabilities, or the top-p cut
within ~1e-15 of a cumulative value it is compared with — with 53-bit draws, about one sampled token in
1e13 — or, at temperatures so high (>~1e8) that distinct logits scale to within an ulp of each other,
where two nearly equal probabilities tie on one device (ordered by id) and not on the other. Everything
else (the shift by the max, the division by the temperature, the stable descending sort of given values,
the top-p count, the draw times the kept total, the right-sided search) is exact IEEE arithmetic or
comparison, the same on every device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import torch

from replicas.model.sampling import (
    LogitAdjustments,
    SamplingParams,
    TokenHistory,
    adjust_logits,
    mask_logits,
    uniform_draw,
)

__all__ = ["SamplingInputs", "sample_on_device", "sample_tokens_on_device"]


@final
@dataclass(frozen=True, slots=True)
class SamplingInputs:
    """The per-step inputs of device sampling, built on the host once per step (no device reads).

    Invariants (established by `build`): all tensors are on `device`, 1-D and contiguous;
    - `sampled_rows` int64 `[S]`: the batch rows that are not greedy, ascending; `draws` (the
      `uniform_draw(seed, index)` of each), `temperatures` and `top_p` are float64 `[S]`, aligned with it;
    - `ban_rows`, `ban_ids` int64 `[K]`: the (row, token id) pairs whose logits are set to -inf first — the
      EOS ids of rows whose token index is below `eos_banned_before`; `ban_id_min` / `ban_id_max` are
      their extremes on the host (0 when K = 0), to check the ids against the vocabulary without a read.
    - `adjustments`: the rows' bias and penalties (`replicas.model.sampling.LogitAdjustments`), None when
      no row sets any.
    Greedy rows without a ban, a bias or a penalty add nothing to any tensor.
    """

    batch_size: int
    device: torch.device
    sampled_rows: torch.Tensor
    draws: torch.Tensor
    temperatures: torch.Tensor
    top_p: torch.Tensor
    ban_rows: torch.Tensor
    ban_ids: torch.Tensor
    ban_id_min: int
    ban_id_max: int
    adjustments: LogitAdjustments | None = None

    @property
    def num_sampled(self) -> int:
        """S, the number of rows that are sampled (not greedy); known on the host."""
        return int(self.sampled_rows.shape[0])

    @property
    def num_bans(self) -> int:
        """K, the number of (row, id) pairs banned; known on the host."""
        return int(self.ban_rows.shape[0])

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        token_indices: Sequence[int],
        device: torch.device,
        *,
        histories: Sequence[TokenHistory | None] | None = None,
    ) -> SamplingInputs:
        """The inputs for a batch where row b samples the token at `token_indices[b]` under `params[b]`
        (its penalties reading `histories[b]`).

        Two host tensors (float64 per-row values, int64 rows and ids), pinned when `device` is CUDA, each
        moved with one non-blocking copy; the per-row tensors are views of those copies.
        """
        if len(params) != len(token_indices):
            raise ValueError(f"SamplingInputs.build: {len(params)} params, {len(token_indices)} indices")
        device = torch.device(device)
        sampled: list[int] = []
        draws: list[float] = []
        temperatures: list[float] = []
        top_p: list[float] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for row, (p, index) in enumerate(zip(params, token_indices, strict=True)):
            if not p.greedy:
                sampled.append(row)
                draws.append(uniform_draw(p.seed, index))
                temperatures.append(p.temperature)
                top_p.append(p.top_p)
            if p.eos_token_ids and index < p.eos_banned_before:
                ban_rows.extend([row] * len(p.eos_token_ids))
                ban_ids.extend(p.eos_token_ids)
        pin = device.type == "cuda"
        host_values = torch.tensor(draws + temperatures + top_p, dtype=torch.float64, pin_memory=pin)
        host_indices = torch.tensor(sampled + ban_rows + ban_ids, dtype=torch.int64, pin_memory=pin)
        floats = host_values.to(device, non_blocking=True)
        ints = host_indices.to(device, non_blocking=True)
        s, k = len(sampled), len(ban_rows)
        return cls(
            batch_size=len(params),
            device=floats.device,
            sampled_rows=ints[:s],
            draws=floats[:s],
            temperatures=floats[s : 2 * s],
            top_p=floats[2 * s :],
            ban_rows=ints[s : s + k],
            ban_ids=ints[s + k :],
            ban_id_min=min(ban_ids, default=0),
            ban_id_max=max(ban_ids, default=0),
            adjustments=LogitAdjustments.build(params, histories, floats.device),
        )


def sample_on_device(
    logits: torch.Tensor, inputs: SamplingInputs, *, masks: Sequence[torch.Tensor | None] | None = None
) -> torch.Tensor:
    """[B, V] float32 logits on any device → int64 [B] tokens on that device, the same tokens
    `sample_tokens` picks. No host sync inside (no .item()/.tolist()/.cpu(), no Python branch on tensor
    values): the caller reads the result once. `masks`: each row's allowed tokens, as `sample_tokens`
    takes them (one copy to the device).

    Python branches here only on host-known sizes (S, K, B, V). Raises ValueError when the logits do not fit
    `inputs` (shape, device) and IndexError for a banned id outside the vocabulary, as `sample_tokens`
    does; negative ids count from the end of the vocabulary, as torch indexing does.
    """
    if logits.dim() != 2 or logits.shape[0] != inputs.batch_size:
        raise ValueError(f"sample_on_device: logits {list(logits.shape)} for a batch of {inputs.batch_size}")
    if not _same_device(logits.device, inputs.device):
        raise ValueError(f"sample_on_device: logits on {logits.device}, inputs on {inputs.device}")
    vocab = int(logits.shape[1])
    if inputs.adjustments is not None:
        logits = adjust_logits(logits, inputs.adjustments)
    if inputs.num_bans:
        if not -vocab <= inputs.ban_id_min <= inputs.ban_id_max < vocab:
            raise IndexError(
                f"sample_on_device: EOS ids in [{inputs.ban_id_min}, {inputs.ban_id_max}] "
                f"outside a vocabulary of {vocab}"
            )
        logits = logits.clone(memory_format=torch.contiguous_format)
        flat = inputs.ban_rows * vocab + torch.remainder(inputs.ban_ids, vocab)
        logits.view(-1).index_fill_(0, flat, float("-inf"))
    logits = mask_logits(logits, masks)
    chosen = logits.argmax(dim=-1)
    if inputs.num_sampled:
        picks = _sample_rows(logits.index_select(0, inputs.sampled_rows), inputs)
        chosen = chosen.index_copy(0, inputs.sampled_rows, picks)
    return chosen


def sample_tokens_on_device(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    token_indices: Sequence[int],
    *,
    histories: Sequence[TokenHistory | None] | None = None,
    masks: Sequence[torch.Tensor | None] | None = None,
) -> list[int]:
    """Convenience: build + sample + one .tolist()."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(token_indices):
        raise ValueError(
            f"sample_tokens_on_device: logits {list(logits.shape)}, {len(params)} params, "
            f"{len(token_indices)} indices"
        )
    tokens: list[int] = sample_on_device(
        logits, SamplingInputs.build(params, token_indices, logits.device, histories=histories), masks=masks
    ).tolist()
    return tokens


def _sample_rows(rows: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """`sample_one` for each of the `[S, V]` sampled rows (already EOS-banned) → int64 `[S]` token ids.

    Step for step what `sample_one` computes for one row, in float64, batched over the rows' last dim:
    1. `scaled = (row - row.max()) / T` — elementwise, exact IEEE (T a tensor, so a CUDA division is a true
       division, not a multiplication by 1/T, which a Python scalar would get there and which overflows for
       a tiny T);
    2. `probs = softmax(scaled)`, `sorted, order = sort(probs, descending, stable)` — ties keep id order;
    3. `cumulative = cumsum(sorted)`: CPU's cumsum is a sequential sum along the row, so the cumsum of the
       kept prefix `sorted[:keep]` that `sample_one` takes is bitwise the first `keep` values of this one;
    4. `keep = count(cumulative - sorted < top_p)` when top_p < 1, else V; at least 1;
    5. `target = draw * cumulative[keep - 1]`;
    6. `searchsorted(cumulative[:keep], target, right=True)` is the number of the kept values <= target (the
       prefix is non-decreasing: sums of non-negative numbers); the tail beyond `keep` is set to +inf
       instead of sliced off, which leaves that count unchanged (an all-NaN row — all logits -inf — also
       ends at the same position: every comparison with NaN is false). With the clamp of step 7 the mask
       changes nothing where the cumsum is non-decreasing (CPU); it keeps the search inside the kept
       prefix where a parallel scan is not;
    7. the position clamped to `keep - 1`, and `order` at it.
    """
    vocab = rows.shape[1]
    x = rows.to(torch.float64)  # a fresh tensor: `rows` came from index_select
    x.sub_(x.amax(dim=-1, keepdim=True)).div_(inputs.temperatures[:, None])
    probs = torch.softmax(x, dim=-1)
    del x
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    del probs
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    before = cumulative - sorted_probs
    del sorted_probs
    counted = (before < inputs.top_p[:, None]).sum(dim=-1)
    del before
    keep = torch.where(inputs.top_p < 1.0, counted, vocab).clamp_min_(1)
    last = (keep - 1)[:, None]
    target = inputs.draws[:, None] * cumulative.gather(1, last)
    positions = torch.arange(vocab, device=rows.device)
    cumulative.masked_fill_(positions >= keep[:, None], float("inf"))
    position = torch.searchsorted(cumulative, target, right=True)
    return order.gather(1, torch.minimum(position, last)).squeeze(1)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one; a CUDA device without an index is the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
