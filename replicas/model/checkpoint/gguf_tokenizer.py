"""The tokenizer a GGUF file describes, rebuilt with the `tokenizers` library as a `tokenizer.json`.

A GGUF has no `tokenizer.json`; its `tokenizer.ggml.*` metadata holds the vocabulary (`tokens`), the
`merges`, each token's type (`token_type`: 3 = control, 4 = user-defined), the special token ids, the
`add_bos_token` / `add_eos_token` flags and the pre-tokenizer's name (`pre`). Byte-level BPE
(`tokenizer.ggml.model` = `gpt2`: GPT-2, SmolLM, Llama 3, Qwen2, ...) is rebuilt: a BPE model over the
file's vocabulary and merges, the text split as llama.cpp splits it for that `pre` name, control tokens
added as special tokens and user-defined ones as plain added tokens, a ByteLevel decoder, and BOS / EOS
added per the flags. Other tokenizer models (sentencepiece `llama`, `t5`, ...) and unknown `pre` names
are refused with `UnsupportedModelError`.
"""

from __future__ import annotations

from typing import Any, Final

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from replicas.model.checkpoint.gguf import GGUFFile
from replicas.model.errors import CheckpointError, UnsupportedModelError

CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `pre` names → how llama.cpp splits text before BPE (llama-vocab.cpp): the GPT-2 regex, the GPT-2
# regex after single digits (`\p{N}` first: SmolLM, StarCoder), or its own regex.
_GPT2: Final = "gpt2"
_DIGITS_THEN_GPT2: Final = "digits"
PRE_TOKENIZERS: Final[dict[str, str]] = {
    "default": _GPT2,
    "gpt-2": _GPT2,
    "gpt2": _GPT2,
    "mpt": _GPT2,
    "olmo": _GPT2,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "command-r": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "exaone": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
SPECIAL_TOKEN_KEYS: Final = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


def gguf_tokenizer(file: GGUFFile) -> Tokenizer:
    """The `tokenizers.Tokenizer` the file's metadata describes (see the module docstring)."""
    kind = file.string("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{file.path}: tokenizer.ggml.model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
        )
    tokens: list[str] = file.value("tokenizer.ggml.tokens")
    types: list[int] = file.value("tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens) or len(types) != len(tokens):
        raise CheckpointError(
            f"{file.path}: tokenizer.ggml.tokens has {len(tokens)} entries, {len(vocab)} distinct, "
            f"and tokenizer.ggml.token_type {len(types)}"
        )
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges(file), fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(file)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )
    tokenizer.post_processor = _post_processor(file, tokens)
    return tokenizer


def gguf_tokenizer_config(file: GGUFFile, context_length: int) -> dict[str, Any]:
    """The `tokenizer_config.json` of the file: chat template, special token strings, BOS / EOS flags."""
    tokens: list[str] = file.value("tokenizer.ggml.tokens")
    config: dict[str, Any] = {
        "add_bos_token": _flag(file, "tokenizer.ggml.add_bos_token"),
        "add_eos_token": _flag(file, "tokenizer.ggml.add_eos_token"),
        "model_max_length": context_length,
    }
    for name, key in SPECIAL_TOKEN_KEYS.items():
        token_id = file.integer(key, None)
        if token_id is not None:
            config[name] = _token(file, tokens, token_id, key)
    template = file.string("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    return config


def _merges(file: GGUFFile) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for line in file.value("tokenizer.ggml.merges", []):
        parts = str(line).split(" ")
        if len(parts) != 2:
            raise CheckpointError(f"{file.path}: tokenizer.ggml.merges entry {line!r} is not two tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _pre_tokenizer(file: GGUFFile) -> pre_tokenizers.PreTokenizer:
    name = file.string("tokenizer.ggml.pre", "default")
    split = PRE_TOKENIZERS.get(name)
    if split is None:
        raise UnsupportedModelError(
            f"{file.path}: tokenizer.ggml.pre {name!r} is not supported; known: {sorted(PRE_TOKENIZERS)}"
        )
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=split in (_GPT2, _DIGITS_THEN_GPT2)
    )
    if split == _GPT2:
        return byte_level
    if split == _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])


def _post_processor(file: GGUFFile, tokens: list[str]) -> processors.PostProcessor:
    """`$A` with BOS before and EOS after as the flags say (llama.cpp's default for BPE: no BOS)."""
    single, specials = ["$A"], []
    for flag, key, where in (
        ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id", 0),
        ("tokenizer.ggml.add_eos_token", "tokenizer.ggml.eos_token_id", 1),
    ):
        token_id = file.integer(key, None)
        if _flag(file, flag) and token_id is not None:
            token = _token(file, tokens, token_id, key)
            single.insert(0 if where == 0 else len(single), token)
            specials.append((token, token_id))
    pair = [*single, *[part if part != "$A" else "$B:1" for part in single]]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _flag(file: GGUFFile, key: str) -> bool:
    value = file.value(key, False)
    if not isinstance(value, bool):
        raise CheckpointError(f"{file.path}: metadata key {key!r} must be a boolean, got {value!r}")
    return value


def _token(file: GGUFFile, tokens: list[str], token_id: int, key: str) -> str:
    if not 0 <= token_id < len(tokens):
        raise CheckpointError(f"{file.path}: {key} {token_id} is outside the vocabulary of {len(tokens)}")
    return tokens[token_id]
