"""The wire codec: typed dataclass messages <-> msgpack bytes.

Every message is a dataclass registered with a one-byte-ish tag. On the wire it is

    [tag, PROTOCOL_VERSION, field_0, field_1, ...]

with nested message dataclasses written the same way minus tag and version (their type is known from
the field's annotation). Only msgpack's plain types ever cross a socket: decoding builds dataclasses from
lists of numbers and strings, so a socket can never be a way to run code (no pickle anywhere).
"""

from __future__ import annotations

import dataclasses
import operator
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

PROTOCOL_VERSION = 1

T = TypeVar("T")

_BY_TAG: dict[int, type] = {}
_DECODERS: dict[type, Callable[[list], Any]] = {}
_ENCODERS: dict[type, Callable[[Any], list | tuple]] = {}


class WireError(ValueError):
    """A message that is not ours: unknown tag, other protocol version, or wrong shape."""


def message(tag: int) -> Callable[[type[T]], type[T]]:
    """Register a dataclass as a top-level message with a unique tag."""

    def register(cls: type[T]) -> type[T]:
        if tag in _BY_TAG:
            raise ValueError(f"tag {tag} is used by both {_BY_TAG[tag].__name__} and {cls.__name__}")
        cls.TAG = tag  # type: ignore[attr-defined]
        _BY_TAG[tag] = cls
        return cls

    return register


def encode(msg: Any) -> bytes:
    return msgpack.packb([msg.TAG, PROTOCOL_VERSION, *_encoder_for(type(msg))(msg)], use_bin_type=True)


def decode(data: bytes) -> Any:
    raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(raw, list) or len(raw) < 2:
        raise WireError("a message must be a list [tag, version, fields...]")
    tag, version = raw[0], raw[1]
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version} received, {PROTOCOL_VERSION} expected")
    cls = _BY_TAG.get(tag)
    if cls is None:
        raise WireError(f"unknown message tag {tag}")
    return _decoder_for(cls)(raw[2:])


def _encoder_for(cls: type) -> Callable[[Any], list | tuple]:
    """Build (once per class) a function instance -> list of wire values, nested dataclasses as lists.
    Plans and token batches carry hundreds of items per step: the per-field work is decided here, not per value.
    One C call (attrgetter) reads every field as a tuple, which msgpack writes as the same array a list would
    be; only the nested dataclass fields, usually None (a token's logprobs), are then converted one by one."""
    cached = _ENCODERS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    nested: list[tuple[int, Callable[[Any], Any]]] = []  # (field index, converter of a value that is not None)
    for index, name in enumerate(names):
        annotation, args = hints[name], typing.get_args(hints[name])
        inner = [a for a in args if a is not type(None)]
        if dataclasses.is_dataclass(annotation):
            nested.append((index, _on_first_use(_encoder_for, annotation)))
        elif (
            typing.get_origin(annotation) in (typing.Union, types.UnionType)
            and len(inner) == 1
            and dataclasses.is_dataclass(inner[0])
        ):
            nested.append((index, _on_first_use(_encoder_for, inner[0])))
        elif typing.get_origin(annotation) is list and args and dataclasses.is_dataclass(args[0]):
            nested.append((index, _lazy_list_encoder(args[0])))

    read_fields = operator.attrgetter(*names)
    encoder: Callable[[Any], list | tuple]
    if len(names) == 1:  # attrgetter of one name returns the value itself, not a 1-tuple

        def encoder(obj: Any) -> list | tuple:
            value = read_fields(obj)
            return [value if not nested or value is None else nested[0][1](value)]

    elif not nested:
        encoder = read_fields
    else:

        def encoder(obj: Any) -> list | tuple:
            values = read_fields(obj)
            converted = None
            for index, convert in nested:
                value = values[index]
                if value is not None:
                    if converted is None:
                        converted = list(values)
                    converted[index] = convert(value)
            return values if converted is None else converted

    _ENCODERS[cls] = encoder
    return encoder


def _lazy_list_encoder(cls: Any) -> Callable[[list], list]:
    """Encodes a list of `cls`: the item encoder is looked up once per list, not per item (hundreds per plan)."""

    def encode_list(values: list) -> list:
        item = _encoder_for(cls)
        return [item(v) for v in values]

    return encode_list


def _decoder_for(cls: type) -> Callable[[list], Any]:
    """Build (once per class) a function list -> instance, converting nested dataclass fields."""
    cached = _DECODERS.get(cls)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    converters = [_converter_for(hints[f.name]) for f in fields]
    num_fields = len(converters)

    # The fields that hold dataclasses (their values mostly None); the rest are msgpack's values as they are.
    nested = [(i, conv) for i, conv in enumerate(converters) if conv is not None]

    def decoder(values: list) -> Any:
        if not isinstance(values, list) or len(values) != num_fields:
            raise WireError(f"{cls.__name__} expects a list of {num_fields} fields, got {values!r:.80}")
        for index, conv in nested:
            if values[index] is not None:
                values[index] = conv(values[index])
        return cls(*values)

    _DECODERS[cls] = decoder
    return decoder


def _converter_for(annotation: Any) -> Callable[[Any], Any] | None:
    """None when the msgpack value can be used as is; else a function that rebuilds the field."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        return _on_first_use(_decoder_for, annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            conv = _converter_for(inner[0])
            return None if conv is None else (lambda v: None if v is None else conv(v))
        return None
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return _lazy_list_decoder(args[0])
    return None


def _lazy_list_decoder(cls: Any) -> Callable[[list], list]:
    """Decodes a list of `cls`: the item decoder is looked up once, on first use, not per item."""
    resolved: list[Callable[[list], Any]] = []

    def decode_list(values: list) -> list:
        if not resolved:
            resolved.append(_decoder_for(cls))
        item = resolved[0]
        return [item(v) for v in values]

    return decode_list


def _on_first_use(build: Callable[[Any], Callable[[Any], Any]], cls: Any) -> Callable[[Any], Any]:
    """`build(cls)` (the encoder or the decoder of a nested class), built on first use: a nested class may be
    defined after its container."""
    resolved: list[Callable[[Any], Any]] = []

    def convert(value: Any) -> Any:
        if not resolved:
            resolved.append(build(cls))
        return resolved[0](value)

    return convert
