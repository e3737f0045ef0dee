"""Clients under load: greedy `generate` requests to random live nodes, each outcome recorded.

Each client (`run_client`) loops until `stop` is set: it picks a node whose process runs, connects to
its control socket (one connection per request, as separate clients would), sends a greedy request of
`prompt_tokens` random token ids and `max_tokens` new tokens (every other one streamed), and records
how it ended (`Record.outcome`):

- `result`: a `GenerateResult` (its tokens are checked after the run, against the model run in one piece);
- `error`: an `error` reply, with its `code` and message;
- `unreachable`: no connection within `CONNECT_S` (the host is cut off, or the node just died);
- `connection_lost`: the connection closed before the final reply (the node was killed);
- `no_end`: no final reply within `REQUEST_S` — never right: every request must end.

Prompts and lengths come from the client's own seeded generator, so a run's requests repeat with its seed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, Literal, final

import trio

from engine.client import ControlClient, ControlConnectionClosed, ControlError
from engine.client.control_client import ControlProtocolError
from messages.control_replies import GenerateResult, TokenReply

CONNECT_S: Final = 3.0
# A request waits at most `queue_wait` (60 s) for a prefill replica and `migration_wait` (60 s) for a
# decode replica, then decodes; past this it has hung.
REQUEST_S: Final = 180.0
VOCABULARY: Final = range(1, 256)  # the tiny model's byte tokens, no special token

Outcome = Literal["result", "error", "unreachable", "connection_lost", "no_end"]


@final
@dataclass(slots=True)
class Record:
    """One request and how it ended (see the module docstring); times are `time.monotonic()`."""

    client: int
    node: str
    prompt: list[int]
    max_tokens: int
    stream: bool
    started: float
    ended: float = 0.0
    outcome: Outcome = "no_end"
    result: GenerateResult | None = None
    streamed: list[TokenReply] = field(default_factory=list)
    code: str | None = None
    message: str = ""


@final
@dataclass(frozen=True, slots=True)
class LoadShape:
    """The requests' sizes: prompt and new-token counts drawn uniformly from these ranges (inclusive)."""

    prompt_tokens: tuple[int, int] = (10, 300)
    max_tokens: tuple[int, int] = (10, 60)


async def run_client(
    index: int,
    seed: int,
    nodes: Callable[[], Sequence[tuple[str, str]]],
    records: list[Record],
    stop: trio.Event,
    shape: LoadShape | None = None,
    token: bytes | None = None,
) -> None:
    """One client's loop (see the module docstring); `nodes()` lists (node id, address) of the nodes
    that run now, `token` opens their control sockets. Returns once `stop` is set and its request in
    flight ended."""
    shape = shape or LoadShape()
    rng = random.Random(seed * 1009 + index)
    vocabulary = list(VOCABULARY)
    while not stop.is_set():
        live = list(nodes())
        if not live:
            with trio.move_on_after(0.2):
                await stop.wait()
            continue
        node, address = rng.choice(live)
        prompt = [rng.choice(vocabulary) for _ in range(rng.randint(*shape.prompt_tokens))]
        record = Record(
            client=index,
            node=node,
            prompt=prompt,
            max_tokens=rng.randint(*shape.max_tokens),
            stream=rng.random() < 0.5,
            started=time.monotonic(),
        )
        records.append(record)
        await _send(address, record, token)
        record.ended = time.monotonic()
        if record.outcome == "unreachable":
            with trio.move_on_after(0.5):  # as a client would, before it tries another node
                await stop.wait()


async def _send(address: str, record: Record, token: bytes | None) -> None:
    connected = False
    # The connect has `CONNECT_S`; once connected, the request has `REQUEST_S`.
    with trio.CancelScope(deadline=trio.current_time() + CONNECT_S) as scope:
        try:
            async with ControlClient.connect(address, token=token) as client:
                connected = True
                scope.deadline = trio.current_time() + REQUEST_S
                replies = client.generate(
                    input_ids=record.prompt, max_tokens=record.max_tokens, stream=record.stream
                )
                async for reply in replies:
                    if isinstance(reply, TokenReply):
                        record.streamed.append(reply)
                    else:
                        record.outcome, record.result = "result", reply
                        return
                record.outcome, record.message = "connection_lost", "the replies ended without a result"
        except ControlError as exc:
            record.outcome, record.code, record.message = "error", exc.code, exc.message
        except (ControlConnectionClosed, ControlProtocolError, OSError, trio.BrokenResourceError) as exc:
            record.outcome = "connection_lost" if connected else "unreachable"
            record.message = f"{type(exc).__name__}: {exc}"
    if scope.cancelled_caught:
        record.outcome = "no_end" if connected else "unreachable"
        record.message = (
            f"no final reply within {REQUEST_S:g} s" if connected else f"no connection within {CONNECT_S:g} s"
        )
