"""The built-in `tiny` model as a real checkpoint: one safetensors file in the node's model cache.

At start-up the node writes the tiny model's decoder tensors (HF names, float32, from
`replicas.model.tiny.tiny_tensors`) into `<cache>/tiny/<seed>-c<version>/model.safetensors`, unless a
readable one is there; every tiny load then reads that file like any checkpoint, so the tiny model
moves from disk, host memory or a peer like a real one. The file is written into a temporary sibling
and renamed into place: an interrupted or concurrent write never leaves a half-written file, and a
reader holding the old file keeps reading it. The seed of the vision encoder (not part of the
checkpoint: it is rebuilt from its seed) rides in the file's metadata. Config, tokenizer and chat
template stay built in (`TINY_CONFIG`). Synchronous (the node calls it at start-up); an interrupted write
leaves at most a stray temporary file beside it, never a half-written checkpoint.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Final

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from replicas.model.checkpoint.loader import check_checkpoint
from replicas.model.errors import CheckpointError
from replicas.model.tiny import TINY_CONFIG, TINY_SEED, tiny_tensors

TINY_CHECKPOINT_VERSION: Final = 1  # bump when the file's content changes: old cache entries are ignored
TINY_FILE: Final = "model.safetensors"
_VISION_SEED: Final = "zigzag.vision_seed"


def tiny_checkpoint_dir(cache_dir: str | Path, seed: int = TINY_SEED) -> Path:
    return Path(cache_dir).expanduser() / "tiny" / f"{seed}-c{TINY_CHECKPOINT_VERSION}"


def tiny_checkpoint(cache_dir: str | Path, seed: int = TINY_SEED) -> Path:
    """The directory of the tiny model's checkpoint, written first if it is missing or unreadable.
    Raises `CheckpointError` naming the directory when it cannot be written."""
    directory = tiny_checkpoint_dir(cache_dir, seed)
    if (directory / TINY_FILE).is_file():
        try:
            check_checkpoint(directory, TINY_CONFIG)
            tiny_vision_seed(directory)
            return directory
        except CheckpointError:
            pass  # damaged (say, a disk that filled up): write it again
    tensors, vision_seed = tiny_tensors(seed)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=f".{TINY_FILE}.", dir=directory)
        os.close(handle)
        try:
            save_file(tensors, temporary, metadata={"format": "pt", _VISION_SEED: str(vision_seed)})
            os.replace(temporary, directory / TINY_FILE)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    except OSError as exc:
        raise CheckpointError(f"{directory}: cannot write the tiny model's checkpoint here: {exc}") from exc
    return directory


def tiny_vision_seed(directory: Path) -> int:
    """The vision encoder's seed recorded in the tiny checkpoint (`CheckpointError` when absent)."""
    path = directory / TINY_FILE
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
        return int(metadata[_VISION_SEED])
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: not the tiny model's checkpoint ({type(exc).__name__}: {exc})"
        ) from exc
