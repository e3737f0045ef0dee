"""The once-per-link handshake (architecture §5.1): the receiver says what its blocks look like; the sender
accepts or refuses with a reason a person can act on (`block_size mismatch: sender 128, receiver 64`)."""

from __future__ import annotations

from messages.layout import PoolLayout
from messages.transfer import PROTOCOL_VERSION, Hello


def hello(link_id: str, endpoint: str, layout: PoolLayout, address: str) -> Hello:
    return Hello(
        link_id=link_id, protocol_version=PROTOCOL_VERSION, endpoint=endpoint, layout=layout, address=address
    )


def refusal(hello: Hello, sender_layout: PoolLayout) -> str | None:
    """Why the sender refuses this receiver, naming both values; None to accept."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return f"protocol_version mismatch: sender {PROTOCOL_VERSION}, receiver {hello.protocol_version}"
    return sender_layout.mismatch(hello.layout)
