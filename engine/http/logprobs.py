"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` and completions' `logprobs`.

A token's text is its id decoded alone (a piece of a multi-byte character shows as U+FFFD, as vLLM's
does; `bytes` are that text's UTF-8 bytes); a model without a tokenizer names tokens `token_id:N`, as
vLLM's `return_tokens_as_token_ids` does. The numbers are the model's raw distribution — the
log-softmax of its logits in float32, before temperature and top-p (`replicas.model.executor.logprobs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import final

from messages.openai import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob
from replicas.model import Tokenizer, TokenLogprobs

TokenText = Callable[[int], str]


def token_text(tokenizer: Tokenizer | None) -> TokenText:
    """How a token id is shown (see the module docstring)."""
    if tokenizer is None:
        return lambda token: f"token_id:{token}"
    return lambda token: tokenizer.decode([token])


def chat_logprobs(scored: Sequence[TokenLogprobs], text: TokenText) -> ChatLogprobs:
    content = []
    for entry in scored:
        token = text(entry.token_id)
        top = [
            TopLogprob(token=(alt := text(token_id)), logprob=logprob, bytes=list(alt.encode()))
            for token_id, logprob in entry.top
        ]
        content.append(
            ChatTokenLogprob(token=token, logprob=entry.logprob, bytes=list(token.encode()), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


@final
class CompletionScores:
    """Completions' `logprobs`, built piece by piece; `text_offset` counts from `offset` (the length of
    the text the choice already holds: a stream's earlier chunks)."""

    def __init__(self, text: TokenText, offset: int = 0) -> None:
        self._text = text
        self.offset = offset

    def scores(self, scored: Sequence[TokenLogprobs | None], token_ids: Sequence[int]) -> CompletionLogprobs:
        """`scored[i]` scores `token_ids[i]` (None: nothing comes before it — the prompt's first)."""
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for entry, token_id in zip(scored, token_ids, strict=True):
            token = self._text(token_id)
            tokens.append(token)
            offsets.append(self.offset)
            self.offset += len(token)
            if entry is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(entry.logprob)
            top: dict[str, float] = {}
            for alternative, logprob in entry.top:
                top.setdefault(self._text(alternative), logprob)
            tops.append(top)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
        )
