"""How much work the router offers a NewPrefill replica (architecture §8, docs/zigzag.md): its spare compute.

During an episode the OldPrefill partner is the bottleneck — it computes every prompt's layers the
NewPrefill lacks, its own prompts whole — so every prompt should reach it through the NewPrefill, having
run the layers the NewPrefill holds, as long as the NewPrefill keeps up: a prompt waiting there goes
further as more layers land, one waiting at the router does not. A NewPrefill keeps up while the work it
has yet to do — each queued prompt through the `loaded` layers, each held batch from the layer it
reached to `loaded` — is at most one batch (`budget` prompt tokens) through those layers; a batch that
reached `loaded` waits for the partner and costs it nothing. With no layer landed it has nothing to
compute (the input embeddings only): it takes every prompt up to a batch in its queue, each batch then
advancing as the layers land.
"""

from __future__ import annotations

from collections.abc import Iterable


def prompt_room(*, budget: int, loaded: int, queued_tokens: int, batches: Iterable[tuple[int, int]]) -> int:
    """The longest prompt a NewPrefill takes now (negative: none), pure: `budget` prompt tokens a batch,
    `loaded` layers landed, `queued_tokens` queued and not in a batch, `batches` the held batches as
    `(prompt tokens, layer reached)` (−1: not embedded yet). The room is `budget` less the queued tokens
    and less each batch's tokens weighted by the share of the loaded layers it has yet to run; never more
    than `budget`, a prompt longer than a batch running whole on a serving replica."""
    behind = sum(tokens * max(0, loaded - max(reached, 0)) for tokens, reached in batches)
    return budget - queued_tokens - -(-behind // max(loaded, 1))
