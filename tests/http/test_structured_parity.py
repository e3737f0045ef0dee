"""Structured outputs against transformers: a node serving a small random Llama checkpoint (a byte-level
BPE tokenizer, as SmolLM2's and Llama 3's are) answers a JSON-schema request greedily with exactly the
tokens transformers' `generate` gives when llguidance's mask for the same schema is applied to its logits
in a `LogitsProcessor` (its matcher built from transformers' own fast tokenizer), less the EOS that
transformers then generates — the node ends the request `stop` as soon as the grammar allows nothing
else.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.http.conftest import API_KEY
from tests.model.helpers import VOCAB, build_hf_model
from tests.node.harness import NodeProcess, node_process

transformers = pytest.importorskip("transformers")

EOS = 256
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}
# A few merges so that tokens span several bytes and the mask is not a byte mask.
MERGES = [("{", '"'), ('"', ":"), (",", "Ġ"), ("o", "k"), ("t", "r"), ("tr", "u"), ("f", "a"), ("fa", "l")]


def save_byte_bpe(path: Path) -> None:
    """A byte-level BPE `tokenizer.json`: the 256 bytes (ids 0-255), `</s>` (256), then `MERGES`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {char: index for index, char in enumerate(byte_chars)}
    vocab["</s>"] = EOS
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    assert len(vocab) <= VOCAB
    tokenizer = Tokenizer(models.BPE(vocab, MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("</s>", special=True)])
    tokenizer.save(str(path))


def _byte_of(char: str) -> int:
    """GPT-2's byte ↔ printable character table, inverted for one character."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}
    return table[char]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("bpe-llama")
    hf = build_hf_model("llama", directory, seed=3)
    save_byte_bpe(directory / "tokenizer.json")
    config = json.loads((directory / "config.json").read_text())
    config["eos_token_id"] = EOS
    (directory / "config.json").write_text(json.dumps(config))
    hf.generation_config.eos_token_id = EOS
    return directory, hf


@pytest.fixture(scope="module")
def node(checkpoint: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    directory, _ = checkpoint
    with node_process(
        tmp_path_factory.mktemp("node"), "--model", str(directory), "--api-key", API_KEY
    ) as served:
        yield served


def transformers_answer(checkpoint: tuple[Path, Any], prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens with llguidance's mask for `SCHEMA` applied to every step's logits."""
    import llguidance
    import llguidance.hf

    directory, hf = checkpoint
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), eos_token="</s>"
    )
    tokenizer = llguidance.hf.from_tokenizer(fast, n_vocab=VOCAB, eos_token=EOS)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA),
        defaults={"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False},
    )
    matcher = llguidance.LLMatcher(tokenizer, grammar)

    class Grammar(transformers.LogitsProcessor):  # type: ignore[misc]
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            generated = input_ids[0, len(prompt) :].tolist()
            if generated:
                assert matcher.consume_token(generated[-1]), matcher.get_error()
            bits = torch.tensor(list(matcher.compute_bitmask()), dtype=torch.uint8)
            allowed = ((bits[:, None] >> torch.arange(8)) & 1).flatten()[: scores.shape[1]].bool()
            return scores.masked_fill(~allowed, float("-inf"))

    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=max_tokens,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([Grammar()]),
            pad_token_id=EOS,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("prompt", [[5, 17, 99, 3], [200, 41, 7, 7, 12, 250, 9]])
async def test_a_json_schema_answer_equals_transformers_under_the_same_mask(
    client: openai.AsyncOpenAI, checkpoint: tuple[Path, Any], prompt: list[int]
) -> None:
    expected = transformers_answer(checkpoint, prompt, 40)
    assert expected[-1] == EOS, expected  # the grammar finished within the budget
    reply = await client.completions.create(
        model=(await client.models.list()).data[0].id,
        prompt=prompt,
        max_tokens=40,
        temperature=0,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
        },
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(checkpoint[0] / "tokenizer.json"))
    assert choice.text == fast.decode(expected[:-1])
    value = json.loads(choice.text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 999
