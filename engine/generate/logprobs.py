"""Log-probabilities between the executor's values and the wire's records (`TokenLogprob`): the control
socket's replies and the peer frames that carry a request's log-probabilities across nodes."""

from __future__ import annotations

from collections.abc import Sequence

from messages.control_replies import TokenLogprob, TopLogprob
from replicas.model import TokenLogprobs


def logprob_record(scored: TokenLogprobs) -> TokenLogprob:
    top = [TopLogprob(token_id=token, logprob=logprob) for token, logprob in scored.top]
    return TokenLogprob(token_id=scored.token_id, logprob=scored.logprob, top_logprobs=top)


def logprob_value(record: TokenLogprob) -> TokenLogprobs:
    top = tuple((alternative.token_id, alternative.logprob) for alternative in record.top_logprobs)
    return TokenLogprobs(record.token_id, record.logprob, top)


def records(scored: Sequence[TokenLogprobs]) -> list[TokenLogprob]:
    return [logprob_record(entry) for entry in scored]


def prompt_records(scored: Sequence[TokenLogprobs | None]) -> list[TokenLogprob | None]:
    return [None if entry is None else logprob_record(entry) for entry in scored]


def prompt_values(scored: Sequence[TokenLogprob | None]) -> list[TokenLogprobs | None]:
    return [None if entry is None else logprob_value(entry) for entry in scored]
