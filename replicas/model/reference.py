"""The reference the node's output must equal: the executor run in one piece, one sequence, one cache.

`generate_in_one_piece` prefills the whole prompt (images encoded by the model's own vision encoder and
placed at their markers), samples the first token, then decodes one token at a time — no batching, no
layer split, no migration. Disaggregated serving must produce exactly these token ids (up to genuine
greedy ties, where two logits are within rounding of each other). A request's grammar (`sampling.grammar`)
is matched by one `GrammarState` from the first token to the last, its mask on every sampled row, and
ends the generation when it finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from replicas.model.errors import ContextLengthError, InvalidBatchError
from replicas.model.executor import DecodeSequence, Executor, PrefillSequence
from replicas.model.kv_cache import DEFAULT_KV_BLOCK_SIZE, KVCache
from replicas.model.llama import Model
from replicas.model.sampling import GREEDY, SamplingParams, finish_reason, token_history
from replicas.model.text.grammar import GrammarState, grammar_tokenizer
from replicas.model.text.prompt import layout_prompt

REFERENCE_OWNER = "reference"


def generate_in_one_piece(
    model: Model,
    prompt_ids: Sequence[int],
    *,
    images: Sequence[torch.Tensor | np.ndarray] = (),
    sampling: SamplingParams = GREEDY,
    max_tokens: int = 16,
    block_size: int = DEFAULT_KV_BLOCK_SIZE,
) -> list[int]:
    """Generated token ids (the EOS token included when generation stops on it).

    `prompt_ids` holds one `config.image_token_id` marker per image when `images` are given.
    """
    if max_tokens < 1:
        raise InvalidBatchError(f"max_tokens must be >= 1, got {max_tokens}")
    embeds = None
    embed_indices = None
    positions = None
    tokens = list(prompt_ids)
    next_position = len(tokens)
    if images:
        if model.vision is None:
            raise InvalidBatchError(f"model {model.name!r} has no vision encoder; it takes text only")
        encoded = model.vision.encode(images)
        layout = layout_prompt(tokens, [e.grid for e in encoded], model.config.image_token_id)
        tokens, positions, next_position = layout.token_ids, layout.positions, layout.next_position
        embeds = torch.cat([e.embeds for e in encoded])
        embed_indices = torch.cat([torch.arange(start, start + rows) for start, rows in layout.image_spans])
    if not tokens:
        raise InvalidBatchError("prompt is empty")
    if len(tokens) >= model.context_length:
        raise ContextLengthError(
            f"prompt of {len(tokens)} tokens is longer than the context of {model.context_length} tokens "
            f"of {model.name!r} (it must leave room for one generated token)"
        )
    total = min(len(tokens) + max_tokens, model.context_length)
    cache = KVCache.create(
        model.config, -(-total // block_size), block_size=block_size, device=model.device, name="reference-kv"
    )
    table = cache.pool.allocate(cache.blocks_for(total), REFERENCE_OWNER)
    grammar = None
    if sampling.grammar is not None:
        if model.tokenizer is None:
            raise InvalidBatchError(f"model {model.name!r} has no tokenizer: a grammar needs one")
        eos = tuple(sorted(model.eos_token_ids))
        grammar = GrammarState(
            sampling.grammar, grammar_tokenizer(model.tokenizer, model.config.vocab_size, eos)
        )
    try:
        executor = Executor(model, cache)
        first = executor.prefill(
            [
                PrefillSequence(
                    block_table=table,
                    token_ids=tokens,
                    positions=positions,
                    embeds=embeds,
                    embed_indices=embed_indices,
                    sampling=sampling,
                    token_mask=None if grammar is None else grammar.mask(),
                    history=token_history(sampling, tokens, ()),
                )
            ]
        )
        assert first.tokens is not None
        generated = [first.tokens[0]]
        if grammar is not None:
            grammar.feed(generated[-1])
        while finish_reason(generated, sampling, model.eos_token_ids, max_tokens) is None:
            if grammar is not None and grammar.finished:
                break
            cached = len(tokens) + len(generated) - 1
            if cached + 1 > total:
                break
            step = executor.decode(
                [
                    DecodeSequence(
                        block_table=table,
                        cached_tokens=cached,
                        token_id=generated[-1],
                        position=next_position + len(generated) - 1,
                        sampling=sampling,
                        token_mask=None if grammar is None else grammar.mask(),
                        history=token_history(sampling, tokens, generated),
                    )
                ]
            )
            generated.append(step.tokens[0])
            if grammar is not None:
                grammar.feed(generated[-1])
        return generated
    finally:
        cache.pool.free(table, REFERENCE_OWNER)
