"""Hypothesis strategies for msgspec Structs, derived from their type info (bounds and patterns included).

Values drawn here satisfy every `msgspec.Meta` constraint, so a struct built from them must survive an
encode/decode round trip unchanged; structs whose `__post_init__` refuses the draw are filtered out.
"""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

from messages.control import ImageInput

_JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8)
JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def images(draw: st.DrawFn) -> ImageInput:
    width = draw(st.integers(1, 4))
    height = draw(st.integers(1, 4))
    pixels = draw(st.binary(min_size=width * height * 3, max_size=width * height * 3))
    return ImageInput(width=width, height=height, pixels=pixels)


OVERRIDES: dict[type, st.SearchStrategy[Any]] = {ImageInput: images()}


def for_type(info: mi.Type) -> st.SearchStrategy[Any]:
    match info:
        case mi.Metadata():
            return for_type(info.type)
        case mi.NoneType():
            return st.none()
        case mi.BoolType():
            return st.booleans()
        case mi.IntType():
            low = info.ge if info.ge is not None else (info.gt + 1 if info.gt is not None else -(2**63))
            high = info.le if info.le is not None else (info.lt - 1 if info.lt is not None else 2**63 - 1)
            return st.integers(low, high)
        case mi.FloatType():
            return st.floats(
                min_value=info.ge if info.ge is not None else info.gt,
                max_value=info.le if info.le is not None else info.lt,
                exclude_min=info.gt is not None,
                exclude_max=info.lt is not None,
                allow_nan=False,
                allow_infinity=False,
            )
        case mi.StrType():
            if info.pattern is not None:
                return st.from_regex(info.pattern, fullmatch=True).filter(
                    lambda text: (
                        (info.max_length is None or len(text) <= info.max_length)
                        and len(text) >= (info.min_length or 0)
                    )
                )
            return st.text(min_size=info.min_length or 0, max_size=min(info.max_length or 12, 12))
        case mi.BytesType():
            return st.binary(max_size=16)
        case mi.LiteralType():
            return st.sampled_from(info.values)
        case mi.ListType():
            return st.lists(
                for_type(info.item_type), min_size=info.min_length or 0, max_size=min(info.max_length or 3, 3)
            )
        case mi.DictType():
            return st.dictionaries(for_type(info.key_type), for_type(info.value_type), max_size=3)
        case mi.UnionType():
            return st.one_of([for_type(member) for member in info.types])
        case mi.StructType():
            return for_struct(info.cls)
        case mi.AnyType():
            return JSON_VALUES
        case _:
            raise NotImplementedError(f"no strategy for {info!r}")


def for_struct(cls: type[msgspec.Struct]) -> st.SearchStrategy[Any]:
    if cls in OVERRIDES:
        return OVERRIDES[cls]
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields = {field.name: for_type(field.type) for field in info.fields}
    return (
        st.fixed_dictionaries(fields)
        .map(lambda kwargs: _build(cls, kwargs))
        .filter(lambda value: value is not None)
    )


def _build(cls: type[msgspec.Struct], kwargs: dict[str, Any]) -> msgspec.Struct | None:
    try:
        return cls(**kwargs)
    except ValueError:
        return None
