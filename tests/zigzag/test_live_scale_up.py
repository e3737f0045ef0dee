"""ZigZag live scale-up through a real node (architecture §8): a new prefill replica serves while its weights
arrive, hands its batches to an OldPrefill partner at the layer it reached, and both KV halves land in
one decode replica; every output equals the model run in one piece.

The `hold_weights` fault hook holds the Nth weight copy of the node before layer K, so each scale-up
episode relays at a known boundary: n = 0 (embeddings only), a middle layer, L − 1 and L (every layer,
no head). Requests are sent once the new replica shows exactly K layers loaded, so no relay happens at
another boundary; once they all ended the test lets the copy go (the `release` op). Each episode ends
with both replicas back in `Prefill` by themselves; the new replica is then scaled down and released
(`Inactive`), so the next scale-up copies the weights again.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from engine.client import ControlClient
from engine.logs.__main__ import main as logs_main
from engine.logs.timeline import Timeline
from messages.control import SourceChoice
from messages.control_replies import GenerateResult, StatusResult
from messages.grammar import RegexGrammar
from replicas.model import Model, SamplingParams, generate_in_one_piece
from tests.epd.images import image_input, image_with_rows, reference
from tests.node.harness import (
    by_name,
    default_transport,
    node_process,
    wait_idle,
    wait_serving,
    wait_states,
    wait_status,
)
from tests.node.workload import Outcome, check_outcome, mixed_workload, send_all

LAYERS = 4  # the tiny model's
# (hold before layer K, weight source) per episode, in order: the node's 1st … 4th weight copy.
EPISODES: tuple[tuple[int, SourceChoice], ...] = (
    (0, "peer"),
    (2, "host"),
    (LAYERS - 1, "disk"),
    (LAYERS, "auto"),
)
HOLD_SECONDS = 600.0  # a bound only: each test releases its holds (`release`) when it has seen them
PER_EPISODE = 10  # requests sent while the new replica holds K layers (32+ over the whole test)
GRAMMAR_PROMPT = [40, 41, 42, 43, 44]
GRAMMAR_PATTERN = r"(zig|zag)-[0-9]{2,4}"


def transports() -> list[str]:
    return sorted({default_transport(), "tcp"})


async def run_episode(
    client: ControlClient, model: Model, *, layer: int, source: SourceChoice, seed: int
) -> list[Outcome]:
    result = await client.scale("prefill", 2, mode="zigzag", source=source)
    assert [(s.mode, s.source) for s in result.started] == [
        ("zigzag", "peer" if source == "auto" else source)
    ]
    new = result.started[0].replica

    def holding(status: StatusResult) -> bool:  # the embeddings landed: it can take batches
        replica = by_name(status)[new]
        return (
            replica.state == "NewPrefill"
            and replica.loaded_layers == layer
            and replica.weights_bytes_loaded > 0
        )

    await wait_status(client, holding, f"{new} NewPrefill holding {layer} layers")
    status = by_name(await client.status())
    (old,) = status[new].paired_with
    assert status[old].state == "OldPrefill" and status[old].paired_with == [new]
    outcomes = await send_all(client, mixed_workload(model, PER_EPISODE, text=True, seed=seed))
    relayed = [o.result.relay for o in outcomes if o.result.relay is not None]
    assert relayed, f"no request was relayed while {new} held {layer} layers"
    assert {(r.new_prefill, r.old_prefill, r.layer) for r in relayed} == {(new, old, layer)}
    assert (await client.release()).released == 1
    # Loading finishes after the hold: NewPrefill → RefractoryPrefill → Prefill, OldPrefill → Prefill.
    await wait_states(client, {new: "Prefill", old: "Prefill"})
    final = by_name(await client.status())[new]
    assert final.loaded_layers == final.total_layers == LAYERS
    assert final.weights_source in (("peer", "host", "disk") if source == "auto" else (source,))
    await wait_idle(client)
    await client.scale("prefill", 1)
    idle = await wait_status(
        client, lambda s: any(r.state == "ShuttingNull" for r in s.replicas), "a prefill replica ShuttingNull"
    )
    (parked,) = [r.name for r in idle.replicas if r.state == "ShuttingNull"]
    await client.transition(parked, "Inactive")
    return outcomes


@pytest.mark.parametrize("transport", transports())
async def test_scale_up_relays_at_every_boundary_token_exact(
    tmp_path: Path, tiny: Model, transport: str
) -> None:
    holds = [
        f"hold_weights:before_layer={layer},seconds={HOLD_SECONDS},nth={nth}"
        for nth, (layer, _) in enumerate(EPISODES, start=1)
    ]
    options = ["--replicas", "prefill=1,decode=1", "--transport", transport]
    for hold in holds:
        options += ["--fault", hold]
    with node_process(tmp_path, *options) as node:
        outcomes: list[Outcome] = []
        async with node.client() as client:
            await wait_serving(client)
            for index, (layer, source) in enumerate(EPISODES):
                outcomes += await run_episode(client, tiny, layer=layer, source=source, seed=100 + index)
            await wait_idle(client)
        assert node.http_url is not None
        async with httpx.AsyncClient(base_url=node.http_url) as http:
            metrics = (await http.get("/metrics")).text
    problems = [p for outcome in outcomes for p in check_outcome(tiny, outcome, transport=transport)]
    assert not problems, "\n".join(problems)
    layers_seen = {o.result.relay.layer for o in outcomes if o.result.relay is not None}
    assert layers_seen == {layer for layer, _ in EPISODES}
    relay_events = node.events("relay_received")
    assert {e["layer"] for e in relay_events} == layers_seen
    assert not node.events("replica_failed")
    relays = {
        sample.labels["layer"]: sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "zigzag:relays_total"
    }
    assert {int(layer) for layer in relays} == layers_seen
    assert sum(relays.values()) == len(relay_events)


async def test_image_requests_relayed_token_exact(
    tmp_path: Path, tiny: Model, capsys: pytest.CaptureFixture[str]
) -> None:
    """With images (EPD: an encode replica sends the embeddings to the NewPrefill replica), the relay
    carries the merged input rows and their 3-D rotary positions. `--no-old-prefill-serves-queue`: the
    router hands new requests to the NewPrefill alone during the episode, so they are all relayed — a
    structured output (a regex) among them: OldPrefill builds the grammar's matcher to sample its first
    token, the decode replica rebuilds it from that token."""
    transport = default_transport()
    options = ["--replicas", "encode=1,prefill=1,decode=1", "--no-old-prefill-serves-queue"]
    options += ["--fault", f"hold_weights:before_layer=2,seconds={HOLD_SECONDS}"]
    with node_process(tmp_path, *options) as node:
        async with node.client() as client:
            await wait_serving(client)
            result = await client.scale("prefill", 2, mode="zigzag")
            new = result.started[0].replica

            def holding(status: StatusResult) -> bool:
                return by_name(status)[new].loaded_layers == 2

            await wait_status(client, holding, f"{new} holding 2 layers")
            prompts = [("<image>what is it?", 4), ("two: <image> and <image>", 6), ("<image>", 9)]
            images = {
                index: [image_with_rows(rows, seed=index + k) for k in range(prompt.count("<image>"))]
                for index, (prompt, rows) in enumerate(prompts)
            }
            results: dict[int, GenerateResult] = {}

            async def one(index: int) -> None:
                prompt, _ = prompts[index]
                results[index] = await client.generate_result(
                    prompt=prompt,
                    images=[image_input(image) for image in images[index]],
                    max_tokens=5,
                    ignore_eos=True,
                )

            structured: list[GenerateResult] = []

            async def constrained() -> None:
                structured.append(
                    await client.generate_result(
                        input_ids=GRAMMAR_PROMPT, max_tokens=12, grammar=RegexGrammar(pattern=GRAMMAR_PATTERN)
                    )
                )

            async with trio.open_nursery() as nursery:
                for index in range(len(prompts)):
                    nursery.start_soon(one, index)
                nursery.start_soon(constrained)
            assert (await client.release()).released == 1
            await wait_states(client, {new: "Prefill", "prefill-0": "Prefill"})
            await wait_idle(client)
    for index, (prompt, _) in enumerate(prompts):
        expected = reference(tiny, prompt, images[index], 5)
        assert results[index].token_ids == expected, f"{prompt!r}"
        relay = results[index].relay
        assert relay is not None and (relay.new_prefill, relay.layer) == (new, 2)
        kinds = [t.kind for t in results[index].transfers]
        assert kinds.count("embedding") >= 1 and "relay" in kinds and kinds.count("kv") == 2
    (answer,) = structured
    grammar = SamplingParams(grammar=RegexGrammar(pattern=GRAMMAR_PATTERN))
    assert answer.token_ids == generate_in_one_piece(tiny, GRAMMAR_PROMPT, max_tokens=12, sampling=grammar)
    assert re.fullmatch(GRAMMAR_PATTERN, answer.text) and answer.finish_reason == "stop", answer.text
    assert answer.relay is not None and (answer.relay.new_prefill, answer.relay.layer) == (new, 2)
    assert transport in {t.transport for r in results.values() for t in r.transfers}
    # `python -m engine.logs timeline` draws the relays between the two lanes.
    picture = tmp_path / "timeline.png"
    assert logs_main(["timeline", str(node.log_file), "-o", str(picture), "--json"]) == 0
    timeline = msgspec.json.decode(capsys.readouterr().out, type=Timeline)
    assert {(r.new_prefill, r.old_prefill, r.layer) for r in timeline.relays} == {(new, "prefill-0", 2)}
    states = {lane.replica: [s.state for s in lane.segments] for lane in timeline.lanes}
    assert states[new][-4:] == ["LoadingPrefill", "NewPrefill", "RefractoryPrefill", "Prefill"]
    assert states["prefill-0"][-3:] == ["Prefill", "OldPrefill", "Prefill"]
