"""vLLM's utility routes and habits through a real node: `/tokenize` and `/detokenize` (the node's own
tokenizer and chat template), `/version`, a body without `model`, and OpenAI's JSON error for a path or
method no route serves."""

from __future__ import annotations

from importlib import metadata

import httpx

from replicas.model import tiny_model

CHAT = [{"role": "user", "content": "hi there"}]


async def test_tokenize_and_detokenize_use_the_served_tokenizer(http: httpx.AsyncClient) -> None:
    tokenizer = tiny_model().tokenizer
    assert tokenizer is not None
    context = (await http.get("/v1/models")).json()["data"][0]["max_model_len"]
    plain = (await http.post("/tokenize", json={"model": "tiny", "prompt": "hello"})).json()
    assert plain == {
        "count": len(tokenizer.encode("hello")),
        "max_model_len": context,
        "tokens": tokenizer.encode("hello"),
        "token_strs": None,
    }
    bare = (await http.post("/tokenize", json={"prompt": "hello", "add_special_tokens": False})).json()
    assert bare["tokens"] == tokenizer.encode("hello", add_special_tokens=False)
    back = await http.post("/detokenize", json={"tokens": bare["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "hello"}

    chat = (await http.post("/tokenize", json={"messages": CHAT})).json()
    reply = await http.post(
        "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "temperature": 0}
    )
    assert reply.status_code == 200, reply.text  # no `model`: the served one, as vLLM takes it
    assert chat["count"] == reply.json()["usage"]["prompt_tokens"]


async def test_bad_token_requests_get_json_errors(http: httpx.AsyncClient) -> None:
    outside = await http.post("/detokenize", json={"tokens": [1, 1 << 30]})
    assert outside.status_code == 400
    assert outside.json()["error"]["param"] == "tokens"
    both = await http.post("/tokenize", json={"prompt": "a", "messages": CHAT})
    assert both.status_code == 400 and both.json()["error"]["message"] == "give either prompt or messages"
    other = await http.post("/tokenize", json={"model": "gpt-x", "prompt": "a"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"


async def test_version_and_unknown_routes(http: httpx.AsyncClient) -> None:
    assert (await http.get("/version")).json() == {"version": metadata.version("zigzag")}
    missing = await http.get("/v1/embeddings")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/json"
    assert missing.json()["error"]["message"].startswith("no route GET /v1/embeddings;")
    wrong = await http.get("/v1/completions")
    assert wrong.status_code == 405
    assert wrong.json()["error"]["message"] == "GET is not allowed on /v1/completions"


async def test_a_completion_without_model_is_served(http: httpx.AsyncClient) -> None:
    reply = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "tiny"
