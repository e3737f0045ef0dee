"""The per-request header of an embedding transfer (encode replica → language replica, architecture §4-§5).

It rides, opaque to the transport (`messages.peer_codec.encode_header`), on every `ChunkDone` and
`TotalAnnounce` of the transfer: the facts about a request's image embeddings that are not per-token.
The per-token rows themselves (`embeds`, `token_ids`, `positions`) travel as bytes in the pool's blocks.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from messages.base import Message, Record

Side = Annotated[int, msgspec.Meta(ge=1)]


class GridShape(Record, frozen=True):
    """One image's patch grid: `t` frames × `h` rows × `w` columns, one embedding row per cell."""

    t: Side
    h: Side
    w: Side


class EmbeddingHeader(Message, frozen=True, tag="embedding_header"):
    """The image grids of request `request_id`, in prompt order; their rows add up to the transfer's
    `total_tokens`, image after image, each row-major."""

    request_id: str
    grids: list[GridShape]
