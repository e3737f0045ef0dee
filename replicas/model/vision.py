"""The built-in tiny model's vision encoder: RGB uint8 images → one embedding row per 16×16 patch.

An image `[H, W, 3]` (H and W positive multiples of 16) becomes a grid of `h = H/16` by `w = W/16`
patches (t = 1 for a still image), read row-major, so a 512×512 image gives 1024 rows. Each row is in the
language model's hidden size, float32. The encoder: patch projection, 2-D sinusoidal patch positions, one
block of depthwise 3×3 mixing over the patch grid plus a SwiGLU MLP, and a projection to the language
model's hidden size — linear in the number of patches. Weights are seeded (same seed → same weights).

`ImageEmbedding` is exactly what the encode replica writes into the node's embedding pool (`embeds
[hidden] float32`, `token_ids [] int64`, `positions [3] int64` per row) plus the per-image `ImageGrid`
header. Positions are the patch's grid coordinates (t, h, w) *relative to the image*; the language side
offsets them by the image's starting rotary position (`replicas.model.text.prompt.layout_prompt`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import msgspec
import numpy as np
import torch
import torch.nn.functional as F

from messages.layout import BufferSpec, PoolLayout
from replicas.model.errors import ImageSizeError

PATCH_SIZE = 16
DEFAULT_EMBEDDING_BLOCK_SIZE = 128


def embedding_layout(hidden_size: int, block_size: int = DEFAULT_EMBEDDING_BLOCK_SIZE) -> PoolLayout:
    """The node's embedding pool layout (architecture §4): per row `embeds [hidden] float32`, `token_ids [] int64`,
    `positions [3] int64` — exactly the fields of `ImageEmbedding`."""
    return PoolLayout(
        block_size=block_size,
        buffers=(
            BufferSpec(name="embeds", shape=(hidden_size,), dtype="float32"),
            BufferSpec(name="token_ids", shape=(), dtype="int64"),
            BufferSpec(name="positions", shape=(3,), dtype="int64"),
        ),
    )


@final
class ImageGrid(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Patch grid of one image: `t` frames × `h` rows × `w` columns (one embedding row per cell)."""

    t: int
    h: int
    w: int

    @property
    def rows(self) -> int:
        return self.t * self.h * self.w


@final
@dataclass(frozen=True, slots=True)
class ImageEmbedding:
    """One image's rows: `embeds` `[rows, hidden]` float32, `token_ids` `[rows]` int64 (the image token),
    `positions` `[rows, 3]` int64 grid coordinates; `grid` is the per-image header."""

    grid: ImageGrid
    embeds: torch.Tensor
    token_ids: torch.Tensor
    positions: torch.Tensor


def embedding_rows(embedding: ImageEmbedding) -> dict[str, torch.Tensor]:
    """An image's rows as the buffers of `embedding_layout` (ready for `PoolStorage.scatter`)."""
    return {"embeds": embedding.embeds, "token_ids": embedding.token_ids, "positions": embedding.positions}


@final
class VisionConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    out_hidden: int
    width: int = 64
    mlp_width: int = 128
    patch_size: int = PATCH_SIZE
    seed: int = 0


def check_image(
    image: torch.Tensor | np.ndarray, index: int = 0, patch_size: int = PATCH_SIZE
) -> torch.Tensor:
    """The image as a uint8 `[H, W, 3]` tensor, or `ImageSizeError` naming what is wrong."""
    tensor = torch.from_numpy(np.ascontiguousarray(image)) if isinstance(image, np.ndarray) else image
    if tensor.dtype != torch.uint8 or tensor.dim() != 3 or tensor.shape[2] != 3:
        raise ImageSizeError(
            f"image {index}: expected RGB uint8 [height, width, 3], got {tensor.dtype} {list(tensor.shape)}"
        )
    height, width = int(tensor.shape[0]), int(tensor.shape[1])
    for side, value in (("height", height), ("width", width)):
        if value < patch_size or value % patch_size:
            raise ImageSizeError(
                f"image {index}: {side} {value} is not a positive multiple of {patch_size} "
                f"(image is {width}x{height})"
            )
    return tensor


def image_grid(width: int, height: int, patch_size: int = PATCH_SIZE) -> ImageGrid:
    """The grid an image of this size gets (sides must already be valid)."""
    return ImageGrid(t=1, h=height // patch_size, w=width // patch_size)


def image_positions(grid: ImageGrid) -> torch.Tensor:
    """`[rows, 3]` int64 grid coordinates (t, h, w) of an image's rows, in row-major order."""
    t = torch.arange(grid.t, dtype=torch.int64).repeat_interleave(grid.h * grid.w)
    h = torch.arange(grid.h, dtype=torch.int64).repeat_interleave(grid.w).repeat(grid.t)
    w = torch.arange(grid.w, dtype=torch.int64).repeat(grid.t * grid.h)
    return torch.stack([t, h, w], dim=1)


@final
class VisionEncoder:
    """Seeded tiny encoder. `encode` is thread-safe; `invocations` counts calls, `images_encoded` images."""

    def __init__(self, config: VisionConfig, image_token_id: int, device: str | torch.device = "cpu") -> None:
        self.config = config
        self.image_token_id = image_token_id
        self.device = torch.device(device)
        generator = torch.Generator(device="cpu").manual_seed(config.seed)
        patch_dim = 3 * config.patch_size**2
        width, mlp_width = config.width, config.mlp_width

        def normal(*shape: int, std: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator, dtype=torch.float32) * std).to(self.device)

        self.patch_weight = normal(width, patch_dim, std=1 / math.sqrt(patch_dim))
        self.patch_bias = normal(width, std=0.02)
        self.mix_weight = normal(width, 1, 3, 3, std=1 / 3)
        self.gate_up_weight = normal(2 * mlp_width, width, std=1 / math.sqrt(width))
        self.down_weight = normal(width, mlp_width, std=1 / math.sqrt(mlp_width))
        self.proj_weight = normal(config.out_hidden, width, std=1 / math.sqrt(width))
        self._lock = threading.Lock()
        self._invocations = 0
        self._images = 0

    @property
    def invocations(self) -> int:
        with self._lock:
            return self._invocations

    @property
    def images_encoded(self) -> int:
        with self._lock:
            return self._images

    def encode(self, images: Sequence[torch.Tensor | np.ndarray]) -> list[ImageEmbedding]:
        """One `ImageEmbedding` per image, in order. Raises `ImageSizeError` before any compute."""
        checked = [check_image(image, i, self.config.patch_size) for i, image in enumerate(images)]
        with self._lock:
            self._invocations += 1
            self._images += len(checked)
        with torch.inference_mode():
            return [self._encode_one(image) for image in checked]

    def _encode_one(self, image: torch.Tensor) -> ImageEmbedding:
        p = self.config.patch_size
        height, width = int(image.shape[0]), int(image.shape[1])
        grid = image_grid(width, height, p)
        pixels = image.to(self.device, torch.float32) / 127.5 - 1.0
        patches = (
            pixels.view(grid.h, p, grid.w, p, 3).permute(0, 2, 1, 3, 4).reshape(grid.h * grid.w, 3 * p * p)
        )
        x = F.linear(patches, self.patch_weight, self.patch_bias) + self._grid_positions(grid)
        mixed = F.conv2d(
            _norm(x).T.reshape(1, self.config.width, grid.h, grid.w),
            self.mix_weight,
            padding=1,
            groups=self.config.width,
        )
        x = x + mixed.reshape(self.config.width, grid.h * grid.w).T
        gate, up = F.linear(_norm(x), self.gate_up_weight).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, self.down_weight)
        embeds = F.linear(_norm(x), self.proj_weight).contiguous()
        positions = image_positions(grid)
        token_ids = torch.full((grid.rows,), self.image_token_id, dtype=torch.int64, device=self.device)
        return ImageEmbedding(
            grid=grid, embeds=embeds, token_ids=token_ids, positions=positions.to(self.device)
        )

    def _grid_positions(self, grid: ImageGrid) -> torch.Tensor:
        quarter = self.config.width // 4
        freqs = 1.0 / (100.0 ** (torch.arange(quarter, dtype=torch.float32, device=self.device) / quarter))
        rows = torch.arange(grid.h, dtype=torch.float32, device=self.device).repeat_interleave(grid.w)
        cols = torch.arange(grid.w, dtype=torch.float32, device=self.device).repeat(grid.h)
        angles_r, angles_c = rows[:, None] * freqs, cols[:, None] * freqs
        return torch.cat([angles_r.sin(), angles_r.cos(), angles_c.sin(), angles_c.cos()], dim=1)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
