"""Structured outputs in a step: each constrained row's mask before the model samples, its token fed to
the grammar after.

A call that samples names, row for row, the request whose grammar constrains it (None: the row is free,
or samples nothing that is kept — a chunk that does not end its prompt). In the call's worker thread,
`constrain` gives each such row its `token_mask` from the request's `GrammarState` — built here on first
use from the spec and the tokens generated so far, so a request that arrives from another replica or
node, or through a ZigZag relay, resumes its grammar with no state sent along — and `feed` gives the
state each sampled token. `apply_tokens` then ends a request whose grammar finished (`stop`).

Invariant: only the replica holding a request runs calls on it, one at a time, so its state has one
writer; the main loop reads `finished` / `error` only after the call that wrote them returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

from messages.grammar import Grammar
from replicas.model import DecodeSequence, Model, PrefillSequence
from replicas.model.text.grammar import GrammarState, grammar_tokenizer
from replicas.request import ServingRequest

Row = TypeVar("Row", PrefillSequence, DecodeSequence)


def grammar_rows(
    requests: Sequence[ServingRequest], samples: Sequence[bool] | None = None
) -> list[ServingRequest | None]:
    """The `grammars` of a call over `requests`: each request with a grammar whose row samples a kept
    token (`samples[b]`; default: every row), None for the others; empty when no row is constrained (the
    call then costs nothing more)."""
    kept = samples if samples is not None else [True] * len(requests)
    rows = [
        r if keep and r.sampling.grammar is not None else None for r, keep in zip(requests, kept, strict=True)
    ]
    return rows if any(row is not None for row in rows) else []


def constrain(rows: Sequence[Row], grammars: Sequence[ServingRequest | None], model: Model) -> list[Row]:
    """`rows` with the mask of each constrained one (worker thread; see the module docstring). A state
    in error constrains nothing: `apply_tokens` fails its request."""
    live: list[tuple[int, GrammarState]] = []
    for row, request in enumerate(grammars):
        state = None if request is None else _state(request, model)
        if state is not None and state.error is None:
            live.append((row, state))
    out = list(rows)
    for row, state in live:
        out[row] = dataclasses.replace(rows[row], token_mask=state.mask())
    return out


def feed(grammars: Sequence[ServingRequest | None], tokens: Sequence[int]) -> None:
    """Each constrained row's sampled token to its request's grammar (worker thread)."""
    for request, token in zip(grammars, tokens, strict=True):
        if request is not None and request.grammar_state is not None:
            request.grammar_state.feed(token)


def _state(request: ServingRequest, model: Model) -> GrammarState:
    tokenizer = model.tokenizer
    assert tokenizer is not None  # admission refuses a grammar otherwise

    def start(spec: Grammar) -> GrammarState:
        vocab = grammar_tokenizer(tokenizer, model.config.vocab_size, tuple(sorted(model.eos_token_ids)))
        return GrammarState(spec, vocab)

    return request.grammar_matcher(start)
