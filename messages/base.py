"""The base every message derives from: frozen, keyword-only, strict about unknown fields.

Subclasses set an explicit lowercase tag: ``class Grant(Message, tag="grant")``. Control requests use
the tag field ``op`` instead (see `messages.control`).
"""

from __future__ import annotations

import msgspec


class Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type"):
    """Base of every tagged message."""


class Record(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of untagged value types embedded in messages (layouts, shapes, grids)."""
