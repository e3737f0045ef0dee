"""The base of the node's config tree (`engine.config`): sections, option descriptions, the error, and
the replica counts (what `engine.cli` parses besides the tree)."""

from __future__ import annotations

from typing import Annotated

import msgspec


def _doc(text: str) -> msgspec.Meta:
    return msgspec.Meta(description=text)


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the config tree's structs."""


class ConfigError(Exception):
    """A configuration value is wrong; the message names the option, its source and the value."""


class ReplicaCounts(Section, frozen=True, kw_only=True):
    """How many replicas of each role the node starts (``encode=1,prefill=1,decode=1``)."""

    encode: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    prefill: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    decode: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0

    @property
    def total(self) -> int:
        return self.encode + self.prefill + self.decode

    def __str__(self) -> str:
        return f"encode={self.encode},prefill={self.prefill},decode={self.decode}"
