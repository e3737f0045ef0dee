"""Splitting a byte stream into lines, in time linear in the bytes received, with a maximum line length."""

from __future__ import annotations

from typing import final

import trio

RECEIVE_BYTES = 256 * 1024


@final
class LineTooLong(Exception):
    """A line (or the unterminated tail of the stream) exceeds the limit; the stream cannot be resynchronised."""

    def __init__(self, limit: int, seen: int, *, terminated: bool = False) -> None:
        found = f"{seen} bytes before its newline" if terminated else f"read {seen} bytes without a newline"
        super().__init__(f"line longer than {limit} bytes ({found})")
        self.limit = limit
        self.seen = seen


@final
class LineReader:
    """Reads ``\\n``-terminated lines (a trailing ``\\r`` is dropped) of at most `max_line_bytes` bytes
    (terminator excluded).

    Each received byte is scanned for the newline once and copied at most twice (into the buffer, out
    as the line), so a 64 MiB line costs O(n), not O(n²). Not safe for concurrent readers.
    """

    def __init__(self, stream: trio.abc.ReceiveStream, max_line_bytes: int) -> None:
        self._stream = stream
        self._max = max_line_bytes
        self._buffer = bytearray()
        self._start = 0  # first byte of the next line
        self._scanned = 0  # bytes before this index hold no newline after _start

    async def next_line(self, limit: int | None = None) -> bytes | None:
        """The next line without its terminator; None at end of stream. `limit`: a smaller maximum for
        this line only (the control token's line).

        Unterminated bytes before the end of the stream are not a line and are dropped. Raises
        `LineTooLong` as soon as the pending line exceeds the limit, and whatever the stream raises
        (`trio.BrokenResourceError`, `trio.ClosedResourceError`). Cancellation: safe; the buffer keeps
        what was received and the next call continues from it.
        """
        most = self._max if limit is None else min(limit, self._max)
        while True:
            newline = self._buffer.find(b"\n", self._scanned)
            if newline >= 0:
                return self._take_line(newline, most)
            pending = len(self._buffer) - self._start
            if pending > most + 1:  # + 1: room for the "\r" of a "\r\n" terminator
                raise LineTooLong(most, pending)
            if self._start:
                del self._buffer[: self._start]
                self._start = 0
            self._scanned = len(self._buffer)
            data = await self._stream.receive_some(RECEIVE_BYTES)
            if not data:
                return None
            self._buffer += data

    def _take_line(self, newline: int, most: int) -> bytes:
        start = self._start
        self._start = self._scanned = newline + 1
        end = newline - 1 if newline > start and self._buffer[newline - 1] == 0x0D else newline
        if end - start > most:
            raise LineTooLong(most, end - start, terminated=True)
        with memoryview(self._buffer) as view:
            return bytes(view[start:end])
