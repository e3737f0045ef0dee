"""engine.logging: typed events as JSON lines in a file, readable lines on the console, bound context."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import trio

from engine.logging import (
    EventLogClosed,
    LogFileError,
    MissingContext,
    configure_diagnostics,
    node_console_level,
    open_event_log,
    route_diagnostics,
)
from engine.logs.aggregate import Aggregator
from engine.logs.summary import summarize
from messages.log.events import (
    ClientConnected,
    HttpAccess,
    Diagnostic,
    FirstToken,
    NodeStarted,
    NodeStopped,
    PrefillStarted,
    ReplicaFailed,
    ReplicaStateChanged,
    RequestFailed,
    event_decoder,
)


def _events(path: Path) -> list[object]:
    decoder = event_decoder()
    return [decoder.decode(line) for line in path.read_bytes().splitlines()]


def test_events_are_written_as_typed_json_lines_and_readable_console_lines(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    console = io.StringIO()
    log = open_event_log(file=str(path), level="info", console=console)
    started = ReplicaStateChanged(
        ts=1700000000.25,
        replica="prefill-0",
        from_state="LoadingPrefill",
        to_state="Prefill",
        trigger="automatic",
        reason="weights loaded",
    )
    log.emit(started)
    log.emit(ClientConnected(ts=1700000001.0, connection="c1", peer="127.0.0.1:5000"))
    log.close()
    assert _events(path) == [
        started,
        ClientConnected(ts=1700000001.0, connection="c1", peer="127.0.0.1:5000"),
    ]
    assert path.read_bytes().splitlines()[0] == (
        b'{"event":"replica_state","ts":1700000000.25,"replica":"prefill-0","from":"LoadingPrefill",'
        b'"to":"Prefill","trigger":"automatic","reason":"weights loaded"}'
    )
    first, second = console.getvalue().splitlines()
    assert "[info     ] replica_state" in first
    assert (
        "replica=prefill-0" in first and "from=LoadingPrefill" in first and "reason='weights loaded'" in first
    )
    assert "client_connected" in second and "peer=127.0.0.1:5000" in second


def test_bound_context_fills_unset_fields_only(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    log = open_event_log(file=str(path), console=None)
    request_log = log.bind(request_id="r1").bind(replica="prefill-0")
    request_log.emit(PrefillStarted(tokens=12, batch_size=1))
    request_log.emit(FirstToken(replica="decode-1", token_id=5, ttft_s=0.5))
    request_log.emit(NodeStopped(exit_code=0, leaked_blocks=0, uptime_s=1.0))
    log.close()
    prefill, first, stopped = _events(path)
    assert isinstance(prefill, PrefillStarted) and (prefill.request_id, prefill.replica) == (
        "r1",
        "prefill-0",
    )
    assert isinstance(first, FirstToken) and (first.request_id, first.replica) == ("r1", "decode-1")
    assert isinstance(stopped, NodeStopped)


def test_required_context_is_enforced() -> None:
    log = open_event_log(file=None, console=None)
    with pytest.raises(
        MissingContext, match=r"^event 'request_failed' needs request_id: pass it or bind it$"
    ):
        log.emit(RequestFailed(code="internal", message="x"))
    with pytest.raises(MissingContext, match=r"^event 'replica_failed' needs replica: pass it or bind it$"):
        log.bind(request_id="r").emit(ReplicaFailed(error="boom", failed_requests=1))
    log.bind(replica="decode-0").emit(ReplicaFailed(error="boom", failed_requests=1))


def test_levels_filter_both_sinks(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    console = io.StringIO()
    log = open_event_log(file=str(path), level="warning", console=console)
    assert not log.enabled("info") and log.enabled("error")
    log.emit(ClientConnected(connection="c1", peer="p"))
    log.bind(request_id="r9").emit(RequestFailed(code="overloaded", message="queue full"))
    log.close()
    (failed,) = _events(path)
    assert isinstance(failed, RequestFailed) and failed.request_id == "r9"
    assert "client_connected" not in console.getvalue() and "[error    ] request_failed" in console.getvalue()


def test_the_console_may_be_quieter_than_the_file_and_still_shows_the_start_line(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    console = io.StringIO()
    log = open_event_log(file=str(path), level="info", console=console, console_level="warning")
    assert log.enabled("info")
    started = NodeStarted(
        listen="l", model="tiny", device="cpu", transport="inproc", replicas=[], pid=1, version="v"
    )
    log.emit(started)
    log.emit(ClientConnected(connection="c1", peer="p"))
    log.bind(request_id="r9").emit(RequestFailed(code="overloaded", message="queue full"))
    log.emit(HttpAccess(method="GET", path="/v1/models", status=404, seconds=0.001))
    log.emit(Diagnostic(severity="info", name="weights.loaded", fields={"seconds": "1.5"}))
    log.emit(Diagnostic(severity="info", name="transport.connected", fields={}))
    log.close()
    kinds = [NodeStarted, ClientConnected, RequestFailed, HttpAccess, Diagnostic, Diagnostic]
    assert [type(event) for event in _events(path)] == kinds
    shown = console.getvalue()
    assert "node_started" in shown and "request_failed" in shown and "client_connected" not in shown
    assert "[info     ] http_access" in shown and "status=404" in shown  # the access line, at info
    assert "weights.loaded" in shown and "transport.connected" not in shown  # progress, not chatter
    assert [node_console_level(level) for level in ("debug", "info", "warning", "error")] == [
        "debug",
        "warning",
        "warning",
        "error",
    ]


async def test_emitting_from_worker_threads_keeps_lines_whole(tmp_path: Path) -> None:
    path = tmp_path / "node.jsonl"
    log = open_event_log(file=str(path), console=None)

    def burst(worker: int) -> None:
        for index in range(200):
            log.emit(ClientConnected(connection=f"w{worker}-{index}", peer="x" * 500))

    async with trio.open_nursery() as nursery:
        for worker in range(4):
            nursery.start_soon(trio.to_thread.run_sync, burst, worker)
    log.close()
    events = _events(path)
    assert len(events) == 800
    assert {event.connection for event in events if isinstance(event, ClientConnected)} == {
        f"w{w}-{i}" for w in range(4) for i in range(200)
    }


def test_close_is_final_and_bad_paths_are_named(tmp_path: Path) -> None:
    log = open_event_log(file=str(tmp_path / "a.jsonl"), console=None)
    log.close()
    log.close()
    with pytest.raises(EventLogClosed, match=r"^event 'client_connected' emitted after the log was closed$"):
        log.emit(ClientConnected(connection="c", peer="p"))
    missing = tmp_path / "no" / "such" / "dir.jsonl"
    with pytest.raises(LogFileError, match=rf"^log file '{missing}': No such file or directory$"):
        open_event_log(file=str(missing), console=None)


@pytest.fixture
def diagnostics_stream() -> Iterator[io.StringIO]:
    """Diagnostics configured as the node's entry point does, onto a stream of the test's; structlog's
    defaults again afterwards."""
    stream = io.StringIO()
    configure_diagnostics("info", stream)
    try:
        yield stream
    finally:
        route_diagnostics(None)
        structlog.reset_defaults()


def test_diagnostics_become_events_of_the_log_while_it_is_open(
    tmp_path: Path, diagnostics_stream: io.StringIO
) -> None:
    path = tmp_path / "node.jsonl"
    aggregator = Aggregator()
    log = open_event_log(file=str(path), level="info", console=None, observers=[aggregator.add])
    diagnostics = structlog.get_logger("tests.diagnostics")
    diagnostics.info("transfer.before_the_log", step=1)
    route_diagnostics(log)
    diagnostics.warning("transfer.link_closed", link="a ⇄ b", reason="its endpoint stopped")
    diagnostics.info("transfer.transport_chosen", transport="inproc")
    diagnostics.debug("transfer.below_the_level", step=2)
    route_diagnostics(None)
    log.close()
    diagnostics.info("transfer.after_the_log", step=3)

    written = _events(path)
    assert [(e.severity, e.name, e.fields) for e in written if isinstance(e, Diagnostic)] == [
        ("warning", "transfer.link_closed", {"link": "a ⇄ b", "reason": "its endpoint stopped"}),
        ("info", "transfer.transport_chosen", {"transport": "inproc"}),
    ]
    printed = diagnostics_stream.getvalue()
    assert "transfer.before_the_log" in printed and "transfer.after_the_log" in printed
    assert "transfer.link_closed" not in printed and "below_the_level" not in printed
    # The summary's problems name the warnings among them.
    problems = summarize(aggregator).problems
    assert problems == [
        "warning transfer.link_closed 1 time(s), first: link=a ⇄ b reason=its endpoint stopped"
    ]


def test_a_diagnostic_on_the_console_reads_under_its_own_name(diagnostics_stream: io.StringIO) -> None:
    console = io.StringIO()
    log = open_event_log(file=None, level="info", console=console)
    route_diagnostics(log)
    structlog.get_logger("tests.diagnostics").warning("transfer.handshake_refused", endpoint="decode-0/kv")
    route_diagnostics(None)
    line = console.getvalue()
    assert "[warning  ] transfer.handshake_refused" in line and "endpoint=decode-0/kv" in line
    assert "diagnostic" not in line and diagnostics_stream.getvalue() == ""
