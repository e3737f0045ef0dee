"""The tiny model's vision encoder and the 3-D rotary positions of images."""

from __future__ import annotations

import types
from functools import partial

import numpy as np
import pytest
import torch

from replicas.model import ImageGrid, ImageSizeError, InvalidBatchError, Model, layout_prompt, tiny_model
from replicas.model.rope import Rotary


def _image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def test_a_512_image_gives_1024_rows_in_the_hidden_size(tiny: Model) -> None:
    assert tiny.vision is not None
    (out,) = tiny.vision.encode([_image(512, 512)])
    assert out.grid == ImageGrid(t=1, h=32, w=32)
    assert out.embeds.shape == (1024, tiny.config.hidden_size) and out.embeds.dtype == torch.float32
    assert out.token_ids.shape == (1024,) and set(out.token_ids.tolist()) == {tiny.config.image_token_id}
    assert out.positions.dtype == torch.int64 and out.positions.shape == (1024, 3)
    assert out.positions[0].tolist() == [0, 0, 0]
    assert out.positions[33].tolist() == [0, 1, 1]
    assert out.positions[-1].tolist() == [0, 31, 31]
    assert torch.isfinite(out.embeds).all()
    assert 0.3 < float(out.embeds.pow(2).mean().sqrt()) < 5.0


def test_vision_weights_are_seeded_and_images_are_told_apart(tiny: Model) -> None:
    other = tiny_model()
    assert tiny.vision is not None and other.vision is not None
    a, b = _image(32, 48, seed=1), _image(32, 48, seed=2)
    first = tiny.vision.encode([a, b])
    again = other.vision.encode([a])
    assert torch.equal(first[0].embeds, again[0].embeds)
    assert not torch.allclose(first[0].embeds, first[1].embeds)


def test_invocation_counter_counts_encoder_calls_only(tiny: Model) -> None:
    model = tiny_model()
    assert model.vision is not None and model.tokenizer is not None
    from replicas.model import generate_in_one_piece

    generate_in_one_piece(model, model.tokenizer.encode("text only"), max_tokens=3)
    assert (model.vision.invocations, model.vision.images_encoded) == (0, 0)
    model.vision.encode([_image(16, 16), _image(32, 16)])
    assert (model.vision.invocations, model.vision.images_encoded) == (1, 2)


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (
            np.zeros((500, 512, 3), np.uint8),
            "image 0: height 500 is not a positive multiple of 16 (image is 512x500)",
        ),
        (
            np.zeros((64, 30, 3), np.uint8),
            "image 0: width 30 is not a positive multiple of 16 (image is 30x64)",
        ),
        (
            np.zeros((0, 16, 3), np.uint8),
            "image 0: height 0 is not a positive multiple of 16 (image is 16x0)",
        ),
        (
            np.zeros((16, 16, 4), np.uint8),
            "image 0: expected RGB uint8 [height, width, 3], got torch.uint8 [16, 16, 4]",
        ),
        (
            np.zeros((16, 16, 3), np.float32),
            "image 0: expected RGB uint8 [height, width, 3], got torch.float32 [16, 16, 3]",
        ),
    ],
)
def test_bad_images_are_refused_with_the_reason(tiny: Model, image: np.ndarray, message: str) -> None:
    assert tiny.vision is not None
    before = tiny.vision.invocations
    with pytest.raises(ImageSizeError) as info:
        tiny.vision.encode([image])
    assert str(info.value) == message
    assert tiny.vision.invocations == before


def test_prompt_layout_matches_qwen2_vl_rope_index() -> None:
    """Compared with transformers' Qwen2-VL `get_rope_index` (spatial merge 1) on the same token stream."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    image = 258
    prompt = [256, 10, 11, image, 12, 13, 14, image, 15]
    grids = [ImageGrid(t=1, h=2, w=3), ImageGrid(t=1, h=4, w=2)]
    layout = layout_prompt(prompt, grids, image)
    assert len(layout.token_ids) == 3 + 6 + 3 + 8 + 1
    assert layout.image_spans == ((3, 6), (12, 8))

    fake_self = types.SimpleNamespace(
        config=types.SimpleNamespace(vision_config=types.SimpleNamespace(spatial_merge_size=1))
    )
    fake_self.get_vision_position_ids = partial(Qwen2VLModel.get_vision_position_ids, fake_self)
    ids = torch.tensor([layout.token_ids])
    types_ = (ids == image).to(torch.int32)
    thw = torch.tensor([[g.t, g.h, g.w] for g in grids])
    reference, delta = Qwen2VLModel.get_rope_index(fake_self, ids, types_, image_grid_thw=thw)
    assert torch.equal(layout.positions, reference[:, 0, :].T)
    assert layout.next_position == len(layout.token_ids) + int(delta[0, 0])


def test_prompt_layout_refuses_marker_count_mismatch() -> None:
    with pytest.raises(
        InvalidBatchError, match=r"^prompt has 1 image markers \(token 258\) but 2 images were given$"
    ):
        layout_prompt([1, 258, 2], [ImageGrid(t=1, h=1, w=1)] * 2, 258)


def test_3d_rotary_matches_qwen2_vl_and_reduces_to_1d_for_text(tiny: Model) -> None:
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    config = tiny.config
    hf_config = Qwen2VLConfig(
        text_config=dict(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_heads,
            num_key_value_heads=config.num_kv_heads,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": config.rope.theta,
                "mrope_section": [4, 6, 6],
            },
        )
    )
    hf_rotary = Qwen2VLRotaryEmbedding(hf_config.text_config)
    positions = torch.tensor([[0, 0, 0], [1, 1, 1], [2, 2, 3], [2, 5, 7], [9, 9, 9], [100, 40, 3]])
    ours = tiny.rotary.cos_sin(positions, torch.float32)
    theirs = hf_rotary(torch.zeros(1), positions.T[:, None, :])
    half = config.head_dim // 2
    for mine, reference in zip(ours, theirs):
        assert torch.equal(reference[0][:, :half], reference[0][:, half:])
        torch.testing.assert_close(mine, reference[0][:, :half], atol=1e-6, rtol=0)

    text = torch.arange(50)
    one_d = tiny.rotary.cos_sin(text, torch.float32)
    three_d = tiny.rotary.cos_sin(text[:, None].expand(-1, 3), torch.float32)
    assert torch.equal(one_d[0], three_d[0]) and torch.equal(one_d[1], three_d[1])
    assert Rotary(config.rope, config.head_dim, torch.device("cpu")).axes == 3


def test_image_rows_through_an_embedding_pool_give_the_reference_output(tiny: Model) -> None:
    """Encode → rows in a (fragmented) embedding pool → read back → language prefill: same tokens."""
    from replicas.model import (
        Executor,
        KVCache,
        PrefillSequence,
        SamplingParams,
        embedding_layout,
        embedding_rows,
        encode_prompt,
        generate_in_one_piece,
    )
    from transport.memory.blocks import BlockPool
    from transport.memory.storage import PoolStorage

    assert tiny.vision is not None and tiny.tokenizer is not None
    images = [_image(64, 32, seed=5), _image(16, 48, seed=6)]
    prompt = encode_prompt(tiny.tokenizer, "first <image> then <image> end", 2, tiny.config.image_token_id)
    reference = generate_in_one_piece(tiny, prompt, images=images, max_tokens=1)

    layout = embedding_layout(tiny.config.hidden_size, block_size=4)
    pool, storage = BlockPool(12, 4), PoolStorage(layout, 12)
    pool.allocate(3, "filler")
    encoded = tiny.vision.encode(images)
    landed = []
    for index, embedding in enumerate(encoded):
        blocks = pool.allocate(pool.blocks_for(embedding.grid.rows), f"image{index}")
        storage.scatter(blocks, 0, embedding_rows(embedding))
        landed.append(storage.gather(blocks, 0, embedding.grid.rows))
    assert torch.equal(landed[0]["positions"], encoded[0].positions)

    layout_ = layout_prompt(prompt, [e.grid for e in encoded], tiny.config.image_token_id)
    indices = torch.cat([torch.arange(start, start + rows) for start, rows in layout_.image_spans])
    cache = KVCache.create(tiny.config, 8)
    table = cache.pool.allocate(cache.blocks_for(len(layout_.token_ids)), "r")
    result = Executor(tiny, cache).prefill(
        [
            PrefillSequence(
                block_table=table,
                token_ids=layout_.token_ids,
                positions=layout_.positions,
                embeds=torch.cat([rows["embeds"] for rows in landed]),
                embed_indices=indices,
                sampling=SamplingParams(),
            )
        ]
    )
    assert result.tokens == reference[:1]
    spans = layout_.image_spans
    for (start, rows), embedding in zip(spans, encoded):
        assert torch.equal(
            layout_.positions[start : start + rows] - layout_.positions[start], embedding.positions
        )


def test_encode_prompt_places_images_at_markers_or_first() -> None:
    from replicas.model import ByteTokenizer, encode_prompt

    tokenizer = ByteTokenizer()
    image = ByteTokenizer.IMAGE
    assert encode_prompt(tokenizer, "a<image>b", 1, image) == [256, 97, image, 98]
    assert encode_prompt(tokenizer, "ab", 2, image) == [256, image, image, 97, 98]
    assert encode_prompt(tokenizer, "ab", 0, image) == [256, 97, 98]
    with pytest.raises(InvalidBatchError, match=r"^prompt has 2 <image> markers but 1 images were given$"):
        encode_prompt(tokenizer, "<image><image>", 1, image)
    with pytest.raises(InvalidBatchError, match=r"^this model takes text only; the request has 1 images$"):
        encode_prompt(tokenizer, "x", 1, None)
