"""Turning a `generate` into a `ServingRequest`, with every check that needs the model.

The control messages already bound every number; here come the model's limits: the vocabulary, the
context, the KV pool a request must fit in, images only for a model with a vision encoder and with
sides that are multiples of the patch size, a grammar (structured outputs) that compiles, for a
tokenizer llguidance reads. Each refusal is a `RequestFailed` whose message names the
value and the limit.

The context is vLLM's: the prompt and `max_tokens` together must fit in it (the model's context, or
`--max-model-len` below it), so no response ever runs past it; a request without `max_tokens` (`null`)
gets what the context leaves after its prompt.
"""

from __future__ import annotations

import uuid

import numpy as np

from engine.control.errors import RequestFailed
from engine.generate.served import ServedModel
from messages.control import GenerateRequest, ImageInput
from messages.grammar import Grammar
from replicas.model import ImageSizeError, InvalidBatchError, SamplingParams, check_image, encode_prompt
from replicas.model.text.grammar import grammar_name, grammar_problem, supports_grammars
from replicas.request import RequestSpec, ServingRequest
from replicas.settings import ReplicaSettings
from replicas.weights import ModelHost


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:12]}"


def build_request(
    request: GenerateRequest, host: ModelHost, settings: ReplicaSettings, served: ServedModel
) -> ServingRequest:
    """A validated `ServingRequest` for `request`, or `RequestFailed` (`bad_request`, `not_supported`)."""
    config = host.config
    images = [_image_array(image, index) for index, image in enumerate(request.images)]
    if images and config.image_token_id is None:
        raise RequestFailed(
            "not_supported", f"model {host.name!r} takes text only; this request has {len(images)} images"
        )
    if request.stop and host.tokenizer is None:
        raise RequestFailed("bad_request", f"model {host.name!r} has no tokenizer: `stop` strings need one")
    if request.grammar is not None:
        _check_grammar(request.grammar, host)
    prompt_ids = _prompt_ids(request, host, len(images))
    context = served.context
    if len(prompt_ids) >= context:
        raise RequestFailed(
            "bad_request",
            f"prompt of {len(prompt_ids)} tokens does not fit the context of {context} tokens "
            "(it must leave room for one generated token)",
        )
    max_tokens = context - len(prompt_ids) if request.max_tokens is None else request.max_tokens
    if len(prompt_ids) + max_tokens > context:
        raise RequestFailed(
            "bad_request",
            f"the context is {context} tokens, but this request asks for {len(prompt_ids) + max_tokens}: "
            f"a prompt of {len(prompt_ids)} tokens + max_tokens {max_tokens}; lower max_tokens to at most "
            f"{context - len(prompt_ids)} or shorten the prompt",
        )
    if request.min_tokens > max_tokens:
        raise RequestFailed(
            "bad_request", f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({max_tokens})"
        )
    capacity = len(prompt_ids) + max_tokens - 1
    blocks = -(-capacity // settings.kv_block_size)
    if blocks > settings.kv_pool_blocks:
        raise RequestFailed(
            "bad_request",
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) needs {blocks} KV blocks, "
            f"but a replica's KV pool has {settings.kv_pool_blocks} (lower max_tokens or raise --kv-pool-blocks)",
        )
    for token in request.logit_bias:
        if token >= config.vocab_size:
            raise RequestFailed(
                "bad_request",
                f"logit_bias names token {token}, outside the vocabulary of {config.vocab_size} tokens",
            )
    seed = request.seed if request.seed is not None else served.next_seed()
    spec = RequestSpec.of(
        request_id=request.request_id or new_request_id(),
        prompt_ids=prompt_ids,
        images=images,
        sampling=SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            seed=seed,
            ignore_eos=request.ignore_eos,
            eos_banned_before=len(prompt_ids) + request.min_tokens,
            eos_token_ids=tuple(sorted(config.eos_token_ids)) if request.min_tokens else (),
            grammar=request.grammar,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            repetition_penalty=request.repetition_penalty,
            logit_bias=tuple(sorted(request.logit_bias.items())),
        ),
        max_tokens=max_tokens,
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
    )
    return ServingRequest(spec, eos_token_ids=config.eos_token_ids)


def _check_grammar(grammar: Grammar, host: ModelHost) -> None:
    """A grammar needs a tokenizer llguidance reads, and must compile (before anything is queued)."""
    if not supports_grammars(host.tokenizer):
        raise RequestFailed(
            "not_supported",
            f"model {host.name!r} has no tokenizer structured outputs can use (a tokenizer.json or a GGUF "
            "file's vocabulary): send the request without a grammar",
        )
    problem = grammar_problem(grammar)
    if problem is not None:
        raise RequestFailed("bad_request", f"the {grammar_name(grammar)} does not compile: {problem}")


def _prompt_ids(request: GenerateRequest, host: ModelHost, image_count: int) -> list[int]:
    config = host.config
    if request.prompt is not None:
        if host.tokenizer is None:
            raise RequestFailed(
                "bad_request",
                f"model {host.name!r} has no tokenizer.json: send `input_ids` instead of `prompt`",
            )
        if not request.prompt:
            raise RequestFailed("bad_request", "prompt is empty")
        try:
            return encode_prompt(
                host.tokenizer,
                request.prompt,
                image_count,
                config.image_token_id,
                add_special_tokens=request.add_special_tokens,
            )
        except InvalidBatchError as exc:
            raise RequestFailed("bad_request", str(exc)) from None
    assert request.input_ids is not None
    ids = list(request.input_ids)
    for index, token in enumerate(ids):
        if token >= config.vocab_size:
            raise RequestFailed(
                "bad_request",
                f"input_ids[{index}] = {token} is outside the vocabulary of {config.vocab_size} tokens",
            )
    marker = config.image_token_id
    markers = 0 if marker is None else ids.count(marker)
    if image_count and markers == 0:
        assert marker is not None
        ids = [marker] * image_count + ids
    elif markers != image_count:
        raise RequestFailed(
            "bad_request",
            f"input_ids hold {markers} image markers (token {marker}) but {image_count} images were given",
        )
    return ids


def _image_array(image: ImageInput, index: int) -> np.ndarray:
    # A writable copy: torch refuses to wrap read-only memory without a warning.
    array = np.frombuffer(bytearray(image.pixels), dtype=np.uint8).reshape(image.height, image.width, 3)
    try:
        check_image(array, index)
    except ImageSizeError as exc:
        raise RequestFailed("bad_request", str(exc)) from None
    return array
