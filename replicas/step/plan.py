"""What a step holds and what it asks of the model.

`Held` is a request whose KV sits in the replica's blocks; a step's model call is one of `PrefillCall`
(any layer range, from hidden states or the prompt), `DecodeCall` or `EncodeCall`, each run by `run` on
the replica's executor or vision encoder in a worker thread. Plain values: nothing to cancel. A call
that samples takes `grammars`, row for row the request whose grammar constrains the row's token
(`replicas.step.grammar`; empty: none does); `run` masks those rows and feeds their grammars.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import numpy as np
import torch

from messages.control_replies import RelayInfo
from replicas.model import (
    DecodeResult,
    DecodeSequence,
    Executor,
    ImageEmbedding,
    PrefillResult,
    PrefillSequence,
    VisionEncoder,
)
from replicas.request import ServingRequest
from replicas.step.grammar import constrain, feed


@final
@dataclass(frozen=True, slots=True)
class Held:
    """A request whose KV sits in this replica's blocks `table` (owner: the request id).

    `relay`: set when its prefill was relayed to this replica (ZigZag): it computed the KV of layers
    `[relay.layer, L)`, and `relay.new_prefill` holds `[0, relay.layer)`."""

    request: ServingRequest
    table: list[int]
    relay: RelayInfo | None = None


@final
@dataclass(frozen=True, slots=True)
class PrefillCall:
    """`layers` (None: all) of a batch, from `hidden` (None: the prompts' embeddings); `head`: sample
    the first tokens when the range ends the model."""

    sequences: Sequence[PrefillSequence]
    layers: range | None = None
    hidden: torch.Tensor | None = None
    head: bool = True
    grammars: Sequence[ServingRequest | None] = ()

    def run(self, executor: Executor) -> PrefillResult:
        num_layers = executor.model.config.num_layers
        samples = self.head and (self.layers is None or self.layers.stop == num_layers)
        grammars = self.grammars if samples else ()
        sequences = constrain(self.sequences, grammars, executor.model) if grammars else self.sequences
        result = executor.prefill(sequences, layers=self.layers, hidden=self.hidden, head=self.head)
        if grammars and result.tokens is not None:
            feed(grammars, result.tokens)
        return result


@final
@dataclass(frozen=True, slots=True)
class DecodeCall:
    """One decode step of a batch."""

    sequences: Sequence[DecodeSequence]
    grammars: Sequence[ServingRequest | None] = ()

    def run(self, executor: Executor) -> DecodeResult:
        if not self.grammars:
            return executor.decode(self.sequences)
        result = executor.decode(constrain(self.sequences, self.grammars, executor.model))
        feed(self.grammars, result.tokens)
        return result


@final
@dataclass(frozen=True, slots=True)
class EncodeCall:
    """The vision encoder on one request's images."""

    images: Sequence[np.ndarray]

    def run(self, vision: VisionEncoder) -> list[ImageEmbedding]:
        return vision.encode(list(self.images))
