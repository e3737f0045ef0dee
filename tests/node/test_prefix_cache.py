"""The prefix cache through a real node (docs/prefix-cache.md): outputs stay token-identical to the model
run in one piece with the cache cold, hot and partly evicted, greedy and seeded, text and images; a
request that needs the whole pool evicts cached blocks instead of being refused; the result, the
`prefill_started` events and `status` show what came from the cache.

Pool of 24 KV blocks of 16 tokens on the one prefill replica, so the eviction is exact: LRU, leaves first.
"""

from __future__ import annotations

import random
from pathlib import Path

from engine.client import ControlClient
from messages.control_replies import GenerateResult
from replicas.model import ByteTokenizer, Model, encode_prompt
from tests.epd.images import image_input, image_with_rows, reference
from tests.node.harness import by_name, default_transport, node_process, wait_idle, wait_serving, wait_states
from tests.node.workload import Ask, check_outcome, send
from tests.waiting import deadline

BLOCK = 16
POOL = 24


def _ids(rng: random.Random, model: Model, count: int) -> tuple[int, ...]:
    vocabulary = [i for i in range(model.config.vocab_size) if i != model.config.image_token_id]
    return tuple(rng.choice(vocabulary) for _ in range(count))


async def test_text_prompts_cold_hot_and_partly_evicted(tmp_path: Path, tiny: Model) -> None:
    rng = random.Random(5)
    base = _ids(rng, tiny, 70)  # 4 full blocks and 6 tokens
    longer = base + _ids(rng, tiny, 20)  # 5 full blocks and 10 tokens
    crowd = _ids(rng, tiny, 360)  # 23 blocks of a pool of 24: only fits by evicting
    steps = [
        ("cold", Ask(input_ids=base, max_tokens=6, ignore_eos=True), 0),
        ("hot, seeded", Ask(input_ids=longer, max_tokens=6, temperature=0.8, seed=7, ignore_eos=True), 64),
        ("the same prompt again", Ask(input_ids=base, max_tokens=6, ignore_eos=True, stream=True), 64),
        # Needs 23 blocks: 19 are free, the 5 cached go as needed, leaves first (the longer prompt's
        # fifth, then the base's fourth, third and second): the base's first block stays.
        ("the pool's worth", Ask(input_ids=crowd, max_tokens=4, ignore_eos=True), 0),
        ("partly evicted, seeded", Ask(input_ids=(*base, 5, 6), max_tokens=6, temperature=0.9, seed=3), 16),
    ]
    options = ("--replicas", "prefill=1,decode=1", "--kv-pool-blocks", str(POOL))
    with node_process(tmp_path, *options) as node:
        async with node.client() as client:
            await wait_serving(client)
            for what, ask, cached in steps:
                outcome = await send(client, ask)
                await wait_idle(client)
                assert check_outcome(tiny, outcome, transport=default_transport()) == [], what
                assert outcome.result.cached_tokens == cached, what
            status = await client.status()
        started = {e["request_id"]: e for e in node.events("prefill_started")}
    prefill = by_name(status)["prefill-0"]
    assert prefill.prefix_blocks == 1 + 22  # the base's first block, and the crowd's 22 full blocks
    assert prefill.used_blocks == 0  # cached blocks no request holds count as free
    assert [e["cached_tokens"] for e in started.values()] == [cached for _, _, cached in steps]


async def _image(client: ControlClient, prompt: str, image_seed: int) -> GenerateResult:
    with deadline(f"the reply to {prompt!r}", 60):
        return await client.generate_result(
            prompt=prompt,
            images=[image_input(image_with_rows(40, image_seed))],
            max_tokens=5,
            ignore_eos=True,
        )


async def test_an_image_changes_the_key_from_its_block_on(tmp_path: Path, tiny: Model) -> None:
    prompt = "a shared text prefix of forty-odd bytes: <image> what is it?"
    prompt_ids = encode_prompt(ByteTokenizer(), prompt, 1, tiny.config.image_token_id)
    before_image = prompt_ids.index(tiny.config.image_token_id) // BLOCK * BLOCK
    expanded = len(prompt_ids) - 1 + 40
    with node_process(tmp_path, "--replicas", "encode=1,prefill=1,decode=1") as node:
        async with node.client() as client:
            await wait_serving(client)
            cold = await _image(client, prompt, 1)
            hot = await _image(client, prompt, 1)
            other = await _image(client, prompt, 2)
            await wait_idle(client)
            status = await client.status()
    assert by_name(status)["decode-0"].prefix_blocks == 0  # it has no image digests: it keeps nothing
    assert cold.cached_tokens == 0
    assert hot.cached_tokens == (expanded - 1) // BLOCK * BLOCK  # all its full blocks but the last token's
    assert other.cached_tokens == before_image  # the blocks before the image's rows only
    image = [image_with_rows(40, 1)]
    assert cold.token_ids == hot.token_ids == reference(tiny, prompt, image, 5)
    assert other.token_ids == reference(tiny, prompt, [image_with_rows(40, 2)], 5)


async def test_cache_off(tmp_path: Path, tiny: Model) -> None:
    ask = Ask(input_ids=tuple(range(3, 60)), max_tokens=3, ignore_eos=True)
    with node_process(tmp_path, "--replicas", "prefill=1,decode=1", "--prefix-cache", "off") as node:
        async with node.client() as client:
            await wait_serving(client)
            first, second = await send(client, ask), await send(client, ask)
            await wait_idle(client)
            status = await client.status()
    assert (first.result.cached_tokens, second.result.cached_tokens) == (0, 0)
    assert check_outcome(tiny, second, transport=default_transport()) == []
    assert by_name(status)["prefill-0"].prefix_blocks == 0
    assert by_name(status)["decode-0"].prefix_blocks == 0  # a finished turn is not kept either


async def test_the_router_sends_a_prompt_to_the_replica_holding_its_prefix(
    tmp_path: Path, tiny: Model
) -> None:
    """prefill-1 alone computes a prompt (prefill-0 shut meanwhile); once both serve, the prompt's next
    turn goes to prefill-1, which holds its blocks — on a tie the router picks prefill-0, as a new
    prompt shows."""
    rng = random.Random(9)
    first = Ask(input_ids=_ids(rng, tiny, 80), max_tokens=3, ignore_eos=True)
    assert first.input_ids is not None
    follow_up = Ask(input_ids=(*first.input_ids, *_ids(rng, tiny, 20)), max_tokens=3, ignore_eos=True)
    fresh = Ask(input_ids=_ids(rng, tiny, 80), max_tokens=3, ignore_eos=True)
    with node_process(tmp_path, "--replicas", "prefill=2,decode=1") as node:
        async with node.client() as client:
            await wait_serving(client)
            with deadline("prefill-0 shut", 30):
                await client.transition("prefill-0", "ShuttingPrefill")
                await wait_states(client, {"prefill-0": "ShuttingNull"})
            alone = await send(client, first)
            with deadline("prefill-0 serving again", 30):
                await client.transition("prefill-0", "AusPrefill")
                await wait_states(client, {"prefill-0": "Prefill"})
            routed = await send(client, follow_up)
            other = await send(client, fresh)
            await wait_idle(client)
        where = {e["request_id"]: e["replica"] for e in node.events("prefill_started")}
    assert where[alone.result.request_id] == "prefill-1"
    assert where[routed.result.request_id] == "prefill-1"
    assert routed.result.cached_tokens == 80 // BLOCK * BLOCK
    assert where[other.result.request_id] == "prefill-0"
    for outcome in (alone, routed, other):
        assert check_outcome(tiny, outcome, transport=default_transport()) == []


async def test_chunked_prefill_starts_after_the_cached_prefix(tmp_path: Path, tiny: Model) -> None:
    """Chunks of 24 tokens (across the 16-token blocks): a hot prompt's first chunk starts after its
    borrowed blocks; a prompt asking for its log-probabilities borrows nothing (every prompt token must
    run); both give the model's tokens."""
    rng = random.Random(13)
    base = _ids(rng, tiny, 70)
    cold = Ask(input_ids=base, max_tokens=4, ignore_eos=True)
    hot = Ask(input_ids=(*base, *_ids(rng, tiny, 30)), max_tokens=4, temperature=0.7, seed=2, ignore_eos=True)
    options = ("--replicas", "prefill=1,decode=1", "--prefill-chunk-tokens", "24")
    with node_process(tmp_path, *options) as node:
        async with node.client() as client:
            await wait_serving(client)
            first, second = await send(client, cold), await send(client, hot)
            with deadline("a prompt with its log-probabilities", 60):
                scored = await client.generate_result(
                    input_ids=base, max_tokens=2, ignore_eos=True, prompt_logprobs=1
                )
            await wait_idle(client)
    assert (first.result.cached_tokens, second.result.cached_tokens, scored.cached_tokens) == (0, 64, 0)
    assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(base)
    for outcome in (first, second):
        assert check_outcome(tiny, outcome, transport=default_transport()) == []
