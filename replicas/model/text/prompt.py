"""How a prompt with images becomes token ids and rotary positions (Qwen2-VL's scheme).

In a prompt, each image is marked by one `image_token_id`; `layout_prompt` expands the marker to the
image's `grid.rows` rows (all carrying `image_token_id`, their embeddings come from the vision encoder).
Rotary positions are 3-D (t, h, w): text runs count up with t = h = w, starting at 0 or one past the
largest position so far; an image starting at position `s` gives patch (t, i, j) the position
(s + t, s + i, s + j); text after an image continues from the image's largest position + 1. So a
prompt's rotary positions can be fewer than its tokens; decode continues from `next_position`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import torch

from replicas.model.errors import InvalidBatchError
from replicas.model.text.tokenizer import Tokenizer
from replicas.model.vision import ImageGrid, image_positions

IMAGE_PLACEHOLDER = "<image>"


@final
@dataclass(frozen=True, slots=True)
class PromptLayout:
    """`token_ids` (images expanded), `positions` `[T, 3]` int64, where each image's rows are, and the
    rotary position of the first generated token."""

    token_ids: list[int]
    positions: torch.Tensor
    image_spans: tuple[tuple[int, int], ...]
    next_position: int


def layout_prompt(
    prompt_ids: Sequence[int], grids: Sequence[ImageGrid], image_token_id: int | None
) -> PromptLayout:
    """Expand image markers and compute 3-D positions. The number of markers must equal `len(grids)`."""
    markers = 0 if image_token_id is None else sum(1 for token in prompt_ids if token == image_token_id)
    if markers != len(grids):
        raise InvalidBatchError(
            f"prompt has {markers} image markers (token {image_token_id}) but {len(grids)} images were given"
        )
    token_ids: list[int] = []
    pieces: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = []
    next_position = 0
    text_run = 0
    image_index = 0

    def flush_text() -> None:
        nonlocal next_position, text_run
        if text_run:
            steps = torch.arange(next_position, next_position + text_run, dtype=torch.int64)
            pieces.append(steps[:, None].expand(text_run, 3))
            next_position += text_run
            text_run = 0

    for token in prompt_ids:
        if image_token_id is not None and token == image_token_id:
            flush_text()
            grid = grids[image_index]
            image_index += 1
            spans.append((len(token_ids), grid.rows))
            token_ids.extend([token] * grid.rows)
            pieces.append(image_positions(grid) + next_position)
            next_position += max(grid.t, grid.h, grid.w)
        else:
            token_ids.append(token)
            text_run += 1
    flush_text()
    positions = torch.cat(pieces) if pieces else torch.zeros((0, 3), dtype=torch.int64)
    return PromptLayout(
        token_ids=token_ids,
        positions=positions.contiguous(),
        image_spans=tuple(spans),
        next_position=next_position,
    )


def encode_prompt(
    tokenizer: Tokenizer,
    text: str,
    image_count: int,
    image_token_id: int | None,
    *,
    add_special_tokens: bool = True,
) -> list[int]:
    """Token ids of a text prompt with one image marker per image.

    Each `<image>` in `text` marks where the next image goes; a prompt without any puts all images
    first (after the tokenizer's leading special tokens). Special tokens are added once, at the start,
    unless `add_special_tokens` is false (a chat template's output already holds them).
    """
    markers = text.count(IMAGE_PLACEHOLDER)
    if image_count and image_token_id is None:
        raise InvalidBatchError(f"this model takes text only; the request has {image_count} images")
    if markers and markers != image_count:
        raise InvalidBatchError(
            f"prompt has {markers} {IMAGE_PLACEHOLDER} markers but {image_count} images were given"
        )
    if not markers:
        text = IMAGE_PLACEHOLDER * image_count + text
    first, *rest = text.split(IMAGE_PLACEHOLDER)
    ids = tokenizer.encode(first, add_special_tokens=add_special_tokens)
    for piece in rest:
        assert image_token_id is not None
        ids.append(image_token_id)
        ids.extend(tokenizer.encode(piece, add_special_tokens=False))
    return ids
