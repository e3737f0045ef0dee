"""What goes into a replica's inbox: commands with their outcome slot, and completions of its helpers."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, final

import trio

from messages.commands import ReplicaCommand
from messages.control import ErrorCode
from transport.protocol.link import Link

_command_ids = itertools.count(1)


def new_command_id() -> str:
    return f"cmd-{next(_command_ids)}"


@final
class CommandRefused(Exception):
    """A command the replica declined; `code` is the control protocol's error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code: ErrorCode = code


@final
@dataclass(slots=True)
class Envelope:
    """A command in the inbox, with the place its outcome goes (`link`: where a protocol message came)."""

    command: ReplicaCommand
    link: Link | None = None
    done: trio.Event = field(default_factory=trio.Event)
    result: Any = None
    error: Exception | None = None


@final
@dataclass(frozen=True, slots=True)
class Completed:
    """A helper finished: the main loop runs `apply(result)`, or raises `error`."""

    apply: Callable[[Any], None]
    result: Any = None
    error: BaseException | None = None


InboxItem = Envelope | Completed | None  # None: only wake up (new work, arrivals, cancellations)
