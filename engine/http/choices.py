"""The choices of one HTTP body: `n` generations for each of its prompts, relayed as one stream of events.

Choice `p * n + i` is prompt p's i-th (`engine.http.requests.prompt_choices` gives their requests).
Choice 0 of every prompt is admitted at once (`open`: a refusal answers the whole body with its status).
The other choices of a prompt are admitted once its choice 0 has its first token, or has ended: by then
the prefill replica has put the prompt's full KV blocks in its prefix cache (it does so before it applies
the first token), so they borrow those blocks and compute only the prompt's last, partial block — the
prompt runs once, its KV shared by reference. What that costs: choices 1.. start one prefill later than
choice 0, and with `--prefix-cache` off (or under eviction) each computes the prompt again.

If choice 0 fails, the prompt's other choices are never started. One owner: the task serving the body;
`run` relays every choice's pieces and end into one channel (`ChoiceEvent`), `close` (no await) cancels
every choice that has not ended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import final

import trio

from engine.control.errors import RequestFailed
from engine.generate.generation import Generation, Outcome, Piece
from messages.control import GenerateRequest


@final
@dataclass(frozen=True, slots=True)
class ChoicePiece:
    """New tokens (and text) of choice `index`."""

    index: int
    generation: Generation
    piece: Piece


@final
@dataclass(frozen=True, slots=True)
class ChoiceEnded:
    """Choice `index` ended normally (after all its pieces)."""

    index: int
    generation: Generation
    outcome: Outcome


@final
@dataclass(frozen=True, slots=True)
class ChoiceFailed:
    """Choice `index` failed (or was refused at admission)."""

    index: int
    error: RequestFailed


ChoiceEvent = ChoicePiece | ChoiceEnded | ChoiceFailed


@final
class Choices:
    """See the module docstring. `start` admits one request (`Generation.start`, bound to the node)."""

    def __init__(
        self, prompts: list[list[GenerateRequest]], start: Callable[[GenerateRequest], Generation]
    ) -> None:
        assert prompts and all(len(choices) == len(prompts[0]) >= 1 for choices in prompts)
        self._prompts = prompts
        self._start = start
        self.n = len(prompts[0])
        self.generations: dict[int, Generation] = {}

    @property
    def count(self) -> int:
        """How many choices the body asked for."""
        return len(self._prompts) * self.n

    def open(self) -> None:
        """Admit choice 0 of every prompt; `RequestFailed` for the first refused (the caller `close`s)."""
        for number, choices in enumerate(self._prompts):
            self.generations[number * self.n] = self._start(choices[0])

    async def run(self, send: trio.MemorySendChannel[ChoiceEvent]) -> None:
        """Relay every choice's events into `send` (closed when all choices ended); after `open`."""
        async with send, trio.open_nursery() as nursery:
            for number in range(len(self._prompts)):
                nursery.start_soon(self._prompt, number, send)

    async def _prompt(self, number: int, send: trio.MemorySendChannel[ChoiceEvent]) -> None:
        first = number * self.n
        prompt_ran = trio.Event()
        failed: list[bool] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._relay, first, self.generations[first], send, prompt_ran, failed)
            await prompt_ran.wait()
            if failed:
                return
            for i in range(1, self.n):
                try:
                    generation = self._start(self._prompts[number][i])
                except RequestFailed as exc:
                    await send.send(ChoiceFailed(first + i, exc))
                    return
                self.generations[first + i] = generation
                nursery.start_soon(self._relay, first + i, generation, send, None, [])

    @staticmethod
    async def _relay(
        index: int,
        generation: Generation,
        send: trio.MemorySendChannel[ChoiceEvent],
        prompt_ran: trio.Event | None,
        failed: list[bool],
    ) -> None:
        try:
            async for piece in generation.pieces():
                if prompt_ran is not None:
                    prompt_ran.set()
                await send.send(ChoicePiece(index, generation, piece))
            outcome = generation.outcome()
        except RequestFailed as exc:
            failed.append(True)
            await send.send(ChoiceFailed(index, exc))
        else:
            await send.send(ChoiceEnded(index, generation, outcome))
        finally:
            if prompt_ran is not None:
                prompt_ran.set()

    def close(self) -> None:
        """Cancel every choice that has not ended (no await: safe in `finally` of a cancelled task)."""
        for generation in self.generations.values():
            generation.close()
