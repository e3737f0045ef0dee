"""The `trace` benchmark's replayer: one node process, the trace sent through its control socket.

`replay_on_node(trace, options, log_file, seed)` starts `python -m engine.node … options` (engine/bench/
nodes.py), waits until every replica serves (`Prefill` or `Decode`), sends two unrecorded warm-up
requests, then sends each request at its arrival time, concurrently: `generate` with `input_ids` of its
prompt length (seeded random tokens, the same for every way), `max_tokens` its output length,
`ignore_eos`. Meanwhile a task polls `status` every `POLL_SECONDS` and records how many replicas are not
`Inactive`, per role and how many of them load (`Loading*`, `NewPrefill`) or drain (`Shutting*`), and
`control(client, started)`, when given, drives the node alongside (the oracle's schedule of `scale`
commands; cancelled when the run ends). A request the node refuses is recorded with the error's code.
The run ends when every request has its result; then the node is shut down. `Run.started_wall` is the
trace's start on the wall clock (the log's `ts`).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, final

import trio

from engine.bench.nodes import node_process
from engine.bench.trace.gen import TraceRequest
from engine.bench.trace.slo import Outcome, ReplicaSample

if TYPE_CHECKING:
    from engine.client import ControlClient

Control = Callable[["ControlClient", float], Awaitable[None]]

POLL_SECONDS: Final = 0.1
SERVE_SECONDS: Final = 60.0  # the node's replicas load before the trace starts
DRAIN_SECONDS: Final = 300.0  # the last request may end this long after the trace's last arrival
WARMUP: Final = 2
VOCABULARY: Final = 256  # prompt token ids are drawn from [1, VOCABULARY)


@final
@dataclass(frozen=True, slots=True)
class Run:
    outcomes: list[Outcome]
    samples: list[ReplicaSample]
    started_wall: float = 0.0


def prompts(trace: Sequence[TraceRequest], seed: int) -> list[list[int]]:
    """Each request's prompt: seeded random token ids of its length."""
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCABULARY) for _ in range(r.prompt_tokens)] for r in trace]


def replay_on_node(
    trace: Sequence[TraceRequest],
    options: Sequence[str],
    log_file: Path,
    seed: int,
    control: Control | None = None,
) -> Run:
    """See the module docstring."""
    log_file.unlink(missing_ok=True)
    inputs = prompts(trace, seed)
    with node_process(log_file, options) as address:
        return trio.run(_replay, address, trace, inputs, control)


def _active(states: Sequence[tuple[str, str]], role: str | None = None) -> int:
    return sum(state != "Inactive" and (role is None or r == role) for r, state in states)


LOADING: Final = ("Loading", "NewPrefill")


async def _replay(
    address: str, trace: Sequence[TraceRequest], inputs: list[list[int]], control: Control | None
) -> Run:
    from engine.client import ControlClient, ControlError

    outcomes: list[Outcome] = []
    samples: list[ReplicaSample] = []
    async with ControlClient.connect(address) as client:
        with trio.fail_after(SERVE_SECONDS):
            while not all(r.state in ("Prefill", "Decode") for r in (await client.status()).replicas):  # noqa: ASYNC110
                await trio.sleep(0.05)
        for ids in inputs[:WARMUP]:  # unrecorded: first-call costs of the serving replicas
            await client.generate_result(input_ids=ids, max_tokens=2, ignore_eos=True)
        started = trio.current_time() + 0.1
        started_wall = time.time() + 0.1

        async def sample() -> None:
            replicas = (await client.status()).replicas
            states = [(r.role, r.state) for r in replicas]
            samples.append(
                ReplicaSample(
                    trio.current_time() - started,
                    _active(states),
                    _active(states, "prefill"),
                    _active(states, "decode"),
                    loading=sum(state.startswith(LOADING) for _, state in states),
                    draining=sum(state.startswith("Shutting") for _, state in states),
                )
            )

        async def poll() -> None:
            for _ in itertools.count():  # paced, not waiting: cancelled when the run ends
                await sample()
                await trio.sleep(POLL_SECONDS)

        async def one(request: TraceRequest, ids: list[int]) -> None:
            await trio.sleep_until(started + request.at)
            try:
                result = await client.generate_result(
                    input_ids=ids, max_tokens=request.output_tokens, ignore_eos=True
                )
            except ControlError as exc:
                end = trio.current_time() - started
                outcomes.append(
                    Outcome(
                        request.at, request.prompt_tokens, request.output_tokens, None, None, end, exc.code
                    )
                )
                return
            timings = result.timings
            end = trio.current_time() - started
            outcomes.append(
                Outcome(
                    request.at,
                    request.prompt_tokens,
                    request.output_tokens,
                    timings.ttft_s,
                    timings.tpot_s,
                    end,
                )
            )

        last = max((r.at for r in trace), default=0.0)
        with trio.fail_after(last + DRAIN_SECONDS):
            async with trio.open_nursery() as outer:
                outer.start_soon(poll)
                if control is not None:
                    outer.start_soon(control, client, started)
                async with trio.open_nursery() as nursery:
                    for request, ids in zip(trace, inputs, strict=True):
                        nursery.start_soon(one, request, ids)
                outer.cancel_scope.cancel()
        await sample()
        await client.shutdown()
    outcomes.sort(key=lambda o: o.at)
    return Run(outcomes, samples, started_wall)
