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
        ({"properties": {"empty": {"enum": []}}}, "empty", "empty"),
        ({"properties": {"twice": {"enum": ["A", "A"]}}}, "twice", "listed twice"),
        ({"properties": {"one": {"enum": ["A"]}}}, "one", "only one"),
        ({"properties": {"ref": {"$ref": "#/$defs/Missing"}}}, "ref", "cannot resolve"),
        ({"properties": {"odd": {"enum": [1.5, 2.5]}}}, "odd", "not a string"),
        # equal after Unicode normalisation: the rule the choice questions of HTTP and MCP follow too
        ({"properties": {"wide": {"enum": ["A1", "\uff21\uff11"]}}}, "wide", "same after Unicode"),
        ({"properties": {"zw": {"enum": ["ab", "a\u200db", "c"]}}}, "zw", "same after Unicode"),
        ({"properties": {"tags": {"type": "array", "items": {"enum": ["x y", "x  y"]}}}}, "tags", "same after"),
    ],
)
def test_broken_fields_raise_schema_error_naming_the_field(spec, field, reason):
    with pytest.raises(SchemaError, match=reason) as caught:
        parse_schema(spec)
    assert caught.value.field == field


@pytest.mark.parametrize("kind", ["string", "integer", "number", "object", "array"])
def test_open_json_types_become_open_fields_with_their_schema(kind):
    schema = parse_schema({"properties": {"x": {"type": kind, "description": "d"}, "flag": {"type": "boolean"}}})
    assert [f.name for f in schema.fields] == ["flag"]
    (item,) = schema.open_fields
    assert item.name == "x" and item.value_schema["type"] == kind and item.max_new_tokens > 0
    assert schema.keys == ("x", "flag")


def test_free_text_pydantic_fields_are_open_and_refs_are_inlined():
    class Address(BaseModel):
        city: str

    class Note(BaseModel):
        text: str = Field(max_length=10)
        where: Address

    schema = parse_schema(Note)
    text, where = schema.open_fields
    assert text.max_new_tokens == 2 * 10 + 8
    assert where.value_schema["properties"]["city"]["type"] == "string" and "$ref" not in where.value_schema_json


def test_small_bounded_integers_are_closed_and_lists_of_labels_are_per_label_booleans():
    schema = parse_schema(
        {
            "properties": {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "tags": {"type": "array", "items": {"enum": ["A", "B"]}},
            }
        }
    )
    assert [label.value for label in schema.field("stars").labels] == [1, 2, 3, 4, 5]
    assert [f.member_of for f in schema.fields[1:]] == [("tags", "A"), ("tags", "B")]
    assert not schema.open_fields


def test_a_recursive_model_is_a_schema_error():
    spec = {
        "properties": {"node": {"$ref": "#/$defs/N"}},
        "$defs": {"N": {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}},
    }
    with pytest.raises(SchemaError, match="recursive"):
        parse_schema(spec)


def test_a_closed_field_cannot_depend_on_an_open_one():
    with pytest.raises(SchemaError, match="cannot depend on an open field"):
        parse_schema({"note": {"type": "string"}, "flag": {"type": "boolean", "depends_on": ["note"]}})


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


class Address(BaseModel):
    city: str
    country: str


def test_open_objects_have_exactly_their_keys_and_arrays_a_visible_bound():
    """pydantic does not forbid extra keys, and the grammar once let a model invent them until its cap."""
    from pcd_core.prompting.prompt import open_catalog_line
    from pcd_core.request.open_schema import DEFAULT_MAX_ITEMS

    class Order(BaseModel):
        ship_to: Address
        notes: list[str]
        codes: list[str] = Field(max_length=3)
        extra: dict
        stops: list[Address] | None = None

    by_name = {item.name: item.value_schema for item in parse_schema(Order).open_fields}
    ship_to = by_name["ship_to"]
    assert ship_to["additionalProperties"] is False and ship_to["required"] == ["city", "country"]
    assert by_name["notes"]["maxItems"] == DEFAULT_MAX_ITEMS and by_name["codes"]["maxItems"] == 3
    assert by_name["extra"]["additionalProperties"] is True and "required" not in by_name["extra"]
    listed = next(option for option in by_name["stops"]["anyOf"] if option.get("type") == "array")
    assert listed["maxItems"] == DEFAULT_MAX_ITEMS and listed["items"]["additionalProperties"] is False
    notes = next(item for item in parse_schema(Order).open_fields if item.name == "notes")
    assert f"a list (at most {DEFAULT_MAX_ITEMS}) of a string" in open_catalog_line(notes)


def test_an_object_that_allows_more_keys_stays_open():
    spec = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": {"type": "string"}}
    (item,) = parse_schema({"properties": {"x": spec}}).open_fields
    assert item.value_schema["additionalProperties"] == {"type": "string"} and "required" not in item.value_schema


def test_a_list_that_reaches_the_default_bound_is_named_in_a_warning():
    from pcd_core.request.open_schema import DEFAULT_MAX_ITEMS, bound_warnings, strict_schema

    spec = strict_schema({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}}})
    full = {"tags": ["t"] * DEFAULT_MAX_ITEMS}
    (warning,) = bound_warnings("meta", spec, full)
    assert "$.tags" in warning and "maxItems" in warning
    assert bound_warnings("meta", spec, {"tags": ["t"]}) == []
    chosen = strict_schema({"type": "array", "items": {"type": "string"}, "maxItems": DEFAULT_MAX_ITEMS})
    assert bound_warnings("meta", chosen, ["t"] * DEFAULT_MAX_ITEMS) == []  # the caller's own bound
