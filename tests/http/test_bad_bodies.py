"""Malformed and unsupported bodies (and values out of vLLM's ranges): each is a 400 in vLLM's error shape
naming what is wrong (never a 500), and the node keeps serving. This node has no `--tool-call-parser`:
tools with `tool_choice` auto are refused, saying to pass it."""

from __future__ import annotations

import base64
import io
from typing import Any

import httpx
import pytest
from PIL import Image

GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "temperature": 0}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RESPONSE = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f"}}


def png(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(url: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": url}}],
    }


def completion(**changes: Any) -> dict[str, Any]:
    return {**GOOD, **changes}


def chat(**changes: Any) -> dict[str, Any]:
    return {**CHAT, **changes}


def without(body: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k != key}


# (path, body or raw bytes, the param the error names — None where the body as a whole is wrong)
CASES: list[tuple[str, Any, str | None]] = [
    ("/v1/completions", b"{", None),
    ("/v1/completions", b"[]", None),
    ("/v1/completions", without(GOOD, "prompt"), None),
    ("/v1/completions", completion(prompt=5), "prompt"),
    ("/v1/completions", completion(prompt=""), "prompt"),
    ("/v1/completions", completion(prompt=["one", 2]), "prompt"),
    ("/v1/completions", completion(prompt=[[1, 2], []]), "prompt"),
    ("/v1/completions", completion(prompt=[[1, 999_999]]), "prompt"),
    ("/v1/completions", completion(prompt=["a"] * 3, n=100), "n"),  # over 256 choices
    ("/v1/completions", completion(prompt=[]), "prompt"),
    ("/v1/completions", completion(prompt=[999_999]), "prompt"),
    ("/v1/completions", completion(prompt=[-1]), "prompt"),
    ("/v1/completions", completion(max_tokens=0), "max_tokens"),
    ("/v1/completions", completion(max_tokens="ten"), "max_tokens"),
    ("/v1/completions", completion(max_tokens=1 << 40), "max_tokens"),
    ("/v1/completions", completion(temperature=-1), "temperature"),
    ("/v1/completions", completion(temperature=100), "temperature"),
    ("/v1/completions", completion(top_p=0), "top_p"),
    ("/v1/completions", completion(top_p=1.5), "top_p"),
    ("/v1/completions", completion(n=0), "n"),
    ("/v1/completions", completion(stop=[f"s{i}" for i in range(20)]), "stop"),
    ("/v1/completions", completion(stop=""), "stop"),
    ("/v1/completions", completion(stop=7), "stop"),
    ("/v1/completions", completion(seed=-5), "seed"),
    ("/v1/completions", completion(seed="abc"), "seed"),
    ("/v1/completions", completion(stream="yes"), "stream"),
    ("/v1/completions", completion(stream_options=3), "stream_options"),
    ("/v1/completions", completion(min_tokens=5, max_tokens=2), "min_tokens"),
    ("/v1/completions", completion(presence_penalty=2.5), "presence_penalty"),
    ("/v1/completions", completion(frequency_penalty=-3), "frequency_penalty"),
    ("/v1/completions", completion(repetition_penalty=0), "repetition_penalty"),
    ("/v1/completions", completion(repetition_penalty=-1.0), "repetition_penalty"),
    ("/v1/completions", completion(logprobs=21), "logprobs"),
    ("/v1/completions", completion(best_of=3), "best_of"),
    ("/v1/completions", completion(best_of=3, n=2), "best_of"),
    ("/v1/completions", completion(logit_bias={"5": 101.0}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"five": 1.0}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"999999": 1.0}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"-1": 1.0}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"999999": 1.0}), "logit_bias"),
    ("/v1/chat/completions", chat(presence_penalty=-2.5), "presence_penalty"),
    ("/v1/completions", completion(prompt=[65] * 40_000), None),  # over the context
    ("/v1/chat/completions", without(CHAT, "messages"), None),
    ("/v1/chat/completions", chat(messages=[]), "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "audio"}]}]),
        "messages[0].content[0].type",
    ),
    (
        "/v1/chat/completions",
        chat(messages=[image_message("https://example.com/a.png")]),
        "messages[0].content[1].image_url.url",
    ),
    (
        "/v1/chat/completions",
        chat(messages=[image_message("data:image/png;base64,@@@")]),
        "messages[0].content[1].image_url.url",
    ),
    (
        "/v1/chat/completions",
        chat(messages=[image_message("data:image/png;base64," + base64.b64encode(b"not a png").decode())]),
        "messages[0].content[1].image_url.url",
    ),
    (
        "/v1/chat/completions",
        chat(messages=[image_message(png(17, 9))]),
        None,
    ),  # sides not a multiple of the patch
    ("/v1/chat/completions", chat(tools=[TOOL]), "tool_choice"),  # auto needs --tool-call-parser
    ("/v1/chat/completions", chat(tools=[TOOL], tool_choice="auto"), "tool_choice"),
    (  # forced calls and a structured output of its own
        "/v1/chat/completions",
        chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),  # not in tools
        "tool_choice",
    ),
    ("/v1/chat/completions", chat(tools=[TOOL], tool_choice="sometimes"), "tool_choice"),
    ("/v1/chat/completions", chat(tools=[{"type": "retrieval"}], tool_choice="none"), "tools[0].type"),
    (
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
        "tools[0].function.name",
    ),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "assistant", "tool_calls": [{"type": "function"}]}]),
        "messages[0].tool_calls[0]",
    ),
    ("/v1/responses", RESPONSE | {"background": True}, "background"),
    ("/v1/responses", RESPONSE | {"include": ["reasoning.encrypted_content"]}, "include"),
    ("/v1/responses", RESPONSE | {"reasoning": {"effort": "low"}}, "reasoning"),
    ("/v1/responses", RESPONSE | {"text": {"format": {"type": "json_object"}}}, "text.format"),
    ("/v1/responses", RESPONSE | {"truncation": "auto"}, "truncation"),
    ("/v1/responses", RESPONSE | {"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ("/v1/responses", RESPONSE | {"tools": [{"type": "function", "name": "f"}]}, "tool_choice"),
    ("/v1/responses", RESPONSE | {"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    (
        "/v1/responses",
        RESPONSE | {"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
        "input[0].content[0].type",
    ),
    ("/v1/responses", RESPONSE | {"input": []}, "input"),
    ("/v1/responses", RESPONSE | {"max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/chat/completions", chat(top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (
        "/v1/chat/completions",
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
        ),
        "response_format.json_schema.schema",
    ),
    ("/v1/completions", completion(response_format={"type": "xml"}), None),
    ("/v1/completions", completion(structured_outputs={"regex": "(unclosed"}), "structured_outputs.regex"),
    (
        "/v1/completions",
        completion(structured_outputs={"choice": ["a"]}, guided_regex="b+"),
        "guided_regex",
    ),
    ("/v1/chat/completions", chat(max_completion_tokens=0), "max_completion_tokens"),
    ("/v1/chat/completions", chat(continue_final_message=True), "add_generation_prompt"),
]


async def test_every_bad_body_is_a_400_naming_it_and_the_node_keeps_serving(http: httpx.AsyncClient) -> None:
    assert len(CASES) >= 30
    wrong = []
    for path, body, param in CASES:
        if isinstance(body, bytes):
            reply = await http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            reply = await http.post(path, json=body)
        shape = reply.json() if reply.headers.get("content-type", "").startswith("application/json") else None
        error = shape.get("error") if isinstance(shape, dict) else None
        if (
            reply.status_code != 400
            or not isinstance(error, dict)
            or set(error) != {"message", "type", "param", "code"}
            or error["code"] != 400
            or error["type"] != "BadRequestError"
            or not error["message"]
            or (param is not None and error["param"] != param)
        ):
            wrong.append(f"{path} {str(body)[:80]}: {reply.status_code} {reply.text[:200]}")
    assert not wrong, "\n".join(wrong)
    assert (await http.post("/v1/completions", json=GOOD)).status_code == 200
    assert (await http.get("/health")).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_an_unknown_model_is_a_404(http: httpx.AsyncClient, path: str) -> None:
    body = {**(GOOD if path.endswith("/completions") and "chat" not in path else CHAT), "model": "gpt-x"}
    reply = await http.post(path, json=body)
    assert reply.status_code == 404
    assert reply.json()["error"] == {
        "message": "the model 'gpt-x' does not exist; this node serves 'tiny'",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_an_image_in_chat_goes_through_the_encoder(http: httpx.AsyncClient) -> None:
    """The tiny model has a vision encoder: a PNG data URL of patch-aligned sides is served."""
    reply = await http.post(
        "/v1/chat/completions", json=chat(messages=[image_message(png(32, 16))], temperature=0)
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


async def test_tools_without_a_parser_need_the_flag_or_tool_choice_none(http: httpx.AsyncClient) -> None:
    refused = await http.post("/v1/chat/completions", json=chat(tools=[TOOL]))
    assert refused.status_code == 400 and "--tool-call-parser" in refused.json()["error"]["message"]
    plain = await http.post("/v1/chat/completions", json=chat(tools=[TOOL], tool_choice="none"))
    assert plain.status_code == 200, plain.text
    message = plain.json()["choices"][0]["message"]
    assert message["tool_calls"] == [] and isinstance(message["content"], str)


async def test_an_unknown_previous_response_is_a_404(http: httpx.AsyncClient) -> None:
    reply = await http.post("/v1/responses", json=RESPONSE | {"previous_response_id": "resp_nope"})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("NotFoundError", "previous_response_id")
    assert "resp_nope" in error["message"]
