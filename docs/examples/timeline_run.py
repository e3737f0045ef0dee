"""Drive a real node through its socket to produce the example log of docs/logs.md.

    python -m engine.node --listen 127.0.0.1:7399 --replicas encode=1,prefill=2,decode=2 \
        --log-file /tmp/node.jsonl --no-log-console &
    python docs/examples/timeline_run.py 127.0.0.1:7399
    python -m engine.logs timeline /tmp/node.jsonl -o docs/img/timeline-example.png

Text and image requests run while decode-1 is locked and unlocked, prefill-1 becomes a decode replica
(MutatingToDecode), and decode-0 is shut down and revived; then the node shuts down.
"""

from __future__ import annotations

import random
import sys

import trio

from engine.client import ControlClient
from messages.control import ImageInput


def image(width: int, height: int, seed: int) -> ImageInput:
    rng = random.Random(seed)
    pixels = bytes(rng.randrange(256) for _ in range(width * height * 3))
    return ImageInput(width=width, height=height, pixels=pixels)


async def main(address: str) -> None:
    async with ControlClient.connect(address) as client:

        async def generate(index: int) -> None:
            images = [image(256, 320, index)] if index % 3 == 0 else []
            prompt = ("describe <image> " if images else "") + "zigzag moves blocks " * (index % 7 + 1)
            await client.generate_result(prompt=prompt, images=images, max_tokens=24 + index % 17)

        async def wave(start: int, count: int) -> None:
            async with trio.open_nursery() as nursery:
                for index in range(start, start + count):
                    nursery.start_soon(generate, index)
                    await trio.sleep(0.02)

        await wave(0, 12)
        await client.lock("decode-1")
        await wave(12, 8)
        await client.unlock("decode-1")
        await client.transition("prefill-1", "MutatingToDecode")
        await wave(20, 10)
        await client.transition("decode-0", "ShuttingDecode")
        await wave(30, 8)
        await client.transition("decode-0", "AusDecode")
        await wave(38, 10)
        await client.shutdown()


if __name__ == "__main__":
    trio.run(main, sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:7399")
