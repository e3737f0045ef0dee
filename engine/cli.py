"""Options of a typed config tree: flags, TOML keys and environment variables, merged and validated.

The tree is a msgspec Struct whose Struct-typed fields are *sections*; every other field is a leaf
*option*. Option ``kv.block_size`` has the TOML key ``block_size`` under ``[kv]``, the flag
``--kv-block-size`` (the section's prefix comes from a table, so ``scheduler.max_queue`` is
``--max-queue``) and the environment variable ``ZIGZAG_KV_BLOCK_SIZE``. Precedence: defaults < TOML
file < environment < flags. Values from flags and the environment are strings converted by msgspec
(``strict=False``); every error names the option, where the value came from and the value.
"""

from __future__ import annotations

import argparse
import difflib
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final, NoReturn, TypeVar, final

import msgspec
import msgspec.inspect as mi

from engine.config.address import parse_address
from engine.config.base import ConfigError, ReplicaCounts
from messages.faults import FAULT_KINDS
from replicas.emulation import parse_emulated_speed

ENV_PREFIX: Final = "ZIGZAG_"  # + the flag's name in capitals, dashes as underscores
CONFIG_ENV: Final = "ZIGZAG_CONFIG"
T = TypeVar("T", bound=msgspec.Struct)


@final
class Option(msgspec.Struct, frozen=True, kw_only=True):
    """One leaf of the tree and its three spellings."""

    path: tuple[str, ...]
    flag: str
    env: str
    toml_key: str
    type: Any
    default: Any
    description: str

    @property
    def repeatable(self) -> bool:
        return isinstance(self.type, mi.ListType)

    @property
    def boolean(self) -> bool:
        return isinstance(self.type, mi.BoolType)


def options(root: type[msgspec.Struct], prefixes: Mapping[str, str]) -> list[Option]:
    """Every leaf option of `root`, sections after top-level options, in declaration order."""
    info = mi.type_info(root)
    assert isinstance(info, mi.StructType)
    found: list[Option] = []
    sections: list[tuple[str, mi.StructType]] = []
    for field in info.fields:
        field_type, description = _unwrap(field.type)
        if isinstance(field_type, mi.StructType):
            sections.append((field.name, field_type))
        else:
            found.append(_option((field.name,), field.name, field, field_type, description))
    for section, section_type in sections:
        for field in section_type.fields:
            field_type, description = _unwrap(field.type)
            found.append(
                _option((section, field.name), prefixes[section] + field.name, field, field_type, description)
            )
    return found


def _unwrap(type_info: mi.Type) -> tuple[mi.Type, str]:
    if isinstance(type_info, mi.Metadata):
        return type_info.type, str((type_info.extra_json_schema or {}).get("description", ""))
    return type_info, ""


def _option(
    path: tuple[str, ...], name: str, field: mi.Field, field_type: mi.Type, description: str
) -> Option:
    default = field.default_factory() if field.default_factory is not mi.NODEFAULT else field.default
    repeatable = isinstance(field_type, mi.ListType)
    spelled = name.replace("_", "-").removesuffix("s" if repeatable else "")
    return Option(
        path=path,
        flag=f"--{spelled}",
        env=ENV_PREFIX + spelled.replace("-", "_").upper(),
        toml_key=".".join(path),
        type=field_type,
        default=default,
        description=description,
    )


def format_default(option: Option) -> str:
    value = option.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "none" if not value else ",".join(map(str, value))
    return str(value)


# ---------------------------------------------------------------------------------------------- parsing
@final
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")


def argument_parser(
    root: type[msgspec.Struct],
    prefixes: Mapping[str, str],
    prog: str,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> argparse.ArgumentParser:
    """The flags of every option (values kept as strings, absent flags absent from the namespace);
    `aliases`: more flags for an option, by its dotted path (another program's spelling of it)."""
    parser = _Parser(prog=prog, description=(root.__doc__ or "").strip(), argument_default=argparse.SUPPRESS)
    parser.add_argument(
        "--config", metavar="FILE.toml", help=f"read options from this TOML file (also ${CONFIG_ENV})"
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in options(root, prefixes):
        section = option.path[0] if len(option.path) > 1 else ""
        if section not in groups:
            groups[section] = parser.add_argument_group(f"[{section}] options" if section else "node options")
        default = "" if "default:" in option.description else f"default: {format_default(option)}; "
        # A repeatable option reads no environment variable (`load` skips it): its help names none.
        source = option.toml_key if option.repeatable else f"{option.toml_key}, ${option.env}"
        help_text = f"{option.description} ({default}{source})"
        help_text = help_text.replace("%", "%%")
        dest = ".".join(option.path)
        flags = [option.flag, *(aliases or {}).get(dest, ())]
        if option.boolean:
            groups[section].add_argument(
                *flags, dest=dest, action=argparse.BooleanOptionalAction, help=help_text
            )
        elif option.repeatable:
            groups[section].add_argument(*flags, dest=dest, action="append", metavar="SPEC", help=help_text)
        else:
            groups[section].add_argument(*flags, dest=dest, metavar=_metavar(option), help=help_text)
    return parser


def _metavar(option: Option) -> str:
    option_type = option.type
    if isinstance(option_type, mi.UnionType):
        option_type = next(t for t in option_type.types if not isinstance(t, mi.NoneType))
    if isinstance(option_type, mi.LiteralType):
        return "{" + ",".join(map(str, option_type.values)) + "}"
    if isinstance(option_type, mi.IntType):
        return "N"
    if isinstance(option_type, mi.FloatType):
        return "X"
    return option.path[-1].upper()


def load_config(
    root: type[T],
    prefixes: Mapping[str, str],
    argv: Sequence[str],
    environ: Mapping[str, str],
    *,
    prog: str,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> T:
    """Defaults < TOML (``--config`` or ``$ZIGZAG_CONFIG``) < environment < flags, validated into `root`."""
    known = options(root, prefixes)
    namespace = vars(argument_parser(root, prefixes, prog, aliases).parse_args(list(argv)))
    values: dict[tuple[str, ...], tuple[Any, str]] = {}
    config_path = namespace.pop("config", None) or environ.get(CONFIG_ENV)
    if config_path:
        values.update(_read_toml(config_path, known))
    for option in known:
        if option.env in environ and not option.repeatable:
            values[option.path] = (environ[option.env], f"${option.env}")
    for dest, value in namespace.items():
        option = next(o for o in known if ".".join(o.path) == dest)
        values[option.path] = (value, "the command line")
    tree: dict[str, Any] = {}
    for option in known:
        if option.path in values:
            raw, source = values[option.path]
            target = tree.setdefault(option.path[0], {}) if len(option.path) > 1 else tree
            target[option.path[-1]] = _preparse(option, raw, source)
    try:
        return msgspec.convert(tree, root, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), known, values)) from None


def _read_toml(path: str, known: list[Option]) -> dict[tuple[str, ...], tuple[Any, str]]:
    try:
        with open(path, "rb") as file:
            document = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"config file {path!r}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8; tomllib lets this through
        raise ConfigError(
            f"config file {path!r} is not valid TOML: not UTF-8 (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start})"
        ) from exc
    by_key = {option.toml_key: option for option in known}
    sections = {option.path[0] for option in known if len(option.path) > 1}
    found: dict[tuple[str, ...], tuple[Any, str]] = {}
    for key, value in document.items():
        if key in sections and isinstance(value, dict):
            items = [(f"{key}.{name}", inner) for name, inner in value.items()]
        elif key in sections and key not in by_key:
            example = next(option.toml_key for option in known if option.path[0] == key)
            raise ConfigError(
                f"config file {path!r}: {key!r} is a section, a table of options: write [{key}] and its keys "
                f"below it (e.g. {example.partition('.')[2]} = ...), not {_toml_kind(value)}"
            )
        else:
            items = [(key, value)]
        for toml_key, inner in items:
            if toml_key not in by_key:
                close = difflib.get_close_matches(toml_key, list(by_key), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"config file {path!r}: unknown option {toml_key!r}{hint}")
            found[by_key[toml_key].path] = (inner, path)
    return found


def _toml_kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "a string" if isinstance(value, str) else f"a {type(value).__name__}"


# Options given as strings that need more than a type conversion, keyed by path.
def _replicas(text: Any) -> Any:
    return parse_replica_counts(text) if isinstance(text, str) else text


def _listen(text: Any) -> Any:
    if isinstance(text, str):
        parse_address(text)
    return text


def _emulated(text: Any) -> Any:
    return msgspec.to_builtins(parse_emulated_speed(text)) if isinstance(text, str) else text


def _faults(specs: Any) -> Any:
    return [parse_fault(spec) if isinstance(spec, str) else spec for spec in specs]


_PREPARSERS: Final[dict[tuple[str, ...], Callable[[Any], Any]]] = {
    ("replicas",): _replicas,
    ("listen",): _listen,
    ("faults",): _faults,
    ("emulated_speed",): _emulated,
}


def _preparse(option: Option, raw: Any, source: str) -> Any:
    preparse = _PREPARSERS.get(option.path)
    if preparse is None:
        return raw
    try:
        return preparse(raw)
    except ValueError as exc:
        raise ConfigError(f"{_name(option)}: bad value {raw!r} from {source}: {exc}") from None


def parse_replica_counts(text: str) -> dict[str, int]:
    """``"encode=1,prefill=2,decode=1"`` → ``{"encode": 1, "prefill": 2, "decode": 1}`` (ValueError)."""
    roles = [field for field in ReplicaCounts.__struct_fields__]
    counts: dict[str, int] = {}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        role, sep, number = part.partition("=")
        role = role.strip()
        if not sep or not number.strip().isdigit():
            raise ValueError(f"{part!r} is not ROLE=COUNT (e.g. prefill=1)")
        if role not in roles:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(roles)}")
        if role in counts:
            raise ValueError(f"role {role!r} is given twice")
        counts[role] = int(number)
    if not counts:
        raise ValueError("expected ROLE=COUNT pairs, e.g. prefill=1,decode=1")
    return counts


def parse_fault(spec: str) -> dict[str, Any]:
    """``"fail_replica:replica=decode-0,after_steps=3"`` → a `messages.faults.Fault` as a dict (ValueError)."""
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; kinds are {', '.join(FAULT_KINDS)}")
    fault: dict[str, Any] = {"kind": kind}
    for part in filter(None, (piece.strip() for piece in rest.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"{part!r} is not key=value")
        fault[key.strip()] = value.strip()
    return fault


_AT_PATH: Final = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)


def _explain(text: str, known: list[Option], values: Mapping[tuple[str, ...], tuple[Any, str]]) -> str:
    """A msgspec error rewritten to name the option, the source and the value."""
    match = _AT_PATH.match(text)
    assert match is not None
    message, path = match.group("message"), match.group("path") or ""
    keys = re.findall(r"\.(\w+)", path.split("[")[0])
    for depth in (2, 1):
        option = next((o for o in known if list(o.path) == keys[:depth]), None)
        if option is not None:
            raw, source = values.get(option.path, (option.default, "the default"))
            detail = path[len("." + ".".join(option.path)) :]
            index = re.match(r"^\[(\d+)\]", detail)
            if index is not None and isinstance(raw, list) and int(index.group(1)) < len(raw):
                raw = raw[int(index.group(1))]
            where = f" (at {detail})" if detail else ""
            if isinstance(option.type, mi.LiteralType) and message.startswith("Invalid enum value"):
                message += "; choices: " + ", ".join(map(str, option.type.values))
            return f"{_name(option)}: bad value {raw!r} from {source}{where}: {message}"
    section = keys[0] if keys else ""
    given = [
        f"{o.toml_key}={values[o.path][0]!r} from {values[o.path][1]}"
        for o in known
        if o.path in values and o.path[0] == section
    ]
    context = f" (given: {'; '.join(given)})" if given else ""
    return f"[{section or 'node'}] options: {message}{context}"


def _name(option: Option) -> str:
    return f"{option.flag} ({option.toml_key})"
