"""Request lines → requests, or `bad_request` messages that say what to fix (engine.control.parse)."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.control.parse import TOO_DEEP, BadLine, parse_request
from messages.control import CancelRequest, StatusRequest
from tests.control.strategies import JSON_VALUES

KNOWN_OPS = "generate, status, cancel, transition, lock, unlock, scale, metrics, shutdown, release"


def test_a_good_line_is_a_request() -> None:
    assert parse_request(b'{"op":"status","id":"s1"}') == StatusRequest(id="s1")
    assert parse_request(b'{"id":"c1","request_id":"r-1","op":"cancel"}') == CancelRequest(
        id="c1", request_id="r-1"
    )


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            b"hello",
            BadLine(
                id=None, message="the line is not valid JSON: JSON is malformed: invalid character (byte 0)"
            ),
        ),
        (
            b'{"op":"status","id":"x"',
            BadLine(id=None, message="the line is not valid JSON: Input data was truncated"),
        ),
        (
            b"\x00\x01\x02\xff garbage",  # UTF-8 is checked first, whatever else is wrong
            BadLine(id=None, message="the line is not valid UTF-8: byte 0xff at offset 3"),
        ),
        (
            b"\x00\x01\x02 garbage",
            BadLine(
                id=None, message="the line is not valid JSON: JSON is malformed: invalid character (byte 0)"
            ),
        ),
        (
            b"[1, 2]",
            BadLine(id=None, message='a request must be a JSON object with "op" and "id"; got a JSON array'),
        ),
        (
            b'"status"',
            BadLine(id=None, message='a request must be a JSON object with "op" and "id"; got a JSON str'),
        ),
        (b'{"id":"n1"}', BadLine(id="n1", message=f'the request has no "op"; known ops: {KNOWN_OPS}')),
        (
            b'{"op":"explode","id":"e1"}',
            BadLine(id="e1", message=f"unknown op 'explode'; known ops: {KNOWN_OPS}"),
        ),
        (b'{"op":7,"id":"e2"}', BadLine(id="e2", message=f"unknown op 7; known ops: {KNOWN_OPS}")),
        (b'{"op":"status"}', BadLine(id=None, message="invalid request: Object missing required field `id`")),
        (
            b'{"op":"status","id":5}',
            BadLine(id=None, message="invalid request: Expected `str`, got `int` - at `$.id`"),
        ),
        (
            b'{"op":"status","id":""}',
            BadLine(id=None, message="invalid request: Expected `str` of length >= 1 - at `$.id`"),
        ),
        (
            b'{"op":"cancel","id":"m1"}',
            BadLine(id="m1", message="invalid request: Object missing required field `request_id`"),
        ),
        (
            b'{"op":"generate","id":"t1","prompt":5}',
            BadLine(id="t1", message="invalid request: Expected `str | null`, got `int` - at `$.prompt`"),
        ),
        (
            b'{"op":"status","id":"u1","extra":1}',
            BadLine(id="u1", message="invalid request: Object contains unknown field `extra`"),
        ),
        (
            b'{"op":"generate","id":"v1","prompt":"caf\xe9"}',
            BadLine(id="v1", message="the line is not valid UTF-8: byte 0xe9 at offset 40"),
        ),
        (
            b'{"op":"status","id":"\xff"}',
            BadLine(id=None, message="the line is not valid UTF-8: byte 0xff at offset 21"),
        ),
        (  # a bad byte before the id, and a truncated sequence after it: the id still answers
            b'{"prompt":"\xc3(","op":"generate","id":"w1","stop":["\xe2\x82"]}',
            BadLine(id="w1", message="the line is not valid UTF-8: byte 0xc3 at offset 11"),
        ),
        (
            b'{"op":"transition","id":"t2","replica":"decode-0","to":"Sleeping"}',
            BadLine(
                id="t2",
                message="invalid request: Invalid enum value 'Sleeping' - at `$.to`; valid states: Inactive, "
                "LoadingPrefill, LoadingDecode, LoadingEncode, Prefill, Decode, Encode, NewPrefill, OldPrefill, "
                "RefractoryPrefill, MutatingToDecode, AusPrefill, AusDecode, ShuttingPrefill, ShuttingDecode, "
                "ShuttingEncode, ShuttingNull",
            ),
        ),
        (
            b'{"op":"scale","id":"s2","role":"vision","replicas":1}',
            BadLine(
                id="s2",
                message="invalid request: Invalid enum value 'vision' - at `$.role`; valid roles: encode, prefill, decode",
            ),
        ),
        (
            b'{"op":"scale","id":"s3","role":"decode","replicas":1000}',
            BadLine(id="s3", message="invalid request: Expected `int` <= 64 - at `$.replicas`"),
        ),
        (
            b'{"op":"generate","id":"g1","prompt":"x","max_tokens":-3}',
            BadLine(id="g1", message="invalid request: Expected `int` >= 1 - at `$.max_tokens`"),
        ),
        (
            b'{"op":"generate","id":"g2","prompt":"x","max_tokens":1e400}',
            BadLine(id="g2", message="invalid request: Number out of range - at `$.max_tokens`"),
        ),
        (
            b'{"op":"generate","id":"g3","input_ids":[1],"images":[1]}',
            BadLine(id="g3", message="invalid request: Expected `object`, got `int` - at `$.images[0]`"),
        ),
        (b'{"a":' * 5000 + b"1" + b"}" * 5000, BadLine(id=None, message=TOO_DEEP)),
    ],
)
def test_bad_lines_say_what_is_wrong(line: bytes, expected: BadLine) -> None:
    assert parse_request(line) == expected


@settings(max_examples=60, deadline=None)
@given(
    depth=st.integers(min_value=1, max_value=20_000),
    opener=st.sampled_from([b"[", b'{"k":']),
    field=st.sampled_from([b"x", b"prompt", b"id", b"op", b"images"]),
)
def test_json_nested_to_any_depth_is_a_bad_line_not_a_crash(depth: int, opener: bytes, field: bytes) -> None:
    """A review found that ~1000 nested arrays in any field raised RecursionError out of the parser and
    took the whole node down."""
    closer = b"]" if opener == b"[" else b"}"
    value = opener * depth + b"1" + closer * depth
    parsed = parse_request(b'{"op":"status","id":"s","' + field + b'":' + value + b"}")
    assert isinstance(parsed, BadLine) and parsed.message


def test_an_overlong_id_is_not_echoed() -> None:
    bad = parse_request(b'{"op":"status","id":"' + b"x" * 300 + b'"}')
    assert bad == BadLine(id=None, message="invalid request: Expected `str` of length <= 256 - at `$.id`")


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200).filter(lambda line: b"\n" not in line))
def test_any_bytes_parse_to_a_request_or_a_bad_line(line: bytes) -> None:
    parsed = parse_request(line)
    if isinstance(parsed, BadLine):
        assert parsed.message
        assert parsed.id is None or 1 <= len(parsed.id) <= 256


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["op", "id", "prompt", "max_tokens", "replica", "to", "x"]), JSON_VALUES)
)
def test_any_json_object_parses_to_a_request_or_a_bad_line_echoing_a_readable_id(
    fields: dict[str, object],
) -> None:
    parsed = parse_request(msgspec.json.encode(fields))
    if isinstance(parsed, BadLine):
        readable = isinstance(fields.get("id"), str) and 1 <= len(str(fields["id"])) <= 256
        assert parsed.id == (fields["id"] if readable else None)
