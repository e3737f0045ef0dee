"""Images with a chosen number of embedding rows, and the reference output of a request with them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from messages.control import ImageInput
from replicas.model import (
    PATCH_SIZE,
    ByteTokenizer,
    Model,
    SamplingParams,
    encode_prompt,
    generate_in_one_piece,
)


def image_with_rows(rows: int, seed: int) -> np.ndarray:
    """A random RGB image whose tiny-model encoding has exactly `rows` rows (one per 16×16 patch):
    the most nearly square `h × w = rows` patch grid."""
    h = max(d for d in range(1, math.isqrt(rows) + 1) if rows % d == 0)
    w = rows // h
    generator = np.random.default_rng(seed)
    return generator.integers(0, 256, (h * PATCH_SIZE, w * PATCH_SIZE, 3), dtype=np.uint8)


def image_input(image: np.ndarray) -> ImageInput:
    height, width, _ = image.shape
    return ImageInput(width=width, height=height, pixels=image.tobytes())


def reference(model: Model, prompt: str, images: Sequence[np.ndarray], max_tokens: int) -> list[int]:
    """The greedy output (EOS ignored) of the model run in one piece, as the node is asked for it."""
    prompt_ids = encode_prompt(ByteTokenizer(), prompt, len(images), model.config.image_token_id)
    sampling = SamplingParams(ignore_eos=True)
    return generate_in_one_piece(model, prompt_ids, images=images, sampling=sampling, max_tokens=max_tokens)
