"""The exact exceptions of the model executor.

Two families: `CheckpointError` and its relatives describe a model that cannot be loaded (the file or
value is named in the message); `ModelInputError` and its subclasses describe a request the model cannot
run (a token id, an image size, a length) — the node maps the latter to `bad_request`.
"""

from __future__ import annotations

from typing import final


class ModelError(Exception):
    """Base of every error the executor raises on purpose."""


class ModelLoadError(ModelError):
    """The model cannot be built from what was given."""


@final
class CheckpointError(ModelLoadError):
    """A checkpoint file is missing, unreadable, or lacks a tensor (the message names the file)."""


@final
class UnsupportedModelError(ModelLoadError):
    """The checkpoint is readable but describes something zigzag does not run (architecture, rope type)."""


@final
class WeightShapeError(ModelLoadError):
    """A tensor's shape disagrees with what `config.json` implies (names tensor, file and both shapes)."""


@final
class KernelsUnavailableError(ModelLoadError):
    """A batch-invariant model on a device where its kernels do not run or fail their check (the
    message says why); without them its output would depend on the batch."""


class ModelInputError(ModelError):
    """A request the model cannot run as given."""


@final
class TokenIdError(ModelInputError):
    """A token id outside `[0, vocab_size)`."""


@final
class ImageSizeError(ModelInputError):
    """An image that is not RGB uint8 `[H, W, 3]` with `H` and `W` positive multiples of the patch size."""


@final
class ContextLengthError(ModelInputError):
    """A sequence longer than the model's context, or than the blocks its block table holds."""


@final
class InvalidBatchError(ModelInputError):
    """Inconsistent inputs: mismatched lengths, a wrong hidden-state shape, a layer range out of bounds."""
