"""Hypothesis strategies for any protobuf message, built from its descriptor alone: every scalar
type with its edge values, repeated fields, maps, oneofs, nested messages and unknown enum values."""

from __future__ import annotations

import math
from collections.abc import Mapping

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor

_INT_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}
_FLOAT_EDGES = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 0.5, 2.0]
_FLOAT32_EDGES = [*_FLOAT_EDGES, 3.4028234663852886e38, -3.4028234663852886e38, 1.401298464324817e-45]
_DOUBLE_EDGES = [*_FLOAT_EDGES, 1.7976931348623157e308, -1.7976931348623157e308, 5e-324]

INTERESTING_STRINGS = [
    "",
    " ",
    "0",
    "-1",
    "a",
    "/",
    "@",
    "a/b@c",
    "..",
    "../../etc/passwd",
    "\x00",
    "\x00abc",
    "%s%n",
    "{}",
    "null",
    "127.0.0.1:0",
    "127.0.0.1:1",
    "localhost:65535",
    "[::1]:1",
    "host:",
    ":1",
    "host:port",
    "1.2.3.4:99999",
    "/dev/shm",
    "/dev/shm/",
    "/dev/shm/..",
    "/dev/shm/rlmesh-fuzz-missing",
    "/dev/shm/" + "x" * 300,
    "/etc/passwd",
    "/proc/self/mem",
    "qwen2",
    "llama",
    "qwen3",
    "gpt2",
    "é",
    "日本語",
    "🙂",
    "\u202e",
    "\ufeff",
]
"""Strings that tend to matter to servers: paths, host:port forms, ids with separators, control
and non-ASCII characters, the model families' names."""

LONG_SIZES = st.sampled_from([1_000, 100_000])
"""Long strings and bytes; messages over the servers' size limit are cases of their own."""


def integers(field_type: int) -> st.SearchStrategy[int]:
    lo, hi = _INT_RANGES[field_type]
    edges = sorted({lo, hi, 0, 1, 2, hi - 1, max(lo, -1), lo + 1})
    return st.one_of(st.sampled_from(edges), st.integers(max(lo, -4), 64), st.integers(lo, hi))


def floats(width: int) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(_FLOAT32_EDGES if width == 32 else _DOUBLE_EDGES), st.floats(width=width))


def strings() -> st.SearchStrategy[str]:
    text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=24)
    long = st.builds(lambda char, size: char * size, st.sampled_from(["a", "é", "🙂", "\x00"]), LONG_SIZES)
    return st.one_of(st.sampled_from(INTERESTING_STRINGS), text, long)


def binaries() -> st.SearchStrategy[bytes]:
    long = st.builds(
        lambda byte, size: byte * size, st.sampled_from([b"\x00", b"\xff", b"\x28\xb5\x2f\xfd"]), LONG_SIZES
    )
    return st.one_of(st.binary(max_size=64), long)


def scalars(field: FieldDescriptor) -> st.SearchStrategy:
    kind = field.type
    if kind in _INT_RANGES:
        return integers(kind)
    if kind == F.TYPE_FLOAT:
        return floats(32)
    if kind == F.TYPE_DOUBLE:
        return floats(64)
    if kind == F.TYPE_BOOL:
        return st.booleans()
    if kind == F.TYPE_STRING:
        return strings()
    if kind == F.TYPE_BYTES:
        return binaries()
    if kind == F.TYPE_ENUM:
        known = [value.number for value in field.enum_type.values]
        # Proto3 enums are open: a peer on a newer contract may send any number.
        return st.one_of(st.sampled_from(known), integers(F.TYPE_INT32))
    raise TypeError(f"{field.full_name}: no strategy for field type {kind}")


class MessageStrategies:
    """Strategies for messages of the contracts. `hints` maps a field name to values mixed into
    its generic ones (known ids, the version being pushed), so generated requests reach past the
    first lookup; `max_depth` bounds nesting and `max_items` the usual length of repeated fields."""

    def __init__(
        self, hints: Mapping[str, st.SearchStrategy] | None = None, max_depth: int = 3, max_items: int = 6
    ) -> None:
        self.hints = dict(hints or {})
        self.max_depth = max_depth
        self.max_items = max_items
        self._cache: dict[tuple[str, int], st.SearchStrategy[Message]] = {}

    def message(self, descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
        key = (descriptor.full_name, depth)
        if key not in self._cache:
            self._cache[key] = self._message(descriptor, depth)
        return self._cache[key]

    def _message(self, descriptor: Descriptor, depth: int) -> st.SearchStrategy[Message]:
        cls = message_factory.GetMessageClass(descriptor)
        plain = [f for f in descriptor.fields if f.containing_oneof is None or _synthetic(f)]
        values = {f.name: st.one_of(st.none(), self._field(f, depth)) for f in plain}
        oneofs = {
            oneof.name: st.one_of(
                st.none(), *(st.tuples(st.just(f.name), self._single(f, depth)) for f in oneof.fields)
            )
            for oneof in descriptor.oneofs
            if not _synthetic(oneof.fields[0])
        }
        return st.builds(_build, st.just(cls), st.fixed_dictionaries(values), st.fixed_dictionaries(oneofs))

    def variants(self, base: Message, depth: int = 0) -> st.SearchStrategy[Message]:
        """`base` (a valid request) with one to three of its fields replaced by generated values, a
        set nested message varied in turn: requests that get past most of the validation."""
        fields = list(base.DESCRIPTOR.fields)
        if not fields:
            return st.just(base)

        @st.composite
        def variant(draw: st.DrawFn) -> Message:
            message = type(base)()
            message.CopyFrom(base)
            for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3, unique_by=lambda f: f.name)):
                generated = self._field(field, depth)
                nested = field.type == F.TYPE_MESSAGE and not field.is_repeated and base.HasField(field.name)
                if nested and depth < self.max_depth:
                    generated = st.one_of(self.variants(getattr(base, field.name), depth + 1), generated)
                message.ClearField(field.name)
                _set(message, field, draw(generated))
            return message

        return variant()

    def _field(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy:
        if _is_map(field):
            key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            return st.dictionaries(self._single(key, depth), self._single(value, depth), max_size=self.max_items)
        if field.is_repeated:
            item = self._single(field, depth)
            lists = st.lists(item, max_size=self.max_items)
            if field.type == F.TYPE_MESSAGE:
                return lists
            # Long lists, cheap to draw: one value repeated (strings and bytes less often, as they may be long).
            sizes = st.just(100) if field.type in (F.TYPE_STRING, F.TYPE_BYTES) else st.sampled_from([100, 10_000])
            return st.one_of(lists, st.builds(lambda value, size: [value] * size, item, sizes))
        return self._single(field, depth)

    def _single(self, field: FieldDescriptor, depth: int) -> st.SearchStrategy:
        if field.type == F.TYPE_MESSAGE:
            if depth >= self.max_depth:
                return st.just(message_factory.GetMessageClass(field.message_type)())
            generic = st.deferred(lambda: self.message(field.message_type, depth + 1))
        else:
            generic = scalars(field)
        hint = self.hints.get(field.name)
        return generic if hint is None else st.one_of(hint, generic)


def _synthetic(field: FieldDescriptor) -> bool:
    """A proto3 `optional` field lives in a synthetic oneof of its own: treat it as a plain field."""
    oneof = field.containing_oneof
    return oneof is not None and len(oneof.fields) == 1 and oneof.name == f"_{field.name}"


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == F.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _build(cls: type[Message], values: dict, oneofs: dict) -> Message:
    message = cls()
    chosen = {name: value for name, value in values.items() if value is not None}
    chosen.update(choice for choice in oneofs.values() if choice is not None)
    for name, value in chosen.items():
        _set(message, cls.DESCRIPTOR.fields_by_name[name], value)
    return message


def _set(message: Message, field: FieldDescriptor, value) -> None:
    target = getattr(message, field.name) if field.type == F.TYPE_MESSAGE or field.is_repeated else None
    if _is_map(field):
        for key, item in value.items():
            if isinstance(item, Message):
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif field.is_repeated:
        target.extend(value)
    elif field.type == F.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)
