"""Structured outputs in the model: a grammar's mask on every sampling path (host, device, the kernel
path and, on a GPU, its decode graphs), and a grammar's state rebuilt from the tokens so far."""

from __future__ import annotations

import json
import re

import pytest
import torch

from messages.grammar import ChoiceGrammar, JsonGrammar, RegexGrammar
from replicas.model import (
    ByteTokenizer,
    DecodeSequence,
    Executor,
    KVCache,
    Model,
    PrefillSequence,
    SamplingParams,
    sample_tokens,
    tiny_model,
)
from replicas.model.gpu.sampling import sample_tokens_on_device
from replicas.model.text.grammar import GrammarState, grammar_problem, grammar_tokenizer
from tests.model.helpers import allocate

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PATTERN = r"(zig|zag)-[0-9]{1,3}"
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
    "required": ["ok", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model() -> Model:
    return tiny_model(kernels="plain", device=DEVICE)


def state(model: Model, spec: RegexGrammar | JsonGrammar | ChoiceGrammar) -> GrammarState:
    assert model.tokenizer is not None
    eos = tuple(sorted(model.eos_token_ids))
    return GrammarState(spec, grammar_tokenizer(model.tokenizer, model.config.vocab_size, eos))


def constrained(
    executor: Executor, prompts: list[list[int]], sampling: list[SamplingParams], steps: int
) -> list[list[int]]:
    """Each prompt's tokens under `PATTERN`, a batch at a time, until its grammar finishes."""
    model, cache = executor.model, executor.cache
    tables = [allocate(cache, f"r{i}", len(p) + steps) for i, p in enumerate(prompts)]
    states = [state(model, RegexGrammar(pattern=PATTERN)) for _ in prompts]
    first = executor.prefill(
        [
            PrefillSequence(block_table=t, token_ids=p, sampling=params, token_mask=s.mask())
            for t, p, s, params in zip(tables, prompts, states, sampling)
        ]
    )
    assert first.tokens is not None
    outputs = [[token] for token in first.tokens]
    for s, token in zip(states, first.tokens):
        s.feed(token)
    for _ in range(steps - 1):
        live = [i for i, s in enumerate(states) if not s.finished]
        if not live:
            break
        decoded = executor.decode(
            [
                DecodeSequence(
                    block_table=tables[i],
                    cached_tokens=len(prompts[i]) + len(outputs[i]) - 1,
                    token_id=outputs[i][-1],
                    sampling=sampling[i],
                    token_mask=states[i].mask(),
                )
                for i in live
            ]
        )
        for i, token in zip(live, decoded.tokens):
            outputs[i].append(token)
            states[i].feed(token)
            assert states[i].error is None
    assert all(s.finished for s in states)
    return outputs


def answers_on(model: Model, paths: list[str]) -> dict[str, list[list[int]]]:
    """One greedy row and one sampled row, constrained, on each executor path; every answer checked."""
    prompts = [[(7 * j + 3 * i) % 250 + 5 for j in range(n)] for i, n in enumerate([5, 9])]
    sampling = [SamplingParams(ignore_eos=True), SamplingParams(temperature=1.5, seed=9, ignore_eos=True)]
    tokenizer = ByteTokenizer(model.config.vocab_size)
    answers = {}
    for path in paths:
        cache = KVCache.create(model.config, 16, device=model.device)
        attention = "torch" if path == "torch" else "kernels"
        executor = Executor(
            model, cache, attention=attention, cuda_graphs="auto" if path == "graphs" else "off"
        )
        if path == "graphs":
            assert executor.prepare() == "graphs"
        answers[path] = constrained(executor, prompts, sampling, 8)
        for tokens in answers[path]:
            assert re.fullmatch(PATTERN, tokenizer.decode(tokens)), tokenizer.decode(tokens)
    return answers


def test_every_path_gives_only_what_the_grammar_allows_and_the_same_tokens(model: Model) -> None:
    answers = answers_on(model, ["torch", "kernels"])
    assert answers["kernels"] == answers["torch"]


@pytest.mark.gpu
def test_the_decode_graphs_mask_the_logits_they_return() -> None:
    """A graph replays the forward only; the masks apply to its logits before the choice."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: torch.cuda.is_available() is false")
    answers = answers_on(tiny_model(kernels="plain", device="cuda"), ["torch", "graphs"])
    assert answers["graphs"] == answers["torch"]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_host_and_device_sampling_pick_the_same_allowed_tokens(temperature: float) -> None:
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=generator) * 4
    masks: list[torch.Tensor | None] = [torch.rand(300, generator=generator) < 0.05 for _ in range(5)] + [
        None
    ]
    params = [SamplingParams(temperature=temperature, seed=row) for row in range(6)]
    indices = list(range(10, 16))
    host = sample_tokens(logits, params, indices, masks=masks)
    assert sample_tokens_on_device(logits.to(DEVICE), params, indices, masks=masks) == host
    for row, mask in enumerate(masks):
        if mask is not None:
            assert mask[host[row]]
    unmasked = sample_tokens(logits, params, indices)
    assert host[5] == unmasked[5]  # a row without a mask is as it was


def test_a_state_rebuilt_from_the_tokens_so_far_masks_as_the_one_that_followed_them(model: Model) -> None:
    """What lets a decode replica, on any node, go on where a prefill replica left off with no matcher
    state sent along."""
    spec = JsonGrammar(schema=json.dumps(SCHEMA))
    followed = state(model, spec)
    generated: list[int] = []
    for token in b'{"ok": true, "tag": "green"}':
        rebuilt = state(model, spec)
        rebuilt.catch_up(generated)
        assert torch.equal(rebuilt.mask(), followed.mask())
        assert followed.mask()[token]
        followed.feed(token)
        generated.append(token)
    assert followed.finished and followed.error is None
    only = followed.mask().nonzero().flatten().tolist()
    assert only == sorted(model.eos_token_ids)  # nothing but EOS may follow


def test_a_token_outside_the_mask_puts_the_state_in_error(model: Model) -> None:
    choice = state(model, ChoiceGrammar(choices=["yes", "no"]))
    assert choice.mask().nonzero().flatten().tolist() == [ord("n"), ord("y")]
    choice.feed(ord("x"))
    assert choice.error is not None and choice.finished


def test_a_choice_is_taken_literally(model: Model) -> None:
    for text in ['a "quoted" word', "café", "back\\slash", "/not a regex/"]:
        choice = state(model, ChoiceGrammar(choices=[text, "other"]))
        choice.catch_up(list(text.encode()))
        assert choice.finished and choice.error is None, text


def test_what_does_not_compile_is_named() -> None:
    assert grammar_problem(RegexGrammar(pattern="[0-9]+")) is None
    assert "unclosed" in (grammar_problem(RegexGrammar(pattern="(ab")) or "")
    assert "not JSON" in (grammar_problem(JsonGrammar(schema="{")) or "")
    assert "foo" in (grammar_problem(JsonGrammar(schema='{"type": "foo"}')) or "")
