"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and 1-D or 3-D positions.

The arithmetic mirrors transformers' reference implementation operation by operation (float32
frequencies, `cat(freqs, freqs)`, `cos`/`sin`, then a cast to the model dtype), so float32 logits agree
with HF to rounding. 3-D positions (Qwen2-VL's multimodal rotary scheme): the `head_dim // 2` frequency
pairs are split into three sections; section i rotates by axis i of the position (t, h, w). A text
token has t = h = w, which makes it identical to 1-D rotary.
"""

from __future__ import annotations

import math
from typing import final

import torch

from replicas.model.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """`[head_dim // 2]` float32 inverse frequencies, computed on CPU (so every device agrees)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    match rope.scaling:
        case "default":
            return inv_freq
        case "linear":
            return inv_freq / rope.factor
        case "llama3":
            return _llama3(inv_freq, rope)
    raise AssertionError(f"unknown rope scaling {rope.scaling!r}")


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@final
class Rotary:
    """Turns token positions into the `(cos, sin)` pair every layer applies. Immutable after construction."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        self.head_dim = head_dim
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)
        self.axes = 1 if rope.mrope_section is None else 3
        self.axis_of_frequency: torch.Tensor | None = None
        if rope.mrope_section is not None:
            axis = torch.cat(
                [torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(rope.mrope_section)]
            )
            self.axis_of_frequency = axis.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`positions` `[N]` (1-D; for a 3-D model it means t = h = w) or `[N, 3]` → two `[N, head_dim // 2]`.

        Only one half is returned: transformers' tables are `cat(freqs, freqs)`, both halves equal.
        """
        if positions.dim() == 2:
            if self.axis_of_frequency is None:
                raise ValueError("3-D positions given to a model with 1-D rotary embeddings")
            per_frequency = positions[:, self.axis_of_frequency].to(torch.float)
            freqs = per_frequency * self.inv_freq
        else:
            freqs = positions[:, None].to(torch.float) * self.inv_freq
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x` `[N, heads, head_dim]`, `cos`/`sin` `[N, head_dim // 2]` → a new contiguous tensor.

    Computes transformers' `x * cos + rotate_half(x) * sin` half by half, without its temporaries:
    first half `x1 * c - x2 * s`, second half `x2 * c + x1 * s`.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    first, second = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=first)
    first.addcmul_(x2, s, value=-1)
    torch.mul(x2, c, out=second)
    second.addcmul_(x1, s)
    return out
