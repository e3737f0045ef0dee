"""A prompt never waits while a prefill replica that can take it is idle, through a real node.

Three prefill replicas, each emulating a slow accelerator (`--emulated-speed prefill_tokens_per_s=40`: a
160-token prompt computes for 4 s), so a prompt that went to a busy replica would wait for the one in
compute. The checks are orderings of the node's own events, never durations: each prompt's
`prefill_started` comes before any `prefill_finished`, on a replica of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import trio

from tests.node.harness import NodeProcess, node_process, wait_idle, wait_serving
from tests.node.workload import Ask, send

REPLICAS = 3
PROMPT = 160  # tokens: 4 s at the emulated speed


@pytest.fixture(scope="module")
def slow_prefill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    directory: Path = tmp_path_factory.mktemp("dispatch")
    options = ("--replicas", f"prefill={REPLICAS},decode=1", "--emulated-speed", "prefill_tokens_per_s=40")
    with node_process(directory, *options) as node:
        yield node


def _ask(seed: int) -> Ask:
    return Ask(
        input_ids=tuple(3 + (seed * 7 + i) % 200 for i in range(PROMPT)), max_tokens=1, ignore_eos=True
    )


def _started(node: NodeProcess, prefix: str) -> list[dict[str, object]]:
    return [e for e in node.events("prefill_started") if str(e["request_id"]).startswith(prefix)]


def _finished(node: NodeProcess, prefix: str) -> list[dict[str, object]]:
    return [e for e in node.events("prefill_finished") if str(e["request_id"]).startswith(prefix)]


async def test_prompts_sent_at_once_start_at_once_on_idle_replicas(slow_prefill: NodeProcess) -> None:
    """As many prompts as idle replicas, sent together: every one starts before any finishes, each on
    its own replica."""
    async with slow_prefill.client() as client, trio.open_nursery() as nursery:
        await wait_serving(client)
        for index in range(REPLICAS):
            nursery.start_soon(partial(send, client, _ask(index), request_id=f"together-{index}"))
        await slow_prefill.wait_event(
            "prefill_started",
            lambda e: len(_started(slow_prefill, "together-")) == REPLICAS,
            timeout=60,
        )
        started = _started(slow_prefill, "together-")
        assert _finished(slow_prefill, "together-") == [], "a prompt finished before the last one started"
        assert len({e["replica"] for e in started}) == REPLICAS, started
    async with slow_prefill.client() as client:
        await wait_idle(client)


async def test_a_prompt_goes_to_an_idle_replica_not_behind_a_busy_one(slow_prefill: NodeProcess) -> None:
    """One prompt computes; the next, sent once it started, starts on another replica before the first
    finishes — not queued behind it on the replica whose queue happens to be empty."""
    async with slow_prefill.client() as client, trio.open_nursery() as nursery:
        await wait_serving(client)
        nursery.start_soon(partial(send, client, _ask(10), request_id="first-0"))
        first = await slow_prefill.wait_event(
            "prefill_started", lambda e: e["request_id"] == "first-0", timeout=60
        )
        nursery.start_soon(partial(send, client, _ask(11), request_id="second-0"))
        second = await slow_prefill.wait_event(
            "prefill_started", lambda e: e["request_id"] == "second-0", timeout=60
        )
        assert _finished(slow_prefill, "first-") == [], "the second prompt waited for the first to finish"
        assert second["replica"] != first["replica"]
    async with slow_prefill.client() as client:
        await wait_idle(client)
