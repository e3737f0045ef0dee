"""Tokenizers: HF `tokenizer.json` through the `tokenizers` library, and the tiny model's byte tokenizer.

Both satisfy `Tokenizer`. `TextStream` turns a growing list of token ids into text deltas that never
split a UTF-8 character (a delta is held back while the decoded tail is an incomplete character).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, final

from tokenizers import Tokenizer as HFTokenizerImpl

from replicas.model.errors import CheckpointError, TokenIdError

REPLACEMENT_CHARACTER = "\ufffd"


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


@final
class ByteTokenizer:
    """Ids 0–255 are bytes; then `<bos>`, `<eos>`, `<image>` (one per image patch row), `<pad>`.

    `encode` prepends `<bos>` (unless `add_special_tokens=False`); `decode` drops the special ids and
    decodes the bytes as UTF-8 with replacement characters for invalid sequences.
    """

    BOS = 256
    EOS = 257
    IMAGE = 258
    PAD = 259
    SPECIALS = ("<bos>", "<eos>", "<image>", "<pad>")

    def __init__(self, vocab_size: int = 260) -> None:
        if vocab_size < 256 + len(self.SPECIALS):
            raise ValueError(f"a byte tokenizer needs a vocabulary of at least 260, got {vocab_size}")
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        prefix = [self.BOS] if add_special_tokens else []
        return [*prefix, *text.encode("utf-8")]

    def decode(self, token_ids: Sequence[int]) -> str:
        for token in token_ids:
            if not 0 <= token < self._vocab_size:
                raise TokenIdError(f"token id {token} outside the vocabulary [0, {self._vocab_size})")
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")


@final
class HFTokenizer:
    """A `tokenizer.json` read with the `tokenizers` library (special tokens added as its post-processor says)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        try:
            self._impl = HFTokenizerImpl.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exception, re-raised as ours
            raise CheckpointError(f"{path}: not a readable tokenizer.json: {exc}") from exc
        self.path = path

    @property
    def vocab_size(self) -> int:
        return int(self._impl.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._impl.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        for token in token_ids:
            if token < 0:
                raise TokenIdError(f"token id {token} is negative")
        return str(self._impl.decode(list(token_ids), skip_special_tokens=True))

    def json_text(self) -> str:
        """The tokenizer as `tokenizer.json` text (what llguidance reads)."""
        return str(self._impl.to_str())

    def token_id(self, token: str) -> int | None:
        found = self._impl.token_to_id(token)
        return None if found is None else int(found)


@final
class TextStream:
    """Incremental detokenisation: `push(ids)` returns the new text, never half a UTF-8 character.

    Decodes only a short window (from the previous emission's start), so a long generation costs
    O(tokens), not O(tokens²).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        new_text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHARACTER):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def finish(self) -> str:
        """Whatever is left, incomplete characters shown as U+FFFD."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        new_text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]
