"""What the node serves its model as: the names clients use, the context a request may fill, the chat
template, and the seeds of requests that bring none (`--served-model-name`, `--max-model-len`,
`--chat-template`, `--seed`, as vLLM has them).

`served_model(config, host)` resolves them once, at start-up, and raises `ConfigError` (one line, exit 2)
for a `--max-model-len` over the model's context or a `--chat-template` that does not read or compile.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import final

from engine.config import ConfigError, NodeConfig
from messages.control import MAX_SEED
from replicas.model import CheckpointError
from replicas.model.text.chat_template import ChatTemplate
from replicas.weights import ModelHost


@final
@dataclass(slots=True)
class ServedModel:
    """See the module docstring. `names[0]` is the name replies carry; `context` bounds every request's
    prompt + max_tokens (the model's own context, or `--max-model-len` below it)."""

    names: tuple[str, ...]
    context: int
    model_context: int
    chat_template: ChatTemplate | None
    seeds: random.Random | None = field(default=None)

    @property
    def name(self) -> str:
        return self.names[0]

    def next_seed(self) -> int:
        """The seed of a request that gives none: the next of `--seed`'s sequence, else a random one."""
        if self.seeds is None:
            return int.from_bytes(os.urandom(8), "little") >> 1
        return self.seeds.randint(0, MAX_SEED)


def served_model(config: NodeConfig, host: ModelHost) -> ServedModel:
    """The node's `ServedModel` (see the module docstring)."""
    model_context = host.config.max_position_embeddings
    context = model_context
    if config.max_model_len is not None:
        if config.max_model_len > model_context:
            raise ConfigError(
                f"--max-model-len {config.max_model_len} exceeds the context of model {host.name!r}, "
                f"{model_context} tokens (its max_position_embeddings); give at most {model_context}"
            )
        context = config.max_model_len
    template = host.chat_template
    if config.chat_template is not None:
        template = chat_template(config.chat_template, template)
    return ServedModel(
        names=tuple(config.served_model_names or [host.name]),
        context=context,
        model_context=model_context,
        chat_template=template,
        seeds=None if config.seed is None else random.Random(config.seed),
    )


def chat_template(spec: str, model_template: ChatTemplate | None) -> ChatTemplate:
    """`--chat-template`: a file's template, or `spec` itself when it holds Jinja markup (`{{` or `{%`),
    as vLLM takes it. The special tokens (`bos_token`, `eos_token`) are the model's."""
    special = {} if model_template is None else model_template.special_tokens
    if "{{" in spec or "{%" in spec:
        source, origin = spec, "--chat-template (inline)"
    else:
        path = Path(spec).expanduser()
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"--chat-template {spec!r}: cannot read the file: {reason}") from None
        origin = f"--chat-template {spec}"
    try:
        return ChatTemplate(source, special_tokens=special, origin=origin)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None
