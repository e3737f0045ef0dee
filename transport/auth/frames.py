"""A MAC on every frame of an authenticated link (docs/security.md).

After the challenge–response (`transport.auth.challenge`) each side holds the link's session key. The
sender appends `TAG_BYTES` of `HMAC-SHA256(key, direction | sequence | body)` to each frame; the receiver
recomputes it. The sequence number is implicit — both sides count the frames of their direction from 0 —
so a frame replayed, dropped, reordered or copied from the other direction fails its check, as does any
changed byte. A link whose frame fails closes (`AuthFailed`).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Final, Literal, final

from transport.auth.challenge import AuthFailed

TAG_BYTES: Final = 16
Direction = Literal["dialer", "listener"]  # who sends the frames
_SEQUENCE = struct.Struct(">Q")


def _tag(key: bytes, direction: Direction, sequence: int, body: bytes | memoryview) -> bytes:
    mac = hmac.new(key, direction.encode() + _SEQUENCE.pack(sequence), hashlib.sha256)
    mac.update(body)
    return mac.digest()[:TAG_BYTES]


@final
class FrameSealer:
    """Tags the frames one side sends (in order)."""

    def __init__(self, key: bytes, direction: Direction) -> None:
        self._key, self._direction, self._sequence = key, direction, 0

    def seal(self, body: bytes) -> bytes:
        tag = _tag(self._key, self._direction, self._sequence, body)
        self._sequence += 1
        return tag


@final
class FrameOpener:
    """Checks the tags of the frames one side receives (in order); raises `AuthFailed`."""

    def __init__(self, key: bytes, direction: Direction) -> None:
        self._key, self._direction, self._sequence = key, direction, 0

    def check(self, body: bytes | memoryview, tag: bytes | memoryview) -> None:
        expected = _tag(self._key, self._direction, self._sequence, body)
        if not hmac.compare_digest(expected, bytes(tag)):
            raise AuthFailed(
                f"frame {self._sequence} of the link fails its MAC (changed, replayed or forged)"
            )
        self._sequence += 1
