"""The cluster secret's challenge–response (docs/security.md), as pure functions over bytes.

Three messages open an authenticated link; the *dialer* is the side that connected:

    dialer   → listener   HELLO   magic, purpose, nonce_d (32 random bytes), the dialer's name
    listener → dialer     ANSWER  magic, nonce_l, the listener's name, mac_l
    dialer   → listener   PROOF   mac_d

`mac_l = HMAC-SHA256(secret, "listener" | transcript)` and `mac_d = HMAC-SHA256(secret, "dialer" |
transcript)`, the transcript being the purpose, both nonces and both names (length-prefixed). So each
side proves it holds the secret without sending it, a replayed message is useless (the other side's nonce
is fresh), a MAC made for one direction or purpose (`peer`, `transfer`) does not pass for another, and a
name cannot be swapped after the fact: the names are bound into both MACs. Both sides then derive the
link's session key, `HMAC-SHA256(secret, "session" | transcript)`, which keys the per-frame MACs
(`transport.auth.frames`).

Every parse checks sizes first and raises `AuthFailed` naming what was wrong; nothing here blocks or
touches a socket (`transport.auth.streams` does).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, final

MAGIC: Final = b"ZZA1"
NONCE_BYTES: Final = 32
MAC_BYTES: Final = 32
MAX_NAME_BYTES: Final = 64
MIN_SECRET_BYTES: Final = 16
PURPOSES: Final = ("peer", "transfer")
Purpose = Literal["peer", "transfer"]
# The longest message of the exchange (an ANSWER with the longest name): what a reader may take.
MAX_MESSAGE_BYTES: Final = len(MAGIC) + 1 + NONCE_BYTES + 1 + MAX_NAME_BYTES + MAC_BYTES


@final
class AuthFailed(Exception):
    """The other side did not prove it holds the secret, or sent bytes that are not this exchange."""


@final
@dataclass(frozen=True, slots=True)
class Hello:
    purpose: Purpose
    nonce: bytes
    name: str


@final
@dataclass(frozen=True, slots=True)
class Answer:
    nonce: bytes
    name: str
    mac: bytes


def _name_bytes(name: str) -> bytes:
    raw = name.encode()
    if not 0 < len(raw) <= MAX_NAME_BYTES:
        raise ValueError(f"a link name takes 1 to {MAX_NAME_BYTES} bytes, not {len(raw)}: {name!r}")
    return raw


def _transcript(purpose: Purpose, nonce_d: bytes, nonce_l: bytes, name_d: str, name_l: str) -> bytes:
    parts = [purpose.encode(), nonce_d, nonce_l, name_d.encode(), name_l.encode()]
    return b"".join(struct.pack(">B", len(part)) + part for part in parts)


def _mac(secret: bytes, label: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret, label + b"|" + transcript, hashlib.sha256).digest()


def new_hello(purpose: Purpose, name: str) -> Hello:
    return Hello(purpose=purpose, nonce=secrets.token_bytes(NONCE_BYTES), name=name)


def encode_hello(hello: Hello) -> bytes:
    name = _name_bytes(hello.name)
    return MAGIC + bytes([PURPOSES.index(hello.purpose)]) + hello.nonce + bytes([len(name)]) + name


def parse_hello(data: bytes) -> Hello:
    fixed = len(MAGIC) + 1 + NONCE_BYTES + 1
    if len(data) < fixed + 1 or data[: len(MAGIC)] != MAGIC:
        raise AuthFailed("the link did not open with this cluster's authentication (no hello)")
    purpose_index = data[len(MAGIC)]
    if purpose_index >= len(PURPOSES):
        raise AuthFailed(f"hello for an unknown purpose ({purpose_index})")
    nonce = data[len(MAGIC) + 1 : len(MAGIC) + 1 + NONCE_BYTES]
    name = _parse_name(data, fixed - 1, end=len(data))
    return Hello(purpose=PURPOSES[purpose_index], nonce=nonce, name=name)


def answer(secret: bytes, hello: Hello, name: str) -> tuple[Answer, bytes]:
    """The listener's ANSWER to `hello` and the link's session key."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    transcript = _transcript(hello.purpose, hello.nonce, nonce, hello.name, name)
    mac = _mac(secret, b"listener", transcript)
    return Answer(nonce=nonce, name=name, mac=mac), _mac(secret, b"session", transcript)


def encode_answer(reply: Answer) -> bytes:
    name = _name_bytes(reply.name)
    return MAGIC + reply.nonce + bytes([len(name)]) + name + reply.mac


def parse_answer(data: bytes) -> Answer:
    fixed = len(MAGIC) + NONCE_BYTES + 1
    if len(data) < fixed + 1 + MAC_BYTES or data[: len(MAGIC)] != MAGIC:
        raise AuthFailed("the other side did not answer with this cluster's authentication")
    nonce = data[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
    name = _parse_name(data, fixed - 1, end=len(data) - MAC_BYTES)
    return Answer(nonce=nonce, name=name, mac=data[len(data) - MAC_BYTES :])


def check_answer(secrets: Sequence[bytes], hello: Hello, reply: Answer) -> tuple[bytes, bytes]:
    """The dialer's check of the listener's `reply` to its `hello`: its PROOF and the session key, made
    with whichever of `secrets` the listener proved (a listener proves its first secret; a dialer accepts
    any of its own, which is how a secret is rotated without a stop: docs/security.md). Raises
    `AuthFailed` when the listener holds none of them."""
    transcript = _transcript(hello.purpose, hello.nonce, reply.nonce, hello.name, reply.name)
    for secret in secrets:
        if hmac.compare_digest(reply.mac, _mac(secret, b"listener", transcript)):
            return _mac(secret, b"dialer", transcript), _mac(secret, b"session", transcript)
    raise AuthFailed(f"{reply.name!r} did not prove the cluster secret (the secrets differ)")


def check_proof(secret: bytes, hello: Hello, reply: Answer, proof: bytes) -> None:
    """The listener's check of the dialer's PROOF; raises `AuthFailed`."""
    transcript = _transcript(hello.purpose, hello.nonce, reply.nonce, hello.name, reply.name)
    if len(proof) != MAC_BYTES or not hmac.compare_digest(proof, _mac(secret, b"dialer", transcript)):
        raise AuthFailed(f"{hello.name!r} did not prove the cluster secret (the secrets differ)")


def _parse_name(data: bytes, at: int, *, end: int) -> str:
    length = data[at]
    raw = data[at + 1 : end]
    if length == 0 or length > MAX_NAME_BYTES or len(raw) != length:
        raise AuthFailed(f"malformed authentication message ({len(data)} bytes)")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise AuthFailed("malformed authentication message (a name that is not UTF-8)") from None
