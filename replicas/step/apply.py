"""Applying a step's result, the same for every role: tokens appended and streamed, stops checked, the
blocks of finished requests freed; a refused call fails its requests.

`apply_tokens(items, tokens, ...)` gives each held request its sampled token (and its log-probability,
where the step scored it) — a prefill's first token
(`first`: the prefill's end and the first token are logged) or a decode step's next one — and ends the
requests that a stop token, `max_tokens` or the context ends, or that were cancelled meanwhile (no token
then). An ended request's blocks go back through `release` before it finishes, so a client that hears
of the end finds the blocks free. It returns the items that go on (to a decode replica, or to the next
step), in order. `refuse(items, ...)` does the same for a call the model refused before writing anything
(`ModelInputError`): every request fails with the role's code.

A request whose grammar finished (nothing but EOS may follow) ends `stop`; one whose output left its
grammar fails (`internal`).

Invariant: each item is released exactly once, by whichever of the two ends it, or kept by the caller.
Runs in the replica's main loop; nothing here waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from messages.control import ErrorCode
from messages.log.events import FirstToken, PrefillFinished
from replicas.model import TokenLogprobs, finish_reason
from replicas.ports import EventSink
from replicas.step.plan import Held


def apply_tokens(
    items: Sequence[Held],
    tokens: Sequence[int],
    *,
    context_length: int,
    release: Callable[[Held], None],
    log: EventSink,
    first: bool = False,
    logprobs: Sequence[TokenLogprobs | None] | None = None,
) -> list[Held]:
    """See the module docstring."""
    now = time.time()
    going_on: list[Held] = []
    scores = logprobs if logprobs is not None else [None] * len(tokens)
    for item, token, scored in zip(items, tokens, scores, strict=True):
        request = item.request
        request_log = log.bind(request_id=request.request_id)
        if first:
            request.stamp("prefill_finished", now)
            started = request.stamps.prefill_started or now
            request_log.emit(PrefillFinished(tokens=request.prompt_tokens, seconds=now - started))
        if request.cancelled:
            release(item)
            request.finish("cancelled")
            continue
        request.add_token(token, scored)
        if first:
            request_log.emit(FirstToken(token_id=token, ttft_s=now - request.stamps.arrived))
        reason = finish_reason(request.generated, request.sampling, request.eos_token_ids, request.max_tokens)
        grammar = request.grammar_state
        if grammar is not None and grammar.error is not None:
            release(item)
            request.fail("internal", f"the output left its grammar: {grammar.error}")
            continue
        if reason is None and grammar is not None and grammar.finished:
            reason = "stop"
        if reason is None and request.context_tokens + 1 > context_length:
            reason = "length"
        if reason is not None:
            release(item)
            request.finish(reason)
            continue
        going_on.append(item)
    return going_on


def refuse(
    items: Sequence[Held],
    *,
    code: ErrorCode,
    message: str,
    release: Callable[[Held], None],
    cancel_wins: bool = False,
) -> None:
    """See the module docstring: the model refused the step's inputs (or, for a relayed batch, its
    relay failed); `message` says why. `cancel_wins`: a cancelled request finishes `cancelled`."""
    for item in items:
        release(item)
        if cancel_wins and item.request.cancelled:
            item.request.finish("cancelled")
        else:
            item.request.fail(code, message)
