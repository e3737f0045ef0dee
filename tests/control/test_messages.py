"""Control requests, replies and log events: JSON round trips, tags, bounds, names shared with replicas/."""

from typing import Any, get_args

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from messages import control, control_replies
from messages.control import GenerateRequest, ImageInput, request_decoder
from messages.control_replies import RESULT_TYPES, ErrorReply, LockResult, TokenReply, reply_decoder
from messages.faults import Fault
from messages.log import events
from messages.log.events import event_decoder
from replicas.states import ROLES, ReplicaState
from tests.control.strategies import for_struct

REQUESTS = get_args(control.ControlRequest)
REPLIES = (control_replies.TokenReply, control_replies.ErrorReply, *set(RESULT_TYPES.values()))
EVENTS = get_args(events.LogEvent)
ENCODER = msgspec.json.Encoder()
FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _op(request_type: type) -> Any:
    return request_type.__struct_config__.tag


@FAST
@given(st.one_of([for_struct(cls) for cls in REQUESTS]))
def test_every_request_round_trips(request: control.ControlRequest) -> None:
    line = ENCODER.encode(request)
    assert request_decoder().decode(line) == request
    assert msgspec.json.decode(line)["op"] == _op(type(request))


@FAST
@given(st.data())
def test_every_reply_round_trips_through_its_ops_decoder(data: st.DataObject) -> None:
    op = data.draw(st.sampled_from(control.OPS))
    choices = [RESULT_TYPES[op], ErrorReply] + ([TokenReply] if op == "generate" else [])
    reply = data.draw(st.one_of([for_struct(cls) for cls in choices]))
    assert reply_decoder(op).decode(ENCODER.encode(reply)) == reply


@FAST
@given(st.one_of([for_struct(cls) for cls in EVENTS]))
def test_every_event_round_trips(event: events.LogEvent) -> None:
    line = ENCODER.encode(event)
    assert event_decoder().decode(line) == event
    assert msgspec.json.decode(line)["event"] == event.__struct_config__.tag


@FAST
@given(for_struct(control.GenerateRequest))
def test_images_travel_as_base64(request: GenerateRequest) -> None:
    decoded = msgspec.json.decode(ENCODER.encode(request))
    for image, raw in zip(request.images, decoded["images"], strict=True):
        assert set(raw) == {"width", "height", "pixels_b64"}
        assert msgspec.json.decode(msgspec.json.encode(raw["pixels_b64"]), type=bytes) == image.pixels


def test_tags_are_unique_lowercase_and_explicit() -> None:
    for group in (REQUESTS, EVENTS, get_args(Fault)):
        tags = [cls.__struct_config__.tag for cls in group]
        assert len(set(tags)) == len(tags)
        assert all(isinstance(tag, str) and tag == tag.lower() for tag in tags)
    assert {_op(cls) for cls in REQUESTS} == set(control.OPS)
    assert {cls.__struct_config__.tag for cls in REPLIES} == {"token", "error", "result"}


def test_all_messages_are_frozen_and_strict() -> None:
    """Requests, replies and faults refuse unknown fields; log events ignore them, so that an older
    `engine.logs` reads a newer node's log (docs/logging.md, Evolution)."""
    for cls in (*REQUESTS, *REPLIES, *get_args(Fault)):
        config = cls.__struct_config__
        assert config.frozen and config.forbid_unknown_fields, cls
    for cls in EVENTS:
        config = cls.__struct_config__
        assert config.frozen and not config.forbid_unknown_fields, cls


def test_state_and_role_names_match_the_replica_state_machine() -> None:
    assert set(get_args(control.ReplicaStateName)) == {state.value for state in ReplicaState}
    assert get_args(control.ReplicaRole) == ROLES


def test_lock_and_unlock_share_a_result_and_decoders_differ_per_op() -> None:
    line = b'{"type":"result","id":"1","replica":"decode-0","locked":false,"lock_reasons":[]}'
    assert reply_decoder("unlock").decode(line) == LockResult(
        id="1", replica="decode-0", locked=False, lock_reasons=[]
    )
    with pytest.raises(msgspec.ValidationError, match="Object contains unknown field `replica`"):
        reply_decoder("status").decode(line)
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'token'"):
        reply_decoder("status").decode(
            b'{"type":"token","id":"1","request_id":"r","index":0,"token_ids":[1],"text":"a"}'
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "Expected `int` >= 1 - at `$.max_tokens`"),
        ({"max_tokens": 10**12}, "Expected `int` <= 1048576 - at `$.max_tokens`"),
        ({"temperature": -0.5}, "Expected `float` >= 0.0 - at `$.temperature`"),
        ({"temperature": 1e300}, "Expected `float` <= 10.0 - at `$.temperature`"),
        ({"top_p": 0}, "Expected `float` > 0.0 - at `$.top_p`"),
        ({"top_p": 1.5}, "Expected `float` <= 1.0 - at `$.top_p`"),
        ({"seed": -1}, "Expected `int` >= 0 - at `$.seed`"),
        ({"input_ids": [5, -1], "prompt": None}, "Expected `int` >= 0 - at `$.input_ids[1]`"),
        ({"input_ids": [2**31], "prompt": None}, "Expected `int` <= 2147483647 - at `$.input_ids[0]`"),
        ({"input_ids": [], "prompt": None}, "Expected `array` of length >= 1 - at `$.input_ids`"),
        ({"request_id": "a b"}, "Expected `str` matching regex"),
        ({"input_ids": [1]}, "generate needs exactly one of `prompt` or `input_ids`; both were given"),
        ({"prompt": None}, "generate needs exactly one of `prompt` or `input_ids`; neither was given"),
        (
            {"images": [{"width": 2, "height": 1, "pixels_b64": "AAAA"}]},
            "pixels_b64 decodes to 3 bytes, but a 2x1 RGB image needs width*height*3 = 6 - at `$.images[0]`",
        ),
        (
            {"images": [{"width": 0, "height": 1, "pixels_b64": ""}]},
            "Expected `int` >= 1 - at `$.images[0].width`",
        ),
        ({"images": [{"width": 9000, "height": 1, "pixels_b64": ""}]}, "Expected `int` <= 8192"),
        ({"images": [{"width": 1, "height": 1, "pixels_b64": "A!A="}]}, "Invalid base64 encoded string"),
    ],
)
def test_generate_bounds(fields: dict[str, Any], message: str) -> None:
    request = {"op": "generate", "id": "g", "prompt": "hello"} | fields
    with pytest.raises(msgspec.ValidationError) as info:
        request_decoder().decode(msgspec.json.encode({k: v for k, v in request.items() if v is not None}))
    assert message in str(info.value)


def test_image_pixels_are_checked_when_built_in_python_too() -> None:
    with pytest.raises(ValueError, match=r"needs width\*height\*3 = 12"):
        ImageInput(width=2, height=2, pixels=b"abc")
