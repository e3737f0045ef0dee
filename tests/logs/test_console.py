"""The node's console is quiet by default: warnings, the start and stop lines and the periodic one-line
serving summary — every request's events go to `--log-file`, which `python -m engine.logs` reads, summary
lines included; at `--log-level debug` the console shows every event. Through real node processes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trio

from engine.logs.__main__ import main
from tests.node.harness import NodeProcess, node_process, wait_serving
from tests.waiting import wait_until

REQUEST_EVENTS = (
    "request_arrived",
    "prefill_started",
    "transfer_finished",
    "first_token",
    "request_finished",
)
SUMMARY_TIMEOUT = 30.0
CONSOLE_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} \[(?P<level>\w+)\s*\] (?P<event>\S+)")


def console_events(node: NodeProcess) -> list[tuple[str, str]]:
    """(level, event) of each console line on the node's stderr."""
    lines = node.stderr().splitlines()
    parsed = [CONSOLE_LINE.match(line) for line in lines]
    assert all(parsed), f"a stderr line that is not a console event: {lines}"
    return [(m["level"], m["event"]) for m in parsed if m is not None]


async def serve_requests(node: NodeProcess, count: int) -> None:
    async with node.client() as client:
        await wait_serving(client)
        async with trio.open_nursery() as nursery:
            for index in range(count):
                nursery.start_soon(lambda i=index: client.generate_result(prompt=f"hello {i}", max_tokens=6))
    # The summary lines (one every 0.2 s while busy) count every finished request: wait until they do.
    await wait_until(
        lambda: sum(event["finished"] for event in node.events("serving_summary")) >= count,
        f"serving summaries counting {count} finished requests",
        SUMMARY_TIMEOUT,
    )


@pytest.mark.slow
async def test_the_console_shows_the_start_line_the_summary_and_no_request_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    options = ("--log-console", "--log-summary-period", "0.2", "--replicas", "prefill=1,decode=1")
    with node_process(tmp_path, *options) as node:
        await serve_requests(node, 4)
    events = console_events(node)
    names = [event for _, event in events if event != "weights.loaded"]  # progress: any time
    assert names[0] == "node_started" and names[-2:] == ["node_stopping", "node_stopped"]
    assert "serving_summary" in names
    noise = [(level, event) for level, event in events if level == "info"]
    assert {event for _, event in noise} <= {
        "node_started",
        "serving_summary",
        "node_stopping",
        "node_stopped",
        "weights.loaded",  # the progress of a start (engine.logging.CONSOLE_PROGRESS)
    }
    # The file holds every request's events, and the summaries, and engine.logs reads it.
    logged = [event["event"] for event in node.events()]
    for name in REQUEST_EVENTS:
        assert logged.count(name) >= 4, name
    summaries = node.events("serving_summary")
    assert sum(s["finished"] for s in summaries) == 4 and all(s["replicas"] == 2 for s in summaries)
    assert main(["summary", str(node.log_file)]) == 0
    assert "requests: 4" in capsys.readouterr().out


@pytest.mark.slow
async def test_the_console_shows_every_event_at_debug(tmp_path: Path) -> None:
    options = ("--log-console", "--log-level", "debug", "--log-summary-period", "0.2")
    options += ("--replicas", "prefill=1,decode=1")
    with node_process(tmp_path, *options) as node:
        await serve_requests(node, 1)
    names = {event for _, event in console_events(node)}
    assert set(REQUEST_EVENTS) <= names


def test_a_clients_mistake_is_not_an_error_line() -> None:
    """A request refused for what its client sent (a 4xx) is logged at info, so the console (warnings
    and up) stays quiet about it; a failure of the node's own stays an error."""
    from messages.log.events import CLIENT_MISTAKES, RequestFailed, level_of

    for code in CLIENT_MISTAKES:
        assert level_of(RequestFailed(code=code, message="the client's")) == "info"
    for code in ("replica_failed", "transfer_failed", "internal", "overloaded"):
        assert level_of(RequestFailed(code=code, message="the node's")) == "error"
