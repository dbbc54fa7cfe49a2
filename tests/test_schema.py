"""Every accepted schema form, and every SchemaError, without a model."""

from enum import Enum
from typing import Literal, TypedDict

import pytest
from pydantic import BaseModel, Field

from pcd_core import SchemaError, parse_schema


class Mood(Enum):
    GOOD = "GOOD"
    BAD = "BAD"


class Ticket(BaseModel):
    sentiment: Literal["POSITIVE", "NEUTRAL", "NEGATIVE"] = Field(description="Customer mood")
    wants_refund: bool = Field(description="Whether the customer asks for money back")
    priority: Literal[1, 2, 3]
    mood: Mood


class TicketDict(TypedDict):
    urgent: bool
    team: Literal["BILLING", "SUPPORT"]


def labels(schema, name):
    return [label.value for label in schema.field(name).labels]


def test_pydantic_fields_keep_types_descriptions_and_order():
    schema = parse_schema(Ticket)
    assert [f.name for f in schema.fields] == ["sentiment", "wants_refund", "priority", "mood"]
    assert schema.field("sentiment").description == "Customer mood"
    assert labels(schema, "wants_refund") == [True, False]
    assert labels(schema, "priority") == [1, 2, 3]
    assert labels(schema, "mood") == ["GOOD", "BAD"]
    rebuilt = schema.rebuild({"sentiment": "NEUTRAL", "wants_refund": True, "priority": 2, "mood": "BAD"})
    assert isinstance(rebuilt, Ticket) and rebuilt.mood is Mood.BAD


def test_booleans_and_numbers_have_quoted_spellings():
    schema = parse_schema(Ticket)
    assert schema.field("wants_refund").labels[0].forms == ("true", '"true"')
    assert schema.field("priority").labels[0].forms == ("1", '"1"')
    assert schema.field("sentiment").labels[0].forms == ('"POSITIVE"',)


def test_typed_dict_becomes_a_plain_dict_schema():
    schema = parse_schema(TicketDict)
    assert labels(schema, "team") == ["BILLING", "SUPPORT"]
    assert schema.rebuild({"urgent": True, "team": "BILLING"}) == {"urgent": True, "team": "BILLING"}


def test_json_schema_forms_enum_const_anyof_ref_and_null():
    schema = parse_schema(
        {
            "type": "object",
            "$defs": {"Tier": {"enum": ["GOLD", "SILVER"]}},
            "properties": {
                "flag": {"type": "boolean", "description": "a flag"},
                "tier": {"$ref": "#/$defs/Tier"},
                "size": {"anyOf": [{"const": "S"}, {"const": "L"}]},
                "maybe": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
            },
        }
    )
    assert labels(schema, "tier") == ["GOLD", "SILVER"]
    assert labels(schema, "size") == ["S", "L"]
    assert labels(schema, "maybe") == [True, False, None]


def test_optional_pydantic_field_allows_null():
    class Model(BaseModel):
        answer: Literal["A", "B"] | None = None

    assert labels(parse_schema(Model), "answer") == ["A", "B", None]


def test_field_dict_with_dependencies_makes_waves():
    schema = parse_schema(
        {
            "topic": ["BILLING", "TECH"],
            "urgent": "boolean",
            "team": {"values": ["FINANCE", "ENGINEERING"], "depends_on": ["topic"]},
            "escalate": {"type": "boolean", "depends_on": "team"},
        }
    )
    # team needs only topic, which wave 0 already wrote, so it joins wave 1
    assert schema.waves() == (("topic",), ("urgent", "team"), ("escalate",))


def test_first_field_is_decided_alone():
    schema = parse_schema({"a": "boolean", "b": "boolean", "c": "boolean"})
    assert schema.waves() == (("a",), ("b", "c"))


@pytest.mark.parametrize(
    "spec, field, reason",
    [
        ({"properties": {"note": {"type": "string"}}}, "note", "free-text"),
        ({"properties": {"count": {"type": "integer"}}}, "count", "closed set"),
        ({"properties": {"amount": {"type": "number"}}}, "amount", "closed set"),
        ({"properties": {"obj": {"type": "object"}}}, "obj", "nested objects"),
        ({"properties": {"tags": {"type": "array"}}}, "tags", "arrays"),
        ({"properties": {"empty": {"enum": []}}}, "empty", "empty"),
        ({"properties": {"twice": {"enum": ["A", "A"]}}}, "twice", "listed twice"),
        ({"properties": {"one": {"enum": ["A"]}}}, "one", "only one"),
        ({"properties": {"ref": {"$ref": "#/$defs/Missing"}}}, "ref", "cannot resolve"),
        ({"properties": {"odd": {"enum": [1.5, 2.5]}}}, "odd", "not a string"),
    ],
)
def test_open_or_broken_fields_raise_schema_error_naming_the_field(spec, field, reason):
    with pytest.raises(SchemaError, match=reason) as caught:
        parse_schema(spec)
    assert caught.value.field == field


def test_free_text_pydantic_field_is_rejected():
    class Note(BaseModel):
        text: str

    with pytest.raises(SchemaError, match="free-text"):
        parse_schema(Note)


def test_dependency_cycle_is_rejected():
    with pytest.raises(SchemaError, match="cycle"):
        parse_schema(
            {
                "a": "boolean",
                "b": {"type": "boolean", "depends_on": ["c"]},
                "c": {"type": "boolean", "depends_on": ["b"]},
            }
        )


def test_dependency_on_unknown_field_is_rejected():
    with pytest.raises(SchemaError, match="not a field"):
        parse_schema({"a": "boolean", "b": {"type": "boolean", "depends_on": ["zzz"]}})


def test_unknown_schema_type_is_rejected():
    with pytest.raises(SchemaError, match="cannot read a schema"):
        parse_schema(42)


def test_empty_schema_is_rejected():
    with pytest.raises(SchemaError):
        parse_schema({"properties": {}})
