"""The embedding transfer in one trio run: the encode side's `send_embeddings` and the language side's
`EmbeddingAssembler`, over real pools, storages and inproc endpoints (what the replicas run, without the
node around them), so Trio's `autojump_clock` can drive the memory-pressure deadline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages.transfer import TransferReport
from replicas.embedding import (
    EmbeddedPrompt,
    EmbeddingAssembler,
    EmbeddingMismatch,
    EncodePoolTooSmall,
    PromptTooLong,
    embedding_header,
    send_embeddings,
)
from replicas.model import ImageEmbedding, ImageGrid, Model, embedding_layout, layout_prompt
from transport.config import TransferConfig
from transport.endpoint import open_endpoint
from transport.errors import TransferError, TransferTimeout
from transport.links.inproc.link import InprocNetwork
from transport.memory.blocks import BlockPool
from transport.memory.storage import PoolStorage
from transport.protocol.landing import LandedRound

IMAGE = 258  # the tiny model's image token
HIDDEN = 128
REQUEST = "req-1"
TRANSFER = "req-1/emb1"
CONTEXT = 32768


@dataclass
class Side:
    pool: BlockPool
    storage: PoolStorage


def _side(name: str, blocks: int, block_size: int) -> Side:
    layout = embedding_layout(HIDDEN, block_size)
    return Side(BlockPool(blocks, block_size, name=name), PoolStorage(layout, blocks))


def _encode(model: Model, sizes: Sequence[tuple[int, int]], seed: int = 0) -> list[ImageEmbedding]:
    generator = np.random.default_rng(seed)
    images = [generator.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]
    assert model.vision is not None
    return model.vision.encode(images)


@dataclass
class Outcome:
    prompt: EmbeddedPrompt | None
    received: TransferReport | None
    sent: TransferReport | None
    receiver_error: TransferError | None
    sender_error: TransferError | None


async def _transfer(
    embeddings: list[ImageEmbedding],
    prompt_ids: list[int],
    *,
    language: Side,
    encode: Side,
    config: TransferConfig,
) -> Outcome:
    """Run one embedding transfer, encode side and language side, as the replicas do."""
    network = InprocNetwork()
    outcome = Outcome(None, None, None, None, None)
    async with (
        open_endpoint("encode-0/emb", encode.storage, encode.pool, config=config, inproc=network) as sender,
        open_endpoint(
            "prefill-0/emb", language.storage, language.pool, config=config, inproc=network
        ) as receiver,
    ):
        link = await receiver.connect(sender.listen_inproc())
        assembler = EmbeddingAssembler(REQUEST, prompt_ids, IMAGE, max_tokens=CONTEXT)

        async def send() -> None:
            async with sender.open_send(TRANSFER) as session:
                try:
                    outcome.sent = await send_embeddings(
                        session,
                        encode.pool,
                        encode.storage,
                        embeddings,
                        request_id=REQUEST,
                        owner="encode:t",
                        pressure_timeout=config.pressure_timeout,
                    )
                except TransferError as exc:
                    outcome.sender_error = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            try:
                result = await receiver.receive(TRANSFER, peer=link, consume=assembler.consume)
            except TransferError as exc:
                outcome.receiver_error = exc
            else:
                outcome.received = result.report
                outcome.prompt = assembler.finish()
    return outcome


def _expected(embeddings: list[ImageEmbedding], prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    layout = layout_prompt(prompt_ids, [e.grid for e in embeddings], IMAGE)
    return torch.cat([e.embeds for e in embeddings]), layout.positions


# ---------------------------------------------------------------------------------------------- memory pressure
async def test_a_landing_pool_exhausted_by_others_fails_with_transfer_timeout_at_the_deadline(
    autojump_clock: trio.testing.MockClock, tiny: Model
) -> None:
    embeddings = _encode(tiny, [(64, 64)])
    language, encode = _side("prefill-0/emb", 8, 16), _side("encode-0/emb", 8, 16)
    others = language.pool.allocate(8, "other-request")
    config = TransferConfig(default_grant_blocks=2, pressure_timeout=10.0)
    start = trio.current_time()
    outcome = await _transfer(embeddings, [256, IMAGE], language=language, encode=encode, config=config)
    assert isinstance(outcome.receiver_error, TransferTimeout)
    assert outcome.receiver_error.code == "transfer_timeout"
    assert trio.current_time() - start == pytest.approx(10.0, abs=0.01)  # at the deadline, not before
    assert outcome.sender_error is not None and outcome.sender_error.code == "transfer_timeout"
    assert language.pool.owners() == {"other-request": 8} and encode.pool.used_blocks == 0
    language.pool.free(others, "other-request")
    language.pool.check_invariants()


async def test_blocks_freed_before_the_deadline_let_the_transfer_complete(
    autojump_clock: trio.testing.MockClock, tiny: Model
) -> None:
    embeddings = _encode(tiny, [(64, 128)])  # 32 rows: 2 blocks of 16
    language, encode = _side("prefill-0/emb", 4, 16), _side("encode-0/emb", 8, 16)
    others = language.pool.allocate(4, "other-request")
    config = TransferConfig(default_grant_blocks=1, pressure_timeout=10.0)

    async def other_request_finishes() -> None:
        await trio.sleep(7.0)
        language.pool.free(others, "other-request")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_request_finishes)
        outcome = await _transfer(
            embeddings, [256, IMAGE, 65], language=language, encode=encode, config=config
        )
    assert outcome.prompt is not None and outcome.received is not None
    embeds, positions = _expected(embeddings, [256, IMAGE, 65])
    assert torch.equal(outcome.prompt.embeds, embeds) and torch.equal(outcome.prompt.positions, positions)
    assert language.pool.used_blocks == 0 and encode.pool.used_blocks == 0


# ---------------------------------------------------------------------------------------------- property
@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[tuple[int, int]], list[int], int, int, int | None, int, int]:
    sizes = draw(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=3))
    sizes = [(16 * h, 16 * w) for h, w in sizes]
    # Text around the markers: before, between and after the images (or none: images first).
    texts = draw(
        st.lists(st.lists(st.integers(0, 255), max_size=3), min_size=len(sizes) + 1, max_size=len(sizes) + 1)
    )
    prompt_ids = [256, *texts[0]]
    for text in texts[1:]:
        prompt_ids += [IMAGE, *text]
    block_size = draw(st.sampled_from([1, 4, 16, 128]))
    pool_blocks = draw(st.integers(1, 12))
    default = draw(st.integers(1, pool_blocks))
    cap = draw(st.one_of(st.none(), st.integers(1, 4)))
    window = draw(st.integers(1, 4))
    return sizes, prompt_ids, block_size, default, cap, pool_blocks, window


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_cases())
def test_any_grant_cap_window_and_pool_assemble_the_encoders_rows_exactly(
    tiny: Model, case: tuple[list[tuple[int, int]], list[int], int, int, int | None, int, int]
) -> None:
    sizes, prompt_ids, block_size, default, cap, pool_blocks, window = case
    embeddings = _encode(tiny, sizes)
    total = sum(e.grid.rows for e in embeddings)
    language = _side("prefill-0/emb", pool_blocks, block_size)
    encode = _side("encode-0/emb", -(-total // block_size), block_size)
    config = TransferConfig(default_grant_blocks=default, round_cap_blocks=cap, window=window)
    outcome = trio.run(
        lambda: _transfer(embeddings, prompt_ids, language=language, encode=encode, config=config)
    )
    assert outcome.prompt is not None and outcome.received is not None and outcome.sent is not None
    embeds, positions = _expected(embeddings, prompt_ids)
    layout = layout_prompt(prompt_ids, [e.grid for e in embeddings], IMAGE)
    assert torch.equal(outcome.prompt.embeds, embeds)
    assert torch.equal(outcome.prompt.positions, positions)
    assert outcome.prompt.token_ids == layout.token_ids
    assert outcome.prompt.grids == [e.grid for e in embeddings]
    per_round = min(pool_blocks, cap or pool_blocks) * block_size
    first = min(default, cap or default) * block_size
    assert outcome.received.rounds >= 1 + math.ceil(max(0, total - first) / per_round)
    if total <= first:
        assert outcome.received.rounds == 1
    assert outcome.received.rounds == outcome.sent.rounds and outcome.received.tokens == total
    assert language.pool.used_blocks == 0 and encode.pool.used_blocks == 0


# ---------------------------------------------------------------------------------------------- refusals
def _landed(storage: PoolStorage, ids: list[int], count: int, total: int, header: msgspec.Raw) -> LandedRound:
    return LandedRound(
        round=0,
        offset=0,
        tokens=count,
        total_tokens=total,
        blocks=tuple(ids),
        landing_offset=0,
        header=header,
        storage=storage,
        buffers=("embeds", "token_ids", "positions"),
    )


async def _assembled(
    tiny: Model, header_grids: list[ImageGrid], request_id: str = REQUEST
) -> EmbeddingAssembler:
    """An assembler fed one round holding a real 2×3-patch image's rows, with the header given."""
    (embedding,) = _encode(tiny, [(32, 48)])
    side = _side("prefill-0/emb", 1, 16)
    ids = side.pool.allocate(1, "t")
    side.storage.scatter(
        ids,
        0,
        {"embeds": embedding.embeds, "token_ids": embedding.token_ids, "positions": embedding.positions},
    )
    assembler = EmbeddingAssembler(REQUEST, [256, IMAGE, 65], IMAGE, max_tokens=CONTEXT)
    await assembler.consume(_landed(side.storage, ids, 6, 6, embedding_header(request_id, header_grids)))
    return assembler


async def test_the_header_grids_must_agree_with_the_landed_rows(tiny: Model) -> None:
    assembled = await _assembled(tiny, [ImageGrid(t=1, h=2, w=3)])
    assert torch.equal(assembled.finish().embed_indices, torch.arange(1, 7))
    transposed = await _assembled(tiny, [ImageGrid(t=1, h=3, w=2)])
    with pytest.raises(
        EmbeddingMismatch,
        match=r"^request req-1: image 0: landed positions disagree with its grid t=1 h=3 w=2$",
    ):
        transposed.finish()
    short = await _assembled(tiny, [ImageGrid(t=1, h=1, w=3)])
    with pytest.raises(
        EmbeddingMismatch, match=r"^request req-1: the header's 1 grids hold 3 rows, the transfer carried 6$"
    ):
        short.finish()
    two = await _assembled(tiny, [ImageGrid(t=1, h=1, w=3), ImageGrid(t=1, h=1, w=3)])
    with pytest.raises(
        EmbeddingMismatch,
        match=r"^request req-1: prompt has 1 image markers \(token 258\) but 2 images were given$",
    ):
        two.finish()
    other = await _assembled(tiny, [ImageGrid(t=1, h=2, w=3)], request_id="req-2")
    with pytest.raises(
        EmbeddingMismatch, match=r"^request req-1: the embedding header is for request req-2$"
    ):
        other.finish()


async def test_a_sender_total_over_the_context_is_refused_before_anything_is_allocated() -> None:
    side = _side("prefill-0/emb", 1, 16)
    assembler = EmbeddingAssembler(REQUEST, [256, IMAGE], IMAGE, max_tokens=100)
    header = embedding_header(REQUEST, [ImageGrid(t=1, h=10, w=11)])
    with pytest.raises(
        PromptTooLong,
        match=r"^request req-1: the images give 110 embedding rows, more than the context of 100 tokens$",
    ):
        await assembler.consume(_landed(side.storage, [0], 16, 110, header))
    assert assembler.rows == {}


async def test_an_encode_pool_that_can_never_hold_the_rows_is_refused(tiny: Model) -> None:
    embeddings = _encode(tiny, [(64, 64)])  # 16 rows
    encode = _side("encode-0/emb", 3, 4)
    refusal = r"^16 embedding rows need 4 blocks of 4; the encode pool 'encode-0/emb' has 3 \(raise --embedding-pool-blocks\)$"
    async with (
        open_endpoint("encode-0/emb", encode.storage, encode.pool, inproc=InprocNetwork()) as endpoint,
        endpoint.open_send(TRANSFER) as session,
    ):
        with pytest.raises(EncodePoolTooSmall, match=refusal):
            await send_embeddings(
                session,
                encode.pool,
                encode.storage,
                embeddings,
                request_id=REQUEST,
                owner="o",
                pressure_timeout=1.0,
            )
    assert encode.pool.used_blocks == 0
