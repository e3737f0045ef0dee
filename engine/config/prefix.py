"""The config section of the prefix cache and KV-aware routing: `[prefix]` (docs/prefix-cache.md). Part
of the node's one config tree (`engine.config.NodeConfig`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from engine.config.base import Section, _doc


class PrefixConfig(Section, frozen=True, kw_only=True):
    cache: Annotated[
        Literal["on", "off"],
        _doc(
            "on: prefill replicas keep the full KV blocks of ended prompts and reuse the longest cached "
            "prefix of a new one (evicted least recently used, only when blocks are needed); off"
        ),
    ] = "on"
    cache_blocks: Annotated[
        Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] | None,
        _doc("the most KV blocks a replica's prefix cache keeps (default: as many as its pool spares)"),
    ] = None
    route_weight: Annotated[
        float,
        msgspec.Meta(ge=0, le=1e6),
        _doc(
            "KV-aware routing: a prefill replica's cost is this × the prompt's blocks it would compute (not "
            "in its prefix cache) + the blocks queued there; the cheapest takes the request (0: the "
            "shortest queue alone)"
        ),
    ] = 1.0
    pull: Annotated[
        Literal["auto", "off", "always"],
        _doc(
            "pull a prefix another replica (of this node or another) caches instead of computing it: "
            "auto — when moving its KV is estimated faster than computing it (link speed against "
            "prefill speed, measured or configured); always; off"
        ),
    ] = "auto"
    pull_link_gbps: Annotated[
        Annotated[float, msgspec.Meta(gt=0, le=1e6)] | None,
        _doc(
            "the link speed (Gbit/s) the pull estimate assumes (default: measured from this node's KV "
            "transfers)"
        ),
    ] = None
