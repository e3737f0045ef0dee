"""Requests for the end-to-end tests, sent through a `ControlClient`, and their checks against the model.

`mixed_workload` makes prompts of many lengths (block boundaries included), as text or token ids,
greedy or seeded sampling, some with vLLM's penalties and a logit bias, streamed or not. `send_all` runs them concurrently on one connection and
keeps what was streamed. `check_outcome` holds a result to the model run in one piece
(`engine.verify.compare`: token identity, a divergence forgiven only past a genuine greedy tie), to
the streamed replies, and to the KV transfer the request must show.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from engine.client import ControlClient
from engine.verify import compare
from messages.control_replies import GenerateResult, TokenReply
from replicas.model import Model, SamplingParams, encode_prompt, finish_reason
from tests.node.harness import NodeProcess, wait_idle, wait_serving
from tests.waiting import deadline

WORDS = ("hello", "world", "the", "cat", "sat", "on", "mat", "zig", "zag")
# Prompt lengths around the 16-token KV block (1, 15, 16, 17, 31, 32, 33) and some long ones.
LENGTHS = (1, 2, 5, 15, 16, 17, 31, 32, 33, 48, 64, 100, 130)
REQUEST_TIMEOUT = 120.0
KV_BLOCK = 16  # the node's default --kv-block-size


@dataclass(frozen=True, slots=True)
class Ask:
    """One generate: exactly one of `prompt` and `input_ids`."""

    prompt: str | None = None
    input_ids: tuple[int, ...] | None = None
    max_tokens: int = 4
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed or 0,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
        )

    def prompt_ids(self, model: Model) -> list[int]:
        if self.input_ids is not None:
            return list(self.input_ids)
        assert self.prompt is not None and model.tokenizer is not None
        return encode_prompt(model.tokenizer, self.prompt, 0, model.config.image_token_id)


@dataclass(slots=True)
class Outcome:
    ask: Ask
    result: GenerateResult
    streamed: list[TokenReply] = field(default_factory=list)


def mixed_workload(model: Model, count: int, *, text: bool, seed: int = 11) -> list[Ask]:
    """`count` requests of mixed lengths; about a third sampled with a seed, half streamed.

    `text`: every other request is a `prompt` (the tiny model's byte tokenizer or the test checkpoint's
    word tokenizer); the others send `input_ids` drawn from the whole vocabulary but the image marker.
    """
    rng = random.Random(seed)
    vocabulary = [i for i in range(model.config.vocab_size) if i != model.config.image_token_id]
    asks = []
    for index in range(count):
        length = LENGTHS[index % len(LENGTHS)]
        sampled = index % 3 == 2
        common = dict(
            max_tokens=rng.choice((1, 2, 3, 5, 8, 12)),
            temperature=0.8 if sampled else 0.0,
            top_p=0.9 if sampled else 1.0,
            seed=1000 + index if sampled else None,
            ignore_eos=index % 4 == 0,
            stream=index % 2 == 0,
        )
        if index % 6 in (1, 5):  # one greedy, one sampled in every six (drawing nothing from `rng`)
            common.update(
                repetition_penalty=1.3,
                presence_penalty=0.5,
                frequency_penalty=0.25,
                logit_bias=((vocabulary[(37 * index) % len(vocabulary)], 2.0),),
            )
        if text and index % 2:
            words = " ".join(rng.choice(WORDS) for _ in range(max(1, length // 2)))
            asks.append(Ask(prompt=words, **common))  # type: ignore[arg-type]
        else:
            ids = tuple(rng.choice(vocabulary) for _ in range(length))
            asks.append(Ask(input_ids=ids, **common))  # type: ignore[arg-type]
    return asks


async def send(client: ControlClient, ask: Ask, *, request_id: str | None = None) -> Outcome:
    """Send one generate and collect its streamed replies and result (ControlError on an error)."""
    streamed: list[TokenReply] = []
    with deadline(f"every reply to generate {request_id or ''} of {ask.max_tokens} tokens", REQUEST_TIMEOUT):
        async for reply in client.generate(
            prompt=ask.prompt,
            input_ids=ask.input_ids,
            max_tokens=ask.max_tokens,
            temperature=ask.temperature,
            top_p=ask.top_p,
            seed=ask.seed,
            ignore_eos=ask.ignore_eos,
            stream=ask.stream,
            request_id=request_id,
            presence_penalty=ask.presence_penalty,
            frequency_penalty=ask.frequency_penalty,
            repetition_penalty=ask.repetition_penalty,
            logit_bias=dict(ask.logit_bias),
        ):
            if isinstance(reply, TokenReply):
                streamed.append(reply)
            else:
                return Outcome(ask, reply, streamed)
    raise AssertionError("generate ended without a result")


async def send_all(client: ControlClient, asks: Sequence[Ask]) -> list[Outcome]:
    """Send every ask at once on `client`; outcomes in the asks' order."""
    outcomes: dict[int, Outcome] = {}

    async def one(index: int) -> None:
        outcomes[index] = await send(client, asks[index])

    async with trio.open_nursery() as nursery:
        for index in range(len(asks)):
            nursery.start_soon(one, index)
    return [outcomes[index] for index in range(len(asks))]


def kv_bytes_per_token(model: Model) -> int:
    """layers × 2 (K and V) × kv_heads × head_dim × dtype size."""
    config = model.config
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[config.dtype]
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """The reference runs one sequence at a time: one thread is as fast, and much faster than two on a
    machine whose cores are busy with the node (and other test workers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def check_outcome(model: Model, outcome: Outcome, *, transport: str, kv_moves: bool = True) -> list[str]:
    """Everything wrong with `outcome` (empty when it is right); see the module docstring.

    `kv_moves=False`: the request decoded where it was prefilled (Flush), so it shows no transfer."""
    ask, result = outcome.ask, outcome.result
    problems = []
    prompt_ids = ask.prompt_ids(model)
    with one_torch_thread():
        verdict = compare(
            model, prompt_ids, result.token_ids, sampling=ask.sampling(), max_tokens=ask.max_tokens
        )
    if not verdict.accepted:
        problems.append(
            f"tokens {result.token_ids} differ from the model run in one piece {verdict.reference} "
            f"at {verdict.first_difference} (no tie)"
        )
    if result.prompt_tokens != len(prompt_ids):
        problems.append(f"prompt_tokens {result.prompt_tokens}, expected {len(prompt_ids)}")
    if model.tokenizer is not None and result.text != model.tokenizer.decode(result.token_ids):
        problems.append(f"text {result.text!r} is not the decoded tokens")
    expected_reason = finish_reason(result.token_ids, ask.sampling(), model.eos_token_ids, ask.max_tokens)
    if result.finish_reason != expected_reason:
        problems.append(f"finish_reason {result.finish_reason}, expected {expected_reason}")
    if ask.stream:
        streamed = [token for reply in outcome.streamed for token in reply.token_ids]
        if streamed != result.token_ids:
            problems.append(f"streamed tokens {streamed} differ from the result's")
        if "".join(reply.text for reply in outcome.streamed) != result.text:
            problems.append("streamed text differs from the result's")
        indices = [reply.index for reply in outcome.streamed]
        expected = [sum(len(r.token_ids) for r in outcome.streamed[:i]) for i in range(len(outcome.streamed))]
        if indices != expected:
            problems.append(f"streamed indices {indices}, expected {expected}")
    elif outcome.streamed:
        problems.append("token replies for a request that did not ask to stream")
    if kv_moves:
        problems += check_kv_transfer(model, outcome, len(prompt_ids), transport=transport)
    elif result.transfers:
        problems.append(f"decoded where it was prefilled, yet shows transfers {result.transfers}")
    return [f"{result.request_id} ({ask}): {problem}" for problem in problems]


def check_kv_transfer(model: Model, outcome: Outcome, prompt_tokens: int, *, transport: str) -> list[str]:
    """A request that decoded shows one `kv` transfer of exactly its prompt's KV; one that ended at its
    first token (max_tokens 1, or EOS) finished on the prefill replica and moved nothing."""
    result = outcome.result
    kv = [t for t in result.transfers if t.kind == "kv"]
    if len(result.token_ids) <= 1:
        return [] if not kv else [f"finished at the first token but has KV transfers {kv}"]
    layers = model.config.num_layers
    relay = result.relay
    if relay is not None and relay.layer == layers:  # relayed after every layer: all KV from NewPrefill
        if [(t.layers, t.source) for t in kv] != [([0, layers], relay.new_prefill)]:
            return [f"expected all KV from {relay.new_prefill}, got {result.transfers}"]
    elif relay is not None and relay.layer > 0:  # ZigZag: two halves, [0, n) and [n, L)
        expected_halves = [([0, relay.layer], relay.new_prefill), ([relay.layer, layers], relay.old_prefill)]
        got = [(t.layers, t.source) for t in kv]
        if got != expected_halves:
            return [f"expected the KV halves {expected_halves}, got {got}"]
    elif len(kv) != 1:
        return [f"expected one kv transfer, got {result.transfers}"]
    elif kv[0].layers != [0, layers]:
        return [f"kv transfer layers {kv[0].layers}, expected [0, {layers}]"]
    problems = []
    per_layer = kv_bytes_per_token(model) * prompt_tokens // layers
    for transfer in kv:
        assert transfer.layers is not None
        expected = per_layer * (transfer.layers[1] - transfer.layers[0])
        if transfer.bytes != expected:
            problems.append(f"kv transfer carried {transfer.bytes} bytes, expected {expected}")
        if transfer.source == transfer.destination:
            problems.append(f"kv transfer from {transfer.source} to itself")
        if transfer.rounds < 1 or transfer.transport != transport:
            problems.append(f"kv transfer rounds {transfer.rounds}, transport {transfer.transport}")
    return problems


def distinct_asks(count: int, *, max_tokens: int, offset: int = 0) -> list[Ask]:
    """`count` greedy requests with distinct prompts of 20 + i tokens (ids below the byte range's top)."""
    return [
        Ask(
            input_ids=tuple((7 * (offset + i) + j) % 250 + 1 for j in range(20 + i)),
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        for i in range(count)
    ]


def reserved_blocks(ask: Ask) -> int:
    """The blocks a decode replica reserves for `ask`: prompt + max_tokens - 1 tokens (docs/serving.md)."""
    assert ask.input_ids is not None
    return -(-(len(ask.input_ids) + ask.max_tokens - 1) // KV_BLOCK)


def launch(nursery: trio.Nursery, client: ControlClient, batch: Sequence[Ask], into: list[Outcome]) -> None:
    """Send each of `batch` in its own task of `nursery`; outcomes are appended to `into` as they end."""

    async def one(ask: Ask) -> None:
        into.append(await send(client, ask))

    for ask in batch:
        nursery.start_soon(one, ask)


def assert_correct(
    model: Model, outcomes: Sequence[Outcome], *, transport: str = "tcp", kv_moves: bool = True
) -> None:
    """Every outcome passes `check_outcome` (all problems listed in the failure)."""
    problems = [
        p
        for outcome in outcomes
        for p in check_outcome(model, outcome, transport=transport, kv_moves=kv_moves)
    ]
    assert not problems, "\n".join(problems)


def assert_model_tokens(model: Model, ask: Ask, token_ids: Sequence[int]) -> None:
    """`token_ids` are what the model run in one piece makes for `ask`'s first len(token_ids) tokens
    (for a request that was cancelled part-way)."""
    with one_torch_thread():
        verdict = compare(
            model, ask.prompt_ids(model), token_ids, sampling=ask.sampling(), max_tokens=len(token_ids)
        )
    assert verdict.accepted, verdict


def names_request(request_id: str, event: dict[str, Any]) -> bool:
    return bool(event["request_id"] == request_id)


async def still_serving(node: NodeProcess, model: Model, *, offset: int, transport: str = "inproc") -> None:
    """The node serves a request correctly, then every replica is idle with no block held."""
    async with node.client() as client:
        await wait_serving(client)
        outcome = await send(client, distinct_asks(1, max_tokens=3, offset=offset)[0])
        assert_correct(model, [outcome], transport=transport)
        await wait_idle(client)
