"""The base of the node's config tree (`engine.config`): sections and option descriptions."""

from __future__ import annotations

import msgspec


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the config tree's structs."""
