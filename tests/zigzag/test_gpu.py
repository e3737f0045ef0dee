"""ZigZag on a GPU (skipped without one; `.ci/gpu` runs it): the node on `cuda` over cuda-ipc, a
scale-up whose weights come from the peer replica (device to device) and then, after a scale-down,
from the pinned host copy; relays at a middle layer; every output equals the model run in one piece
(float32, so the comparison is exact up to ties)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from messages.control import SourceChoice
from replicas.model import tiny_model
from tests.node.harness import by_name, node_process, wait_idle, wait_serving, wait_states, wait_status
from tests.node.workload import check_outcome, mixed_workload, send_all

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is false")
    return torch.device("cuda")


async def test_zigzag_on_a_gpu_over_cuda_ipc(tmp_path: Path, cuda: torch.device) -> None:
    model = tiny_model(device=cuda)
    options = ["--device", "cuda", "--dtype", "float32", "--transport", "cuda-ipc"]
    options += ["--replicas", "prefill=1,decode=1", "--no-old-prefill-serves-queue"]
    options += ["--fault", "hold_weights:before_layer=2,seconds=600"]
    outcomes = []
    with node_process(tmp_path, *options) as node:
        async with node.client() as client:
            await wait_serving(client)
            sources: tuple[SourceChoice, ...] = ("peer", "host")
            for index, source in enumerate(sources):
                result = await client.scale("prefill", 2, mode="zigzag", source=source)
                new = result.started[0].replica
                await wait_status(
                    client, lambda s, new=new: by_name(s)[new].loaded_layers == 2, f"{new} at 2 layers"
                )
                outcomes += await send_all(client, mixed_workload(model, 8, text=True, seed=index))
                assert (await client.release()).released == 1
                await wait_states(client, {new: "Prefill", "prefill-0": "Prefill"})
                assert by_name(await client.status())[new].weights_source == source
                await wait_idle(client)
                await client.scale("prefill", 1)
                parked = await wait_status(
                    client, lambda s: any(r.state == "ShuttingNull" for r in s.replicas), "one ShuttingNull"
                )
                (name,) = [r.name for r in parked.replicas if r.state == "ShuttingNull"]
                await client.transition(name, "Inactive")
    problems = [p for outcome in outcomes for p in check_outcome(model, outcome, transport="cuda-ipc")]
    assert not problems, "\n".join(problems)
    assert {o.result.relay.layer for o in outcomes if o.result.relay is not None} == {2}
