"""The protocol and log docs stay true: every example line decodes, every op, code and event is documented."""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import msgspec
import msgspec.inspect as mi

from engine.control.parse import BadLine, parse_request
from messages.control import ERROR_CODES, OPS
from messages.control_replies import ErrorReply, reply_decoder
from messages.log.events import LogEvent, event_decoder

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_protocol_examples_decode_and_bad_lines_get_the_documented_errors() -> None:
    text = (DOCS / "control-protocol.md").read_text()
    ops: dict[str | None, str] = {}
    expected_error: ErrorReply | None = None
    checked = 0
    for line in text.splitlines():
        if line.startswith("→ "):
            parsed = parse_request(line[2:].encode())
            if isinstance(parsed, BadLine):
                expected_error = ErrorReply(id=parsed.id, code="bad_request", message=parsed.message)
            else:
                ops[parsed.id] = str(parsed.__struct_config__.tag)
                expected_error = None
        elif line.startswith("← "):
            raw = line[2:].encode()
            reply_id = msgspec.json.decode(raw)["id"]
            if expected_error is not None:
                assert msgspec.json.decode(raw, type=ErrorReply) == expected_error
            else:
                reply_decoder(ops[reply_id]).decode(raw)  # type: ignore[arg-type]
            checked += 1
    assert checked >= 20


def test_every_op_and_error_code_is_documented() -> None:
    text = (DOCS / "control-protocol.md").read_text()
    headings = {op for line in text.splitlines() if line.startswith("### ") for op in line[4:].split(" / ")}
    assert set(OPS) <= headings
    for code in ERROR_CODES:
        assert f"| `{code}` |" in text


def test_log_examples_decode_and_every_event_field_is_documented() -> None:
    text = (DOCS / "logging.md").read_text()
    examples = [line for line in text.splitlines() if line.startswith('{"event":')]
    decoder = event_decoder()
    assert len([decoder.decode(line.encode()) for line in examples]) >= 6
    for cls in get_args(LogEvent):
        tag = cls.__struct_config__.tag
        row = re.search(rf"^\| `{tag}` \|.*$", text, re.MULTILINE)
        assert row is not None, f"docs/logging.md has no row for {tag}"
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType)
        for field in info.fields:
            if field.name not in ("ts", "request_id", "replica"):
                assert f"`{field.encode_name}`" in row.group(0), (
                    f"{tag}: field {field.encode_name} undocumented"
                )
