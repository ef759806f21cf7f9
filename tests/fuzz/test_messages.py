"""The request generator covers every kind of protobuf field from the descriptor alone (a field added
to a contract, such as an incarnation token, is generated with no change here), and what it makes
is what the wire carries."""

from __future__ import annotations

import math

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz.cases import oversize, unknown_fields, varint
from tests.fuzz.harness import contract_rpcs
from tests.fuzz.messages import MessageStrategies

F = descriptor_pb2.FieldDescriptorProto
SCALARS = {
    "a_double": F.TYPE_DOUBLE,
    "a_float": F.TYPE_FLOAT,
    "an_int32": F.TYPE_INT32,
    "an_int64": F.TYPE_INT64,
    "a_uint32": F.TYPE_UINT32,
    "a_uint64": F.TYPE_UINT64,
    "a_sint32": F.TYPE_SINT32,
    "a_sint64": F.TYPE_SINT64,
    "a_fixed32": F.TYPE_FIXED32,
    "a_fixed64": F.TYPE_FIXED64,
    "an_sfixed32": F.TYPE_SFIXED32,
    "an_sfixed64": F.TYPE_SFIXED64,
    "a_bool": F.TYPE_BOOL,
    "a_string": F.TYPE_STRING,
    "a_bytes": F.TYPE_BYTES,
    "incarnation_token": F.TYPE_STRING,
}


def every_kind_of_field():
    """A message type with each scalar type, a repeated field, an enum, a nested message, a map and
    a oneof, built at run time as a contract would define it."""
    file = descriptor_pb2.FileDescriptorProto(name="fuzz_kinds.proto", package="fuzzkinds", syntax="proto3")
    file.enum_type.add(name="Color").value.extend(
        [
            descriptor_pb2.EnumValueDescriptorProto(name=n, number=i)
            for i, n in enumerate(["COLOR_UNSPECIFIED", "COLOR_RED"])
        ]
    )
    inner = file.message_type.add(name="Inner")
    inner.field.add(name="value", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    outer = file.message_type.add(name="Outer")
    for number, (name, kind) in enumerate(SCALARS.items(), start=1):
        outer.field.add(name=name, number=number, type=kind, label=F.LABEL_OPTIONAL)
    outer.field.add(name="numbers", number=20, type=F.TYPE_UINT32, label=F.LABEL_REPEATED)
    outer.field.add(name="color", number=21, type=F.TYPE_ENUM, type_name=".fuzzkinds.Color", label=F.LABEL_OPTIONAL)
    outer.field.add(name="inner", number=22, type=F.TYPE_MESSAGE, type_name=".fuzzkinds.Inner", label=F.LABEL_OPTIONAL)
    entry = outer.nested_type.add(name="ScoresEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    outer.field.add(
        name="scores", number=23, type=F.TYPE_MESSAGE, type_name=".fuzzkinds.Outer.ScoresEntry", label=F.LABEL_REPEATED
    )
    outer.oneof_decl.add(name="part")
    outer.field.add(name="first", number=24, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL, oneof_index=0)
    outer.field.add(
        name="second",
        number=25,
        type=F.TYPE_MESSAGE,
        type_name=".fuzzkinds.Inner",
        label=F.LABEL_OPTIONAL,
        oneof_index=0,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("fuzzkinds.Outer"))


OUTER = every_kind_of_field()
EXAMPLES = settings(
    max_examples=400,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_every_field_gets_edge_values_and_survives_the_wire():
    seen: dict[str, set] = {
        "set": set(),
        "floats": set(),
        "colors": set(),
        "oneof": set(),
        "long": set(),
        "negative": set(),
    }

    @EXAMPLES
    @given(MessageStrategies().message(OUTER.DESCRIPTOR))
    def generate(message):
        wire = message.SerializeToString(deterministic=True)
        assert OUTER.FromString(wire).SerializeToString(deterministic=True) == wire
        seen["set"] |= {field.name for field, _ in message.ListFields()}
        seen["floats"] |= {
            "nan" if math.isnan(v) else v for v in (message.a_double, message.a_float) if math.isnan(v) or math.isinf(v)
        }
        seen["colors"].add(message.color)
        seen["oneof"].add(message.WhichOneof("part"))
        seen["long"] |= {name for name in ("a_string", "numbers") if len(getattr(message, name)) >= 1000}
        seen["negative"] |= {name for name in ("an_int64", "a_sint32", "an_sfixed64") if getattr(message, name) < 0}

    generate()
    assert seen["set"] == {f.name for f in OUTER.DESCRIPTOR.fields}
    assert {"nan", math.inf, -math.inf} <= seen["floats"]
    assert {0, 1} <= seen["colors"] and seen["colors"] - {0, 1}, "known and unknown enum values"
    assert seen["oneof"] == {None, "first", "second"}
    assert seen["long"] == {"a_string", "numbers"}
    assert seen["negative"] == {"an_int64", "a_sint32", "an_sfixed64"}


def test_variants_change_one_to_three_fields_of_a_valid_message():
    base = OUTER(a_string="valid", an_int64=7, inner={"value": 3}, numbers=[1, 2])
    changed = []

    @EXAMPLES
    @given(MessageStrategies().variants(base))
    def vary(message):
        fields = {f.name for f in OUTER.DESCRIPTOR.fields}
        differing = {name for name in fields if _wire(message, name) != _wire(base, name)}
        assert len(differing) <= 3
        changed.append(len(differing))

    vary()
    assert max(changed) >= 2 and min(changed) <= 1


def _wire(message, name: str) -> bytes:
    copy = type(message)()
    copy.CopyFrom(message)
    for other in copy.DESCRIPTOR.fields:
        if other.name != name:
            copy.ClearField(other.name)
    return copy.SerializeToString(deterministic=True)


@given(st.data())
@settings(max_examples=50, database=None, derandomize=True)
def test_unknown_fields_are_skipped_by_every_request_type(data):
    rpc = data.draw(st.sampled_from(contract_rpcs()))
    extra = data.draw(unknown_fields(rpc.request.DESCRIPTOR))
    assert not rpc.request.FromString(extra).ListFields()


def test_an_oversize_request_is_one_byte_over_the_limit_and_otherwise_valid():
    for rpc in contract_rpcs()[:3]:
        wire = oversize(rpc, 4096)
        assert len(wire.encode()) == 4097
        rpc.request.FromString(wire.encode())


def test_varint_encodes_as_protobuf_does():
    for value in (0, 1, 127, 128, 300, 2**63, 2**64 - 1):
        # positive_int_value is a uint64 field with a one-byte tag; the varint follows it.
        assert varint(value) == descriptor_pb2.UninterpretedOption(positive_int_value=value).SerializeToString()[1:]
