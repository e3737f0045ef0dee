"""LineReader: newline framing with a size limit over a real trio stream."""

import pytest
import trio
import trio.testing

from engine.control.lines import LineReader, LineTooLong


async def _reader_over(chunks: list[bytes], max_line_bytes: int) -> LineReader:
    send, receive = trio.testing.memory_stream_pair()
    for chunk in chunks:
        await send.send_all(chunk)
    await send.aclose()
    return LineReader(receive, max_line_bytes)


async def _all_lines(reader: LineReader) -> list[bytes]:
    lines = []
    while (line := await reader.next_line()) is not None:
        lines.append(line)
    return lines


async def test_lines_split_across_chunks_and_crlf() -> None:
    reader = await _reader_over([b"ab", b"c\nde\r", b"\n\nf", b"g\n", b"tail-without-newline"], 100)
    assert await _all_lines(reader) == [b"abc", b"de", b"", b"fg"]


async def test_a_line_of_exactly_the_limit_is_accepted() -> None:
    reader = await _reader_over([b"x" * 10 + b"\n" + b"y" * 10 + b"\r\n"], 10)
    assert await _all_lines(reader) == [b"x" * 10, b"y" * 10]


async def test_a_complete_line_over_the_limit_is_refused() -> None:
    reader = await _reader_over([b"ok\n" + b"z" * 11 + b"\n"], 10)
    assert await reader.next_line() == b"ok"
    with pytest.raises(LineTooLong, match=r"^line longer than 10 bytes \(11 bytes before its newline\)$"):
        await reader.next_line()


async def test_an_unterminated_line_over_the_limit_is_refused_before_its_end() -> None:
    send, receive = trio.testing.memory_stream_pair()
    reader = LineReader(receive, 1000)
    await send.send_all(b"a" * 1500)  # no newline, and the stream stays open
    with pytest.raises(LineTooLong, match=r"read 1500 bytes"):
        await reader.next_line()


async def test_many_lines_in_one_chunk_and_a_large_line() -> None:
    big = b"b" * (3 * 1024 * 1024)
    reader = await _reader_over([b"1\n2\n3\n" + big[:1000], big[1000:] + b"\n4\n"], 4 * 1024 * 1024)
    assert await _all_lines(reader) == [b"1", b"2", b"3", big, b"4"]
