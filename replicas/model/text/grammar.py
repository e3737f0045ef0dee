"""Structured outputs with llguidance: a request's `Grammar` compiled, checked and matched token by token.

- `compile_grammar(spec)` turns the spec (`messages.grammar`) into llguidance's grammar text;
  `grammar_problem` says why one does not compile (None when it does) — the node asks before it admits
  a request.
- `grammar_tokenizer(tokenizer, vocab_size, eos_token_ids)` is the model's tokenizer as llguidance sees it: a
  `tokenizer.json` (`HFTokenizer`, GGUF files included) is handed over as its JSON text, the tiny model's
  byte tokenizer through `llguidance.TokenizerWrapper`. Built once per tokenizer (about 0.3 s for
  SmolLM2's 49152 tokens) and cached.
- `GrammarState` matches one request's output. It is rebuilt wherever the request is sampled, from the
  spec and the tokens generated so far (`catch_up`), so it never crosses a process: a prefill replica,
  a decode replica on another node and a ZigZag relay partner each build their own, and agree because a
  matcher's state is a function of the tokens it consumed.

Invariants: `GrammarState.consumed` tokens of the request's `generated` were fed to the matcher, in order;
`mask()` is the allowed set for the token after them — a bool `[vocab_size]` tensor, True = allowed, EOS
allowed exactly where the grammar accepts; `finished` once the grammar allows nothing but EOS (the
request then ends `stop`). A matcher that is fed a token its mask did not allow goes into an error state
(`error`) and stays there; so does one whose grammar the matcher refused. Thread safety: one state is
used by one thread at a time (the holder's compute call); the tokenizer cache is safe to share.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, assert_never, final

import llguidance
import numpy as np
import torch

from messages.grammar import ChoiceGrammar, Grammar, JsonGrammar, LarkGrammar, RegexGrammar
from replicas.model.text.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON's layout as OpenAI's models write it, `{"a": 1, "b": [2, 3]}`, and no other whitespace: a free
# run of whitespace is where small models loop until `max_tokens`. A schema's `x-guidance` overrides it.
_JSON_OPTIONS: JsonCompileOptions = {
    "item_separator": ", ",
    "key_separator": ": ",
    "whitespace_flexible": False,
}


def compile_grammar(spec: Grammar) -> str:
    """llguidance's grammar text for `spec`. Raises ValueError for a JSON schema that is not JSON."""
    match spec:
        case JsonGrammar(schema=schema):
            any_object: dict[str, Any] = {"type": "object"}
            return llguidance.LLMatcher.grammar_from_json_schema(
                any_object if schema is None else schema, defaults=_JSON_OPTIONS
            )
        case RegexGrammar(pattern=pattern):
            return llguidance.LLMatcher.grammar_from_regex(pattern)
        case ChoiceGrammar(choices=choices):
            alternatives = " | ".join(json.dumps(choice) for choice in choices)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        case LarkGrammar(grammar=grammar):
            return llguidance.LLMatcher.grammar_from_lark(grammar)
        case _:
            assert_never(spec)


def grammar_name(spec: Grammar) -> str:
    """What `spec` is, in words: `JSON schema`, `regex`, `choice`, `grammar`."""
    match spec:
        case JsonGrammar():
            return "JSON schema"
        case RegexGrammar():
            return "regex"
        case ChoiceGrammar():
            return "choice"
        case LarkGrammar():
            return "grammar"
        case _:
            assert_never(spec)


def supports_grammars(tokenizer: Tokenizer | None) -> bool:
    """Whether `grammar_tokenizer` takes `tokenizer`."""
    return isinstance(tokenizer, HFTokenizer | ByteTokenizer)


def grammar_problem(spec: Grammar) -> str | None:
    """Why `spec` does not compile, in llguidance's words (None: it does). No tokenizer needed."""
    if isinstance(spec, JsonGrammar) and spec.schema is not None:
        try:
            schema = json.loads(spec.schema)
        except json.JSONDecodeError as exc:
            return f"the JSON schema is not JSON: {exc}"
        if not isinstance(schema, dict | bool):
            return f"a JSON schema is an object (or true/false), not {type(schema).__name__}"
    try:
        text = compile_grammar(spec)
    except ValueError as exc:
        return str(exc)
    problem = llguidance.LLMatcher.validate_grammar(text)
    return problem.strip() or None


_BUILT: weakref.WeakKeyDictionary[Tokenizer, dict[tuple[int, tuple[int, ...]], llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_BUILDING = threading.Lock()


def grammar_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]
) -> llguidance.LLTokenizer:
    """`tokenizer` for llguidance, over the model's `vocab_size` (the logits' width); `eos_token_ids`
    are what a finished grammar allows. Built once per tokenizer object and kept while it lives (a lock:
    the replicas of a node share one model, and its tokenizer). Raises ValueError for a tokenizer it
    cannot take."""
    with _BUILDING:
        built = _BUILT.setdefault(tokenizer, {})
        key = (vocab_size, eos_token_ids)
        if key not in built:
            built[key] = _build(tokenizer, vocab_size, list(eos_token_ids))
        return built[key]


def _build(tokenizer: Tokenizer, vocab_size: int, eos: list[int]) -> llguidance.LLTokenizer:
    if isinstance(tokenizer, HFTokenizer):
        return llguidance.LLTokenizer(tokenizer.json_text(), n_vocab=vocab_size, eos_token=eos or None)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer, vocab_size)),
            n_vocab=vocab_size,
            eos_token=eos,
        )
    raise ValueError(f"structured outputs do not support a {type(tokenizer).__name__}")


@final
class _ByteVocabulary:
    """The byte tokenizer in the shape `llguidance.TokenizerWrapper` reads: each id's bytes, the special
    ids, and a function from text to ids."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int) -> None:
        specials = [name.encode() for name in ByteTokenizer.SPECIALS]
        padding = [f"<unused{i}>".encode() for i in range(vocab_size - 256 - len(specials))]
        self.tokens: list[bytes] = [bytes([b]) for b in range(256)] + specials + padding
        self.special_token_ids = list(range(256, vocab_size))
        self.eos_token_id = ByteTokenizer.EOS
        self.bos_token_id = ByteTokenizer.BOS
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


@final
class GrammarState:
    """The matcher of one request's output (see the module docstring)."""

    def __init__(self, spec: Grammar, tokenizer: llguidance.LLTokenizer) -> None:
        self.spec = spec
        self.vocab_size = tokenizer.vocab_size
        self._matcher = llguidance.LLMatcher(tokenizer, compile_grammar(spec), log_level=0)
        self.consumed = 0

    @property
    def finished(self) -> bool:
        """Nothing but EOS may follow (or the matcher failed: `error` says why)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error().splitlines()[0] if self._matcher.is_error() else None

    def catch_up(self, generated: Sequence[int]) -> None:
        """Feed the tokens of `generated` past `consumed` (all of them for a state just built)."""
        if len(generated) > self.consumed:
            self._matcher.consume_tokens(list(generated[self.consumed :]))
            self.consumed = len(generated)

    def feed(self, token: int) -> None:
        """Feed one sampled token (the one after the `consumed` ones)."""
        self._matcher.consume_token(token)
        self.consumed += 1

    def mask(self) -> torch.Tensor:
        """The tokens allowed next: bool `[vocab_size]`, True = allowed (see the module docstring)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(np.bool_))
