"""The base classes of the typed log events (`messages.log.events` documents the schema)."""

from __future__ import annotations

import time
from typing import ClassVar, Literal

import msgspec

Level = Literal["debug", "info", "warning", "error"]
Transfer = Literal["embedding", "kv", "relay", "weights", "pull"]


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="event"):
    """Every event: `ts` is stamped when the event is built. `level` is a class constant, not a field."""

    level: ClassVar[Level] = "info"
    required_context: ClassVar[tuple[str, ...]] = ()

    ts: float = msgspec.field(default_factory=time.time)


class RequestEvent(Event, frozen=True, kw_only=True):
    required_context: ClassVar[tuple[str, ...]] = ("request_id",)

    request_id: str | None = None
    replica: str | None = None


class ReplicaEvent(Event, frozen=True, kw_only=True):
    required_context: ClassVar[tuple[str, ...]] = ("replica",)

    replica: str | None = None
