"""The client library and ``python -m engine.client`` against a live server (the handler of conftest.py)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import trio

from engine.cli import options
from engine.client import ControlClient, ControlConnectionClosed, ControlError
from engine.client.cli import main as cli_main
from engine.client.cli import render
from engine.config import FLAG_PREFIXES, NodeConfig
from engine.config.address import TcpAddress
from messages.control import ImageInput
from messages.control_replies import GenerateResult, ReplicaStatus, StatusResult, TokenReply
from tests.control.conftest import Served, start_server
from tests.node.harness import launch_node
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
DEPRECATION = (
    "note: $ZIGZAG_ADDRESS is deprecated; set $ZIGZAG_LISTEN, which the node reads for its --listen too\n"
)


async def test_ops_and_errors_through_the_client(served: Served) -> None:
    async with ControlClient.connect(served.address) as client:
        status = await client.status()
        assert [replica.name for replica in status.replicas] == ["decode-0"]
        replies = [
            reply async for reply in client.generate(prompt="p", max_tokens=3, stream=True, request_id="mine")
        ]
        assert [type(reply) for reply in replies] == [TokenReply, TokenReply, TokenReply, GenerateResult]
        assert "".join(reply.text for reply in replies[:3]) == replies[-1].text == "012"
        assert {reply.request_id for reply in replies} == {"mine"}
        image = ImageInput(width=1, height=2, pixels=bytes(range(6)))
        result = await client.generate_result(input_ids=[5, 6, 7], images=[image], max_tokens=2)
        assert (result.prompt_tokens, result.text) == (3, "01[1x2 000102030405]")
        with pytest.raises(ControlError) as refused:
            await client.cancel("missing")
        assert (refused.value.code, refused.value.message) == ("not_found", "no live request 'missing'")
        with pytest.raises(
            ControlError, match=r"^bad_request: invalid request: Expected `int` >= 1 - at `\$.max_tokens`$"
        ):
            await client.generate_result(prompt="x", max_tokens=0)
        with pytest.raises(ControlError, match=r"^not_supported: lock is not supported here$"):
            await client.lock("decode-0")
        assert (await client.shutdown()).in_flight == 0


async def test_concurrent_requests_share_one_connection(served: Served) -> None:
    results: dict[int, GenerateResult] = {}
    async with ControlClient.connect(served.address) as client:

        async def one(n: int) -> None:
            results[n] = await client.generate_result(prompt="p", max_tokens=n)

        async with trio.open_nursery() as nursery:
            for n in range(1, 9):
                nursery.start_soon(one, n)
            nursery.start_soon(client.status)
    assert {n: len(result.token_ids) for n, result in results.items()} == {n: n for n in range(1, 9)}


async def test_leaving_a_stream_early_keeps_the_client_usable(served: Served) -> None:
    async with ControlClient.connect(served.address) as client:
        replies = client.generate(prompt="p", max_tokens=50, stream=True)
        async for reply in replies:
            assert isinstance(reply, TokenReply)
            break
        await replies.aclose()
        assert (await client.status()).accepting
        assert len((await client.generate_result(prompt="p", max_tokens=4)).token_ids) == 4


async def test_a_closing_server_ends_pending_requests_with_cancelled(
    nursery: trio.Nursery, short_dir: Path
) -> None:
    served = await start_server(nursery, TcpAddress(host="127.0.0.1", port=0), short_dir)
    async with ControlClient.connect(served.address) as client:

        async def close_when_started() -> None:
            await served.handler.wait("started", "1")
            served.server.close()

        nursery.start_soon(close_when_started)
        with pytest.raises(ControlError, match=r"^cancelled: cancelled: the server is closing$"):
            await client.generate_result(prompt="sleep")
        with pytest.raises(ControlConnectionClosed):
            await client.status()


async def _cli(served: Served, *args: str) -> tuple[int, str, str]:
    result = await trio.run_process(
        [sys.executable, "-m", "engine.client", "--address", str(served.address), *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=REPO,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def test_cli_against_a_live_server(nursery: trio.Nursery, short_dir: Path, tmp_path: Path) -> None:
    served = await start_server(nursery, TcpAddress(host="127.0.0.1", port=0), short_dir)
    code, out, err = await _cli(served, "status")
    assert code == 0, err
    assert out.splitlines()[1].split()[:5] == ["decode-0", "Decode", "0", "0", "64"]

    code, out, _ = await _cli(served, "--json", "generate", "--prompt", "hi", "--max-tokens", "2", "--stream")
    lines = [msgspec.json.decode(line) for line in out.splitlines()]
    assert code == 0
    assert [(line["type"], line.get("text")) for line in lines] == [
        ("token", "0"),
        ("token", "1"),
        ("result", "01"),
    ]

    ppm = tmp_path / "dot.ppm"
    ppm.write_bytes(b"P6\n# a comment\n2 1\n255\n" + bytes([1, 2, 3, 4, 5, 6]))
    raw = tmp_path / "dot.rgb"
    raw.write_bytes(bytes([9, 9, 9]))
    code, out, err = await _cli(
        served,
        "generate",
        "--input-ids",
        "1,2",
        "--max-tokens",
        "1",
        "--image",
        str(ppm),
        "--raw-image",
        f"1x1:{raw}",
    )
    assert (code, out) == (0, "0[2x1 010203040506][1x1 090909]\n"), err
    assert re.fullmatch(r"\[request [0-9a-f]{32}, 1 tokens, length, e2e 0.0 ms\]\n", err)

    code, out, err = await _cli(served, "cancel", "nothing-here")
    assert (code, out, err) == (1, "", "error not_found: no live request 'nothing-here'\n")

    code, _, err = await _cli(served, "generate", "--prompt", "x", "--raw-image", "axb:nofile")
    assert (code, err) == (2, "--raw-image 'axb:nofile': expected WIDTHxHEIGHT:FILE, e.g. 64x48:image.rgb\n")


async def test_the_cli_reads_the_nodes_listen_variable_and_still_the_old_one(served: Served) -> None:
    """`$ZIGZAG_LISTEN` places the node's socket (`--listen`) and the client's default alike; the
    client's former `$ZIGZAG_ADDRESS` still works, with a note saying what to set instead."""
    listen = next(option for option in options(NodeConfig, FLAG_PREFIXES) if option.flag == "--listen")
    assert listen.env == "ZIGZAG_LISTEN"
    for variable, note in (("ZIGZAG_LISTEN", ""), ("ZIGZAG_ADDRESS", DEPRECATION)):
        environ = {key: value for key, value in os.environ.items() if not key.startswith("ZIGZAG_")}
        result = await trio.run_process(
            [sys.executable, "-m", "engine.client", "status"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=REPO,
            env={**environ, variable: str(served.address)},
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.decode().splitlines()[1].split()[0] == "decode-0"
        assert result.stderr.decode() == note


def test_the_clis_help_shows_its_default_address_and_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["--help"], environ={"ZIGZAG_LISTEN": "127.0.0.1:9999"})
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "(default: 127.0.0.1:7340, the node's --listen default; $ZIGZAG_LISTEN, the node's variable, sets"
        in text
    )
    assert "now 127.0.0.1:9999)" in text


@pytest.mark.slow
async def test_ready_waits_through_a_node_still_starting_until_it_serves(tmp_path: Path) -> None:
    """Started before the node listens, `ready` retries until prefill and decode serve, then prints the
    status; with nothing to answer it gives up at --timeout (exit 3)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    client = [sys.executable, "-m", "engine.client", "--address", address, "--timeout", "120", "ready"]
    done: list[subprocess.CompletedProcess[bytes]] = []

    async def wait_ready() -> None:
        run = trio.run_process(client, capture_stdout=True, capture_stderr=True, check=False, cwd=REPO)
        done.append(await run)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_ready)
        node = launch_node(tmp_path, "--replicas", "prefill=1,decode=1", "--listen", address)
        try:
            await wait_until(lambda: done, "the client's ready to return", 120)
        finally:
            node.kill()
    (ready,) = done
    assert ready.returncode == 0, ready.stderr
    rows = [line.split()[:2] for line in ready.stdout.decode().splitlines()[1:]]
    assert rows == [["prefill-0", "Prefill"], ["decode-0", "Decode"]]
    gone = await trio.run_process(
        [*client[:6], "1", "ready"], capture_stdout=True, capture_stderr=True, check=False, cwd=REPO
    )
    assert (gone.returncode, gone.stderr.decode()) == (3, "no answer within --timeout 1.0 s\n")


async def test_cli_without_a_server(short_dir: Path) -> None:
    result = await trio.run_process(
        [sys.executable, "-m", "engine.client", "--address", f"unix:{short_dir}/none.sock", "status"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=REPO,
    )
    assert result.returncode == 3
    assert result.stderr.decode().startswith(f"cannot reach the node at unix:{short_dir}/none.sock: ")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--address", "http://127.0.0.1:7340"],
            "address 'http://127.0.0.1:7340': expected HOST:PORT (e.g. 127.0.0.1:7340) or unix:PATH, with no "
            "scheme; an IPv6 host goes in brackets, e.g. [::1]:7340",
        ),
        (
            ["--address", "127.0.0.1"],
            "address '127.0.0.1': expected HOST:PORT (e.g. 127.0.0.1:7340) or unix:PATH",
        ),
        (["--timeout", "-1"], "--timeout -1.0: must be a positive number of seconds"),
    ],
)
def test_a_malformed_address_or_timeout_is_bad_usage(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit 2 (bad usage) before any connection is tried; it was 3, as if the node could not be reached."""
    assert cli_main([*options, "status"], environ={}) == 2
    assert capsys.readouterr().err == message + "\n"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"P6\n16", "a PPM header needs width, height and maxval as numbers, got [b'16', b'', b'']"),
        (b"P6\n# no end", "the PPM header ends inside a comment"),
        (None, "No such file or directory"),
    ],
    ids=["truncated header", "open comment", "missing file"],
)
def test_an_image_file_that_cannot_be_read_names_itself(
    tmp_path: Path, content: bytes | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "picture.ppm"
    if content is not None:
        path.write_bytes(content)
    assert cli_main(["generate", "--prompt", "x", "--image", str(path)], environ={}) == 2
    prefix = "--image/--raw-image: " if content is None else ""
    assert capsys.readouterr().err == f"{prefix}{path}: {message}\n"


def test_a_peer_that_is_not_a_node_is_named_in_the_error(capsys: pytest.CaptureFixture[str]) -> None:
    """An HTTP server (say) on the address: the error names the address it came from."""
    with socket.create_server(("127.0.0.1", 0)) as server:

        def answer_like_http() -> None:
            connection, _ = server.accept()
            with connection:
                connection.recv(4096)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer_like_http)
        thread.start()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert cli_main(["--address", address, "status"], environ={}) == 3
        thread.join(timeout=10)
        assert not thread.is_alive(), "the fake HTTP server did not answer and end within 10 s"
    assert capsys.readouterr().err.startswith(f"ControlProtocolError from {address}: ")


def test_the_status_table_says_why_each_replica_is_locked() -> None:
    def replica(name: str, state: str, locked: bool, reasons: list[str]) -> ReplicaStatus:
        return ReplicaStatus(
            name=name, role=name.split("-")[0], state=state, used_blocks=0, cached_blocks=0, total_blocks=8,
            locked=locked, lock_reasons=reasons, work_queue=0, migration_queue=0, last_error=None,
            transport="inproc",
        )  # type: ignore[arg-type]  # fmt: skip

    replicas = [
        replica("prefill-0", "Prefill", True, []),
        replica("decode-0", "Decode", False, []),
        replica("decode-1", "Decode", True, ["controller", "manual"]),
    ]
    rows = render(StatusResult(id="s", accepting=True, replicas=replicas)).splitlines()
    assert [row.split("  ")[0].split()[0] for row in rows[1:]] == ["prefill-0", "decode-0", "decode-1"]
    column = rows[0].index(" lock ") + 1
    assert [row[column : column + 18].rstrip() for row in rows[1:]] == [
        "not decoding",
        "-",
        "controller,manual",
    ]
