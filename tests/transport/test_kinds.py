"""Which transports a node can use (`transport.kinds`): the `auto` rule, the errors for transports that
cannot work here, and that zigzag imports and explains itself without the optional ucxx."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.config import ConfigError, parse_node_config
from transport.kinds import LinkFacts, choose, unavailable


@pytest.mark.parametrize(
    ("facts", "ucx", "expected"),
    [
        (LinkFacts(same_process=True, same_host=True, gpu_pools=True), True, "inproc"),
        (LinkFacts(same_process=False, same_host=True, gpu_pools=True), True, "cuda-ipc"),
        (LinkFacts(same_process=False, same_host=True, gpu_pools=False), True, "ucx"),
        (LinkFacts(same_process=False, same_host=False, gpu_pools=True), True, "ucx"),
        (LinkFacts(same_process=False, same_host=False, gpu_pools=True), False, "tcp"),
        (LinkFacts(same_process=False, same_host=True, gpu_pools=False), False, "tcp"),
    ],
)
def test_auto_picks_the_best_transport_per_link(facts: LinkFacts, ucx: bool, expected: str) -> None:
    kind, reason = choose(facts, ucx=ucx)
    assert kind == expected
    assert reason


def test_cuda_ipc_on_cpu_pools_is_refused_at_configuration() -> None:
    assert unavailable("tcp", device="cpu") is None
    with pytest.raises(
        ConfigError, match=r"--transport cuda-ipc moves pools on a GPU; the pools are on 'cpu'"
    ):
        parse_node_config(["--transport", "cuda-ipc"])


@pytest.mark.slow  # a fresh Python importing torch
def test_zigzag_imports_and_explains_a_missing_ucxx() -> None:
    """With ucxx hidden, every package imports, `--transport ucx` is refused naming the extra to install,
    and nothing imported ucxx along the way."""
    script = """
import sys
sys.modules["ucxx"] = None  # as if the ucx extra were not installed
import engine.node, engine.bench.transfer, replicas.fabric, transport.endpoint, transport.links.dial
assert engine.node.main(["--transport", "ucx"]) == 2
assert sys.modules["ucxx"] is None
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith(
        "--transport ucx needs ucxx, which is not installed: "
        "pip install 'zigzag[ucx]' (ucxx-cu12; ucxx-cu13 on CUDA 13 hosts)"
    )
