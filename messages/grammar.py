"""A request's output grammar: what structured outputs constrain the generated text to.

`Grammar` is a tagged union (tag field `type`) that travels with a request's sampling parameters
wherever they go — the control socket's `generate`, a request snapshot sent to another node — and is
nothing but the spec: the state of matching it is rebuilt on each replica that samples, from the spec
and the tokens generated so far (`replicas.model.text.grammar`), so no matcher state ever crosses a
process. Bounds only here; whether a schema, regex or grammar compiles is checked by the node before
the request is admitted (a `bad_request` naming why).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from messages.base import Message

MAX_GRAMMAR_CHARS = 1 << 20  # a JSON schema, a regex or a Lark grammar, as text
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096

GrammarText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)]


class JsonGrammar(Message, frozen=True, tag="json"):
    """A JSON value: one that validates against `schema` (a JSON Schema, as JSON text), or any JSON
    object when `schema` is None (OpenAI's `json_object`)."""

    schema: GrammarText | None = None


class RegexGrammar(Message, frozen=True, tag="regex"):
    """Text that matches `pattern` in full (Rust regex syntax, as vLLM's `regex`)."""

    pattern: GrammarText


class ChoiceGrammar(Message, frozen=True, tag="choice"):
    """Exactly one of `choices`."""

    choices: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CHOICE_CHARS)]],
        msgspec.Meta(min_length=1, max_length=MAX_CHOICES),
    ]


class LarkGrammar(Message, frozen=True, tag="grammar"):
    """Text the context-free grammar `grammar` derives (llguidance's Lark dialect; `start` is the
    start rule)."""

    grammar: GrammarText


Grammar = JsonGrammar | RegexGrammar | ChoiceGrammar | LarkGrammar
