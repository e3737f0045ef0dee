"""A `Model` assembled piece by piece in checkpoint order, as the checkpoint loader does.

`ModelBuilder.add(piece, tensors)` takes a piece's checkpoint tensors (full HF names, any dtype, any
device), checks names and shapes, converts them to the model's dtype and device and installs them: the
embeddings create the `Model` (usable from then on for the layers it has: `Model.loaded_layers`), each
layer is fused (`replicas.model.layers.fuse_layer`) and set, the final norm is set, and the head — the
embeddings when tied — completes it. The builder keeps the tensors it is given where no conversion is
needed: a caller that must not share them passes copies (`replicas.loading.sources`).

A tied output head that the model packs (`Model.pack_tied_head`) is a reorder of the whole embedding
table: `head_ahead()` makes it as soon as the embeddings landed — a copy runs it in a worker thread
while the layers move (`replicas.loading.copy`) — and the norm piece installs it as made; without it
the norm piece makes it then (`Model.set_head`).

Not thread-safe: one thread adds at a time (a copy adds in worker threads, one after another); a
reader on another thread sees each piece either absent or complete. Synchronous, so nothing here is
cancelled half-way: a cancelled copy stops between pieces (`replicas.loading.copy`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import final

import torch

from messages.weights import WeightPiece
from replicas.loading.pieces import checkpoint_pieces, piece_shapes, relative
from replicas.model.config import ModelConfig
from replicas.model.errors import WeightShapeError
from replicas.model.layers import LayerWeights, fuse_layer
from replicas.model.linear import Kernels, Linear
from replicas.model.llama import Model
from replicas.model.text.tokenizer import Tokenizer
from replicas.model.vision import VisionConfig, VisionEncoder
from transport.memory.storage import torch_dtype


@final
@dataclass(frozen=True, slots=True)
class ModelFrame:
    """What a `Model` is besides its weights: config (its dtype is the serving dtype), device, name,
    tokenizer, end-of-sequence ids, the seed of its vision encoder (None: it has none), kernels,
    whether it runs the batch-invariant kernels (then its weights are plain: `kernels` is ignored), and
    whether a tied head is packed (`Model.pack_tied_head`)."""

    config: ModelConfig
    device: torch.device
    name: str
    tokenizer: Tokenizer | None = None
    eos_token_ids: tuple[int, ...] = ()
    vision_seed: int | None = None
    kernels: Kernels = "auto"
    batch_invariant: bool = False
    pack_tied_head: bool = True

    @property
    def weight_kernels(self) -> Kernels:
        return "plain" if self.batch_invariant else self.kernels


@final
class ModelBuilder:
    """See the module docstring. `model` is None until the embeddings landed."""

    def __init__(self, frame: ModelFrame, *, pack_later: bool = False) -> None:
        self.frame = frame
        # A replica's own copy installs its layers plain; the replica packs them once the copy is done
        # (`replicas.model.layers.packed_layer`), so no reorder sits on the copy's path.
        self.layer_kernels: Kernels = "plain" if pack_later else frame.weight_kernels
        self.dtype = torch_dtype(frame.config.dtype)
        self.pieces = checkpoint_pieces(frame.config)
        self.landed = 0
        self.model: Model | None = None
        self._head: Linear | None = None  # a tied head made ahead (`head_ahead`)

    @property
    def next_piece(self) -> WeightPiece | None:
        return self.pieces[self.landed] if self.landed < len(self.pieces) else None

    @property
    def done(self) -> bool:
        return self.landed == len(self.pieces)

    def head_ahead(self) -> None:
        """Make the tied output head now, from the landed embeddings, when the model packs it (a reorder
        of the table: a worker thread's call, run before the norm piece is added, never beside it)."""
        model = self._model()
        if self.frame.config.tie_word_embeddings and model.pack_tied_head and self._head is None:
            self._head = Linear(model.embed_tokens, None, kernels=model.kernels)

    def add(self, piece: WeightPiece, tensors: Mapping[str, torch.Tensor] | LayerWeights) -> Model:
        """Install `piece` (it must be the next one); returns the model. A layer may come already fused
        (`LayerWeights` in this model's dtype, device and kernels' layout: installed as it is). Raises
        `WeightShapeError` naming a missing, extra or misshapen tensor."""
        if piece != self.next_piece:
            expected = "nothing (the model is complete)" if self.done else self.pieces[self.landed].label
            raise ValueError(f"{self.frame.name}: {piece.label} landed, expected {expected}")
        if isinstance(tensors, LayerWeights):
            assert piece.kind == "layer" and piece.layer is not None
            self._model().set_layer(piece.layer, tensors)
            self.landed += 1
            return self._model()
        self._check(piece, tensors)
        match piece.kind:
            case "embeddings":
                self.model = self._create(self._place(next(iter(tensors.values()))))
            case "layer":
                assert piece.layer is not None
                layer = {relative(piece, name): tensor for name, tensor in tensors.items()}
                weights = fuse_layer(layer, self.dtype, self.frame.device, kernels=self.layer_kernels)
                self._model().set_layer(piece.layer, weights)
            case "norm":
                model = self._model()
                norm = self._place(next(iter(tensors.values())))
                if self.frame.config.tie_word_embeddings and self._head is not None:
                    # What `set_head` installs for a packed tied head, made ahead from the same table.
                    model.final_norm, model.lm_head, self._head = norm, self._head, None
                elif self.frame.config.tie_word_embeddings:
                    model.set_head(norm, model.embed_tokens)
                else:
                    model.final_norm = norm  # counted from now on; the head piece completes the output
            case "head":
                model = self._model()
                assert model.final_norm is not None
                model.set_head(model.final_norm, self._place(next(iter(tensors.values()))))
        self.landed += 1
        return self._model()

    def _check(self, piece: WeightPiece, tensors: Mapping[str, torch.Tensor]) -> None:
        shapes = piece_shapes(self.frame.config, piece)
        if set(tensors) != set(shapes):
            missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
            raise WeightShapeError(
                f"{self.frame.name} {piece.label}: missing tensors {missing}, extra {extra}"
            )
        for name, shape in shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise WeightShapeError(
                    f"{self.frame.name}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                    f"the config implies {list(shape)}"
                )

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=self.frame.device, dtype=self.dtype).contiguous()

    def _model(self) -> Model:
        assert self.model is not None, "the embeddings come first"
        return self.model

    def _create(self, embed_tokens: torch.Tensor) -> Model:
        frame, config = self.frame, self.frame.config
        vision = None
        if frame.vision_seed is not None and config.image_token_id is not None:
            vision = VisionEncoder(
                VisionConfig(out_hidden=config.hidden_size, seed=frame.vision_seed),
                image_token_id=config.image_token_id,
                device=frame.device,
            )
        return Model(
            config,
            device=frame.device,
            embed_tokens=embed_tokens,
            tokenizer=frame.tokenizer,
            vision=vision,
            eos_token_ids=frame.eos_token_ids,
            name=frame.name,
            kernels=frame.weight_kernels,
            batch_invariant=frame.batch_invariant,
            pack_tied_head=frame.pack_tied_head,
        )
