"""`python -m engine.node --demo`: serve, run a mixed workload through the socket, check, report, exit.

The workload mixes prompt lengths, greedy and seeded sampling, streamed and whole results, and — on a
model with a vision encoder — image requests (docs/epd.md), some of whose embeddings need more than the
default 1024-token grant (a 512×640 image is 1280 rows: a REQUEST_MORE_CACHE round), all sent
concurrently by a real client over the node's control socket. Each output is compared with the model
run in one piece (`engine.verify.compare`: same weights, one sequence, no disaggregation). Exit code 0
only when every output matched, no request failed and no block leaked.

With `--nodes N` (2 or more, no `--cluster`) the replicas run in N node processes of one cluster on a
local etcd, this process as node-0 (`engine.cluster.demo`); the report adds one line per node.
"""

from __future__ import annotations

import gc
import random
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Protocol, TextIO

import numpy as np
import trio

from engine.client import ControlClient, ControlError
from engine.client.cluster import node_lines, shutdown_cluster, wait_serving
from engine.config import NodeConfig
from engine.config.address import Address
from engine.generate.served import ServedModel
from engine.verify import compare
from messages.control import ImageInput
from messages.control_replies import GenerateResult, TokenReply
from replicas.model import Model, SamplingParams, encode_prompt
from replicas.weights import ModelHost


class Node(Protocol):
    """The node the demo runs (`engine.node.Node`): its config, model host and served model, whether it
    is one of a cluster, `serve` (until shut down; returns the exit code), and `release_replicas` (after
    it stopped: their pools' memory goes)."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def host(self) -> ModelHost: ...

    @property
    def served(self) -> ServedModel: ...

    def release_replicas(self) -> None: ...

    @property
    def clustered(self) -> bool: ...

    async def serve(self, *, task_status: trio.TaskStatus[Address] = ...) -> int: ...


WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "zigzag",
    "moves",
    "blocks",
    "between",
    "replicas",
]


# Asked first, chat-templated, on a model with a chat template of its own (say `--model smollm2`).
QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Write one sentence about the sea.",
)


def chat_questions(node: Node) -> list[DemoRequest]:
    template = node.served.chat_template
    if template is None or node.host.name == "tiny":
        return []
    return [
        DemoRequest(
            prompt=template.render([{"role": "user", "content": question}], add_generation_prompt=True),
            max_tokens=40,
            temperature=0.0,
            seed=0,
            stream=True,
            question=question,
            add_special_tokens=False,
        )
        for question in QUESTIONS
    ]


# (width, height) of the demo's images: 256, 400 and 1280 embedding rows (16×16 patches); the last needs
# more than the default grant of 1024 rows, so its embeddings arrive in two rounds.
IMAGE_SIZES = ((256, 256), (320, 320), (512, 640))


@dataclass(frozen=True, slots=True)
class DemoRequest:
    prompt: str
    max_tokens: int
    temperature: float
    seed: int
    stream: bool
    images: tuple[np.ndarray, ...] = ()
    question: str | None = None  # a chat question (the prompt is it, chat-templated)
    add_special_tokens: bool = True


def demo_workload(count: int, seed: int = 7, *, images: bool = False) -> list[DemoRequest]:
    """`count` requests; with `images`, every third carries one or two images (`<image>` placeholders
    in the text, or none: the images go first)."""
    rng = random.Random(seed)
    pixels = np.random.default_rng(seed)
    workload = []
    for index in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 160)))
        pictures: tuple[np.ndarray, ...] = ()
        if images and index % 3 == 1:
            sizes = [IMAGE_SIZES[(index // 3) % len(IMAGE_SIZES)]]
            if index % 9 == 4:
                sizes.append(IMAGE_SIZES[2])
            pictures = tuple(pixels.integers(0, 256, (h, w, 3), dtype=np.uint8) for w, h in sizes)
            if index % 2:
                text = " <image> ".join([text, *["and then"] * len(pictures)])
        workload.append(
            DemoRequest(
                prompt=text,
                max_tokens=rng.randint(4, 40),
                temperature=0.0 if index % 3 else 0.8,
                seed=1000 + index,
                stream=index % 2 == 0,
                images=pictures,
            )
        )
    return workload


async def run_demo(node: Node, *, requests: int = 24, out: TextIO | None = None) -> int:
    """Run the demo against `node` (not yet serving); returns the process exit code."""
    import sys

    out = out or sys.stdout
    node_code = 1
    results: dict[int, GenerateResult | ControlError] = {}
    workload = chat_questions(node) + demo_workload(
        requests, images=node.host.config.image_token_id is not None
    )

    async def serve(task_status: trio.TaskStatus[Address]) -> None:
        nonlocal node_code
        node_code = await node.serve(task_status=task_status)

    async with trio.open_nursery() as nursery:
        address = await nursery.start(serve)
        print(
            f"demo: node listening on {address} ({node.config.transport} transport), model {node.host.name}",
            file=out,
        )
        reference_model = await node.host.acquire("demo-reference")
        async with ControlClient.connect(address) as client:
            if node.clustered:  # in a cluster: every node's replicas serve first
                await wait_serving(client, node.config.cluster.nodes)
            with trio.fail_after(600):
                async with trio.open_nursery() as clients:
                    for index, item in enumerate(workload):
                        clients.start_soon(_one, client, index, item, results)
                status = await client.status()
                await (client.shutdown() if not node.clustered else shutdown_cluster(client))
    states = ", ".join(
        f"{r.name} ({r.state}{'' if r.executor is None else ', ' + r.executor})" for r in status.replicas
    )
    print(f"demo: replicas {states}", file=out)
    fallbacks = [f"{r.name}: {reason}" for r in status.replicas for reason in r.executor_fallbacks]
    for line in fallbacks:
        print(f"demo: an executor fell back: {line}", file=out)
    if node.clustered:
        print(*node_lines(status), sep="\n", file=out)
    node.release_replicas()  # their KV pools are not needed to check the outputs
    gc.collect()
    matched = await trio.to_thread.run_sync(_verify, reference_model, node, workload, results)
    node.host.release("demo-reference")
    failed = [r for r in results.values() if isinstance(r, ControlError)]
    done = [r for r in results.values() if isinstance(r, GenerateResult)]
    _answers(out, workload, results)
    _report(out, workload, done, failed)
    print(f"demo: outputs identical to the model run in one piece: {matched}/{len(workload)}", file=out)
    print(f"demo: failed requests: {len(failed)}; node exit code {node_code} (1 = leaked blocks)", file=out)
    return 0 if matched == len(workload) and not failed and node_code == 0 and not fallbacks else 1


async def _one(
    client: ControlClient, index: int, item: DemoRequest, results: dict[int, GenerateResult | ControlError]
) -> None:
    try:
        async for reply in client.generate(
            prompt=item.prompt,
            max_tokens=item.max_tokens,
            temperature=item.temperature,
            seed=item.seed,
            stream=item.stream,
            add_special_tokens=item.add_special_tokens,
            images=[ImageInput(width=i.shape[1], height=i.shape[0], pixels=i.tobytes()) for i in item.images],
        ):
            if isinstance(reply, GenerateResult):
                results[index] = reply
            else:
                assert isinstance(reply, TokenReply)
    except ControlError as exc:
        results[index] = exc


def _verify(
    model: Model, node: Node, workload: list[DemoRequest], results: dict[int, GenerateResult | ControlError]
) -> int:
    tokenizer = node.host.tokenizer
    assert tokenizer is not None
    matched = 0
    for index, item in enumerate(workload):
        result = results.get(index)
        if not isinstance(result, GenerateResult):
            continue
        prompt_ids = encode_prompt(
            tokenizer,
            item.prompt,
            len(item.images),
            model.config.image_token_id,
            add_special_tokens=item.add_special_tokens,
        )
        sampling = SamplingParams(temperature=item.temperature, seed=item.seed)
        verdict = compare(
            model,
            prompt_ids,
            result.token_ids,
            sampling=sampling,
            max_tokens=item.max_tokens,
            images=item.images,
        )
        matched += verdict.accepted
    return matched


def _report(
    out: TextIO, workload: list[DemoRequest], done: list[GenerateResult], failed: list[ControlError]
) -> None:
    sampled = sum(1 for item in workload if item.temperature > 0)
    streamed = sum(1 for item in workload if item.stream)
    with_images = sum(1 for item in workload if item.images)
    pictures = sum(len(item.images) for item in workload)
    tokens = sum(len(r.token_ids) for r in done)
    print(
        f"demo: {len(workload)} requests ({len(workload) - sampled} greedy, {sampled} sampled; {streamed} streamed; "
        f"{with_images} with {pictures} images), {tokens} tokens generated",
        file=out,
    )

    def pct(values: list[float], q: float) -> str:
        if not values:
            return "-"
        ordered = sorted(values)
        return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.1f} ms"

    ttft = [r.timings.ttft_s for r in done if r.timings.ttft_s is not None]
    tpot = [r.timings.tpot_s for r in done if r.timings.tpot_s is not None]
    e2e = [r.timings.e2e_s for r in done if r.timings.e2e_s is not None]
    print(
        f"demo: TTFT p50 {pct(ttft, 0.5)} p90 {pct(ttft, 0.9)}; TPOT p50 {pct(tpot, 0.5)}; "
        f"end to end p50 {pct(e2e, 0.5)}",
        file=out,
    )
    transfers = [t for r in done for t in r.transfers]
    for kind in ("embedding", "kv"):
        of_kind = [t for t in transfers if t.kind == kind]
        if of_kind:
            rounds = Counter(t.rounds for t in of_kind)
            histogram = ", ".join(f"{n} round{'s' if n != 1 else ''}: {c}" for n, c in sorted(rounds.items()))
            mean_ms = statistics.fmean(t.seconds for t in of_kind) * 1000
            print(
                f"demo: {kind} transfers: {len(of_kind)} ({histogram}), "
                f"{sum(t.bytes for t in of_kind) / 1e6:.1f} MB, mean {mean_ms:.2f} ms",
                file=out,
            )
    for error in failed:
        print(f"demo: failed: {error.code}: {error}", file=out)


def _answers(
    out: TextIO, workload: list[DemoRequest], results: dict[int, GenerateResult | ControlError]
) -> None:
    for index, item in enumerate(workload):
        result = results.get(index)
        if item.question is not None and isinstance(result, GenerateResult):
            print(f"demo: Q: {item.question}\ndemo: A: {result.text.strip()}", file=out)
