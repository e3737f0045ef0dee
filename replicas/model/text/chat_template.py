"""Chat templates: a checkpoint's Jinja `chat_template` rendered the way transformers'
`apply_chat_template(..., tokenize=False)` renders it, byte for byte.

The template comes from `chat_template.jinja` or `tokenizer_config.json` (`chat_template`: a string,
or a list of `{name, template}` of which `default` is used) — a converted GGUF file's is written
there from `tokenizer.chat_template`. Templates are untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment` with transformers' settings — `trim_blocks`, `lstrip_blocks`, the
`loopcontrols` extension, a no-op `{% generation %}` block, the `tojson` filter as transformers defines
it (no HTML escaping, `ensure_ascii=False`), the globals `raise_exception`, `strftime_now`, a `dict`
and a `namespace` that refuse underscore names — and see `messages` (`None` values dropped, reasoning
aliased to `reasoning_content` / `thinking` as transformers does), `tools`, `documents`,
`add_generation_prompt` and the special token strings (`bos_token`, `eos_token`, `unk_token`,
`pad_token`, ...). A template that calls `raise_exception` — or fails on the conversation it was given —
raises `ChatTemplateError` (a `ModelInputError`: the node answers `bad_request`); one that does not
compile raises `CheckpointError` at load.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Final, NoReturn, final

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from replicas.model.errors import CheckpointError, ModelInputError

SPECIAL_TOKEN_NAMES: Final = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_FIELDS: Final = ("reasoning_content", "thinking", "reasoning")


@final
class ChatTemplateError(ModelInputError):
    """The chat template refused the conversation (`raise_exception`) or failed while rendering it."""


@final
class ChatTemplate:
    """A compiled chat template and the special token strings it may refer to."""

    def __init__(
        self, source: str, *, special_tokens: Mapping[str, str] | None = None, origin: str = "chat template"
    ) -> None:
        self.source = source
        self.origin = origin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise CheckpointError(f"{origin}: not a valid Jinja template (line {exc.lineno}): {exc}") from exc

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """The prompt text for `messages` (dicts with `role` and `content`, as OpenAI's API sends them)."""
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation: give at least one message")
        chat = [_message(message, index) for index, message in enumerate(messages)]
        context = {**self.special_tokens, **_plain(variables)}
        try:
            return self._template.render(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as exc:  # raise_exception, undefined names, sandbox refusals
            raise ChatTemplateError(f"{self.origin}: {exc.message or type(exc).__name__}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
            raise ChatTemplateError(f"{self.origin}: failed on this conversation: {exc!r}") from exc


def checkpoint_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The chat template of a checkpoint directory (None when it has none)."""
    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            loaded = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{config_path}: not readable as JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise CheckpointError(f"{config_path}: expected a JSON object")
        config = loaded
    special = {
        name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None
    }
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            source = jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{jinja_path}: not readable: {exc}") from exc
        return ChatTemplate(source, special_tokens=special, origin=str(jinja_path))
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise CheckpointError(f"{config_path}: chat_template must be a string, got {type(template).__name__}")
    return ChatTemplate(template, special_tokens=special, origin=f"{config_path} (chat_template)")


# ---------------------------------------------------------------------- the environment


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@final
class _TemplateDict:
    """`dict(...)` in a template, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` refusing underscore-prefixed attributes (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
        )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 declares it a plain set attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment


# ---------------------------------------------------------------------- what the template sees


def _message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"message {index} must be an object with role and content, got {message!r}")
    plain = {str(key): _plain(value) for key, value in message.items() if value is not None}
    reasoning = next((plain[key] for key in _REASONING_FIELDS if plain.get(key) is not None), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _plain(value: Any) -> Any:
    """Only JSON-like data reaches the sandbox (anything else becomes a placeholder naming its type)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


def _token_text(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` spells it: a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None
