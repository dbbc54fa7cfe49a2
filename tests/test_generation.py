"""Open fields on the real embedded model: valid by construction, generated in parallel."""

import json
import re
from typing import Literal

import numpy as np
import pytest
from pydantic import BaseModel, Field

from pcd_core import parse_schema
from pcd_core.cost import Meter
from pcd_core.errors import BackendError, GenerationError, OptionError
from pcd_core.prompting.grammar import GrammarTokenizer
from pcd_core.prompting.prompt import INSTRUCTIONS, MIXED_INSTRUCTIONS
from pcd_core.reading.generation import generate_open_fields
from pcd_core.testing import check_grow, check_grow_many, oracle_engine

TICKET = (
    "Subject: Charged twice!!\n\nHi, I was billed twice for my March invoice ($49 each). Please refund the "
    "duplicate charge within 12 hours or I will cancel. Our whole team of 12 people is affected.\n-- Dana Whitfield"
)


class Joke(BaseModel):
    """Joke to tell user."""

    setup: str = Field(description="The setup of the joke")
    punchline: str = Field(description="The punchline to the joke")
    rating: int | None = Field(default=None, description="How funny the joke is, from 1 to 10")


class Address(BaseModel):
    city: str = Field(description="City")
    country: str = Field(description="Country")


class Customer(BaseModel):
    name: str = Field(description="The customer's name", max_length=40)
    address: Address


class Mixed(BaseModel):
    sentiment: Literal["POSITIVE", "NEUTRAL", "NEGATIVE"] = Field(description="Customer mood")
    wants_refund: bool = Field(description="Whether the customer asks for money back")
    customer_name: str = Field(description="The customer's name", max_length=40)
    amount: float = Field(description="The amount charged twice, in dollars", ge=0, le=10000)
    affected_users: int = Field(description="How many people are affected", ge=0, le=100000)


def closed_part(schema):
    """The same schema without its open fields: what the closed passes cost on their own."""
    parsed = parse_schema(schema)
    properties = schema.model_json_schema()["properties"]
    return {"properties": {f.name: properties[f.name] for f in parsed.fields}}


def open_steps(result):
    """Passes each generated field needed: one per model-chosen token (forced ones cost none)."""
    return {name: f.n_tokens - f.n_forced for name, f in result.fields.items() if f.method == "generated"}


@pytest.mark.parametrize(
    ("room", "trunk"),
    [(0, ()), (3, ()), (64, ()), (0, (300, 301, 302)), (64, (300, 301, 302))],
    ids=["no room", "outgrown room", "room", "trunk", "trunk with room"],
)
def test_grow_equals_prefills_on_the_torch_backend(engine, room, trunk):
    steps = [[(5, 6, 7), (8, 9)], [(10,), (11, 12)], [(13,), ()]]
    check_grow(engine.backend, list(range(200, 260)), steps, room=room, trunk=trunk)


#: three generations after prompts of different lengths: one starts late, one sits a step out, one
#: has two rows of which one gets no token in a step
MANY_PROMPTS = [list(range(200, 260)), list(range(300, 309)), list(range(400, 431))]
MANY_STEPS = [
    [[(5,)], [(8, 9), (10,)], None],
    [[(6,)], [(11,), ()], [(20,)]],
    [None, [(), (12,)], [(21, 22)]],
    [[(7,)], [(13,), (14,)], [(23,)]],
]


def test_grow_many_reads_each_generation_as_its_own_grow_on_the_torch_backend(engine):
    check_grow_many(engine.backend, MANY_PROMPTS, MANY_STEPS)


def test_grow_many_reads_each_generation_as_its_own_grow_past_gemmas_sliding_window(gemma_engine):
    """Gemma 3's sliding-window layers take each generation's own windowed mask in a joined pass: one
    prompt is longer than the window (512), so its steps' windowed and full masks differ.
    """
    backend = gemma_engine.backend
    assert backend.window is not None and backend.window < 600
    prompts = [list(range(1000, 1600)), list(range(2000, 2040))]
    steps = [[[(5,)], [(8,), (9,)]], [[(6, 7)], [(10,), ()]], [[(11,)], None]]
    check_grow_many(backend, prompts, steps)


def test_grow_many_on_the_oracle_runs_one_grow_per_generation():
    oracle = oracle_engine()
    check_grow_many(oracle.backend, [p[:20] for p in MANY_PROMPTS], MANY_STEPS, atol=1e-9, joins=False)


def test_a_generation_writes_into_the_room_after_its_prefix_and_a_second_one_gets_its_own(engine):
    backend = engine.backend
    prefix = backend.prefill(list(range(100, 140)), room=16)
    room = prefix.state.room
    first = backend.grow(prefix, None, [(5, 6), (7,)])
    first = backend.grow(prefix, first, [(8,), (9,)])
    # the rows sit right behind the prefix in the room's own buffers: no copy of the prefix
    assert first.state.arena.keys[0].data_ptr() == room.keys[0].data_ptr()
    assert first.state.arena.offset == prefix.n_tokens
    other = backend.grow(prefix, None, [(10,), (11, 12)])  # the room is taken: an arena of its own
    assert other.state.arena.offset == 0
    assert other.state.arena.keys[0].data_ptr() != room.keys[0].data_ptr()
    for rows in (first, other):
        for i in range(2):
            want = backend.next_logp(backend.prefill(rows.ids[i], parent=prefix))
            np.testing.assert_allclose(rows.logp[i], want, atol=1e-4)


def test_a_negative_room_is_refused(engine):
    with pytest.raises(BackendError, match="room"):
        engine.backend.prefill([1, 2, 3], room=-1)


def test_a_trunk_is_read_in_the_first_step_and_refused_later(engine):
    backend = engine.backend
    prefix = backend.prefill(list(range(100, 140)))
    passes = backend.forward_passes
    rows = backend.grow(prefix, None, [(5, 6), (7,)], trunk=(40, 41), room=8)
    assert backend.forward_passes - passes == 1
    assert rows.prefix.ids == prefix.ids + (40, 41)
    want = backend.next_logp(backend.prefill([40, 41], parent=prefix))
    np.testing.assert_allclose(backend.next_logp(rows.prefix), want, atol=1e-4)
    with pytest.raises(BackendError, match="trunk"):
        backend.grow(rows.prefix, rows, [(8,), (9,)], trunk=(42,))


def test_grow_equals_prefills_on_the_oracle():
    oracle = oracle_engine()
    check_grow(oracle.backend, list(range(1, 30)), [[(5, 6), (7,)], [(8,), (9, 10)]], atol=1e-9)
    # the base class reads a trunk through score, in the first step's pass
    check_grow(oracle.backend, list(range(1, 30)), [[(5, 6), (7,)], [(8,), (9, 10)]], atol=1e-9, trunk=(3, 4))


def test_joke_schema_fills_valid(engine):
    result = engine.fill(Joke, "Tell me a joke about cats.")
    assert isinstance(result.value, Joke)
    for name in ("setup", "punchline", "rating"):
        field = result.fields[name]
        assert field.method == "generated"
        assert json.loads(field.text) == field.value
        assert field.n_tokens >= 1 and field.logp_sum <= 0 and 0 < field.mean_probability <= 1
    assert result.value.setup.strip()
    # the object is built from the generated texts, field by field (pydantic guarantees the types, not this)
    assert result.value.model_dump() == {
        name: json.loads(result.fields[name].text) for name in ("setup", "punchline", "rating")
    }


def test_mixed_schema_decides_closed_and_writes_open_fields(engine):
    result = engine.fill(Mixed, TICKET)
    assert result.fields["sentiment"].method == "trie"
    assert set(result.fields["sentiment"].probabilities) == {"POSITIVE", "NEUTRAL", "NEGATIVE"}
    assert result.value.customer_name == "Dana Whitfield"
    assert result.value.amount == 49
    assert 0 <= result.value.affected_users <= 100000
    assert list(result.fields) == list(Mixed.model_fields)


def test_pass_count_is_the_longest_open_row_not_the_sum(engine):
    closed = closed_part(Mixed)
    engine.warmup(closed)
    engine.warmup(Mixed)
    base = engine.fill(closed, TICKET).stats.forward_passes
    result = engine.fill(Mixed, TICKET)
    steps = open_steps(result)
    assert result.stats.open_steps == max(steps.values())
    # the first step also writes the closed answers in, as the trunk the open rows hang from
    assert result.stats.forward_passes == base + max(steps.values())
    assert result.stats.forward_passes < base + sum(steps.values())
    assert result.stats.output_tokens == sum(result.fields[n].n_tokens for n in steps)


def test_parallel_rows_equal_each_field_generated_alone(engine):
    compiled = engine.compile(Mixed)
    prefix = engine.backend.prefill(engine.request_ids(compiled, TICKET))
    grammar = GrammarTokenizer(engine.tokenizer.hf, engine.tokenizer.eos_ids)
    together, _ = generate_open_fields(engine.backend, grammar, prefix, compiled.open_rows, compiled.schema, Meter())
    for spec in compiled.open_rows:
        alone, _ = generate_open_fields(engine.backend, grammar, prefix, (spec,), compiled.schema, Meter())
        assert alone[spec.field.name].text == together[spec.field.name].text
        assert alone[spec.field.name].logp_sum == pytest.approx(together[spec.field.name].logp_sum, abs=1e-3)


def test_nested_model_is_generated_with_its_keys(engine):
    result = engine.fill(Customer, "Order from Lena Novak, Graz, Austria. Please ship fast.")
    # the nested object is the generated text (not a default or a re-generation); its keys are the model's
    assert result.value.address.model_dump() == json.loads(result.fields["address"].text)
    assert set(json.loads(result.fields["address"].text)) == {"city", "country"}


def test_list_of_strings_respects_max_items(engine):
    schema = {"properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 2}}}
    result = engine.fill(schema, TICKET)
    tags = result.value["tags"]
    assert isinstance(tags, list) and len(tags) <= 2 and all(isinstance(t, str) and len(t) <= 20 for t in tags)


def test_string_bounds_and_pattern_hold(engine):
    schema = {
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$", "description": "A ticket code"},
            "short": {"type": "string", "maxLength": 12, "minLength": 2, "description": "A short title"},
        }
    }
    result = engine.fill(schema, "Ticket ABC-123: the printer is on fire again, please send help.")
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{3}", result.value["code"])
    assert 2 <= len(result.value["short"]) <= 12


def test_number_bounds_hold(engine):
    schema = {
        "properties": {
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100, "description": "The year"},
            "share": {"type": "number", "minimum": 0, "maximum": 1, "description": "Share, from 0 to 1"},
        }
    }
    result = engine.fill(schema, "In 2031 about 40% of the fleet was electric.")
    assert 1900 <= result.value["year"] <= 2100
    assert 0 <= result.value["share"] <= 1


def test_optional_fields_are_null_or_valid(engine):
    schema = {"properties": {"nickname": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]}}}
    result = engine.fill(schema, "Robert, known to friends as Bobby, called about his invoice.")
    value = result.value["nickname"]
    assert value is None or (isinstance(value, str) and len(value) <= 20)


def test_open_field_with_depends_on_waits_one_wave(engine):
    schema = {
        "properties": {
            "summary": {"type": "string", "maxLength": 60, "description": "One-line summary"},
            "title": {"type": "string", "maxLength": 24, "description": "A title", "depends_on": ["summary"]},
        }
    }
    engine.warmup(schema)
    result = engine.fill(schema, TICKET)
    summary, title = result.fields["summary"], result.fields["title"]
    assert (summary.wave, title.wave) == (0, 1)
    steps = open_steps(result)
    # request prefill, summary's steps, then title's steps, the first reading summary's line as its trunk
    assert result.stats.forward_passes == 1 + steps["summary"] + steps["title"]


def test_unicode_and_quotes_survive_generation(engine):
    schema = {"properties": {"quote": {"type": "string", "maxLength": 60, "description": "His exact words"}}}
    result = engine.fill(schema, 'Zoë wrote: "Le café était «froid»", then left.')
    field = result.fields["quote"]
    assert json.loads(field.text) == field.value == result.value["quote"]


def test_only_open_fields_skip_the_closed_passes(engine):
    schema = {"properties": {"name": {"type": "string", "maxLength": 30, "description": "The customer's name"}}}
    engine.warmup(schema)
    result = engine.fill(schema, TICKET)
    assert result.stats.forward_passes == 1 + result.stats.open_steps
    assert result.stats.n_rows == 0


def test_closed_only_schemas_keep_their_prompt_and_cost(engine):
    compiled = engine.compile(closed_part(Mixed))
    assert INSTRUCTIONS in compiled.prompt.head and MIXED_INSTRUCTIONS not in compiled.prompt.head
    assert not compiled.open_rows
    result = engine.fill(closed_part(Mixed), TICKET)
    assert result.stats.open_steps == 0 and result.stats.output_tokens == 0
    assert MIXED_INSTRUCTIONS in engine.compile(Mixed).prompt.head


def test_a_cap_closes_a_string_with_a_warning(engine):
    result = engine.fill(Joke, "Tell me a joke about cats.", max_new_tokens={"setup": 3})
    assert result.fields["setup"].n_tokens <= 3 + 2
    assert any("setup" in w and "max_new_tokens" in w for w in result.warnings)
    assert isinstance(result.value, Joke)


def test_a_cap_that_cannot_close_raises(engine):
    schema = {"properties": {"year": {"type": "integer", "minimum": 1000, "maximum": 9999}}}
    with pytest.raises(GenerationError, match="max_new_tokens"):
        engine.fill(schema, "It happened in 1987.", max_new_tokens={"year": 1})


class Topics(BaseModel):
    topics: list[Literal["BILLING", "OUTAGE", "SECURITY"]] = Field(description="Every topic the ticket raises")
    summary: str = Field(max_length=80, description="One-line summary")


def test_a_list_of_enums_is_decided_label_by_label(engine):
    result = engine.fill(Topics, "I was billed twice for March and your API has been down since this morning.")
    topics = result.fields["topics"]
    assert topics.method == "multi-label"
    assert set(topics.memberships) == {"BILLING", "OUTAGE", "SECURITY"}
    member = topics.members["topics: BILLING"]
    assert topics.memberships["BILLING"] == member.probabilities["true"]
    assert result.value.topics == [label for label, p in topics.memberships.items() if p >= 0.5]
    assert isinstance(result.value, Topics)


def test_multi_label_keys_are_listed_per_label_in_the_catalog(engine):
    head = engine.compile(Topics).prompt.head
    assert head.index('"topics: BILLING"') < head.index('"topics: SECURITY"') < head.index('"summary"')


def test_growing_an_older_state_twice_forks_it_without_corrupting_either(engine):
    backend = engine.backend
    prefix = backend.prefill(list(range(100, 140)))
    start = backend.grow(prefix, None, [(5, 6), (7,)])
    first = backend.grow(prefix, start, [(8,), (9,)])
    second = backend.grow(prefix, start, [(10,), (11,)])  # start is no longer the arena's latest
    third = backend.grow(prefix, first, [(12,), (13,)])
    for rows in (first, second, third):
        for i in range(2):
            want = backend.next_logp(backend.prefill(rows.ids[i], parent=prefix))
            np.testing.assert_allclose(rows.logp[i], want, atol=1e-4)


class Letter(BaseModel):
    customer_name: str = Field(max_length=40)
    address: Address


LETTER = (
    "Subject: Charged twice!!\n\nHi, I was billed twice for my March invoice ($49 each). Please refund the "
    "duplicate charge within 12 hours or I will cancel. -- Dana Whitfield, 12 Rue de la Paix, Lyon, France"
)


def test_a_nested_model_has_exactly_its_keys_in_bounded_steps(engine):
    """An ordinary ``Address(BaseModel)`` does not forbid extra keys, and the grammar once let SmolLM2 go on
    (``{"city": "Lyon", "country": "Lyon", "street_address": "1234567890", "street_address_street_name": ...``
    to a cap of 64 here). Now every key is forced and the object closes after the last.
    """
    result = engine.fill(Letter, LETTER)
    address = result.fields["address"]
    assert list(json.loads(address.text)) == ["city", "country"]
    assert isinstance(result.value.address, Address)
    assert not result.warnings
    # the keys and the punctuation are forced: the model chooses only the two strings' tokens
    assert address.n_tokens - address.n_forced <= 2 * 12 and result.stats.open_steps <= 30


def test_a_cap_error_carries_the_text_written_and_its_cause(engine):
    with pytest.raises(GenerationError) as caught:
        engine.fill(Letter, LETTER, max_new_tokens={"address": 6})
    error = caught.value
    assert (error.field, error.cause) == ("address", "max_new_tokens")
    assert error.text.startswith('{"city": "') and repr(error.text) in str(error)


def test_a_misspelt_cap_is_an_option_error_before_any_pass(engine):
    passes = engine.backend.forward_passes
    with pytest.raises(OptionError, match=r"'nmae'.*did you mean 'name'\?.*open fields: 'name'"):
        engine.fill({"properties": {"name": {"type": "string", "maxLength": 20}}}, "Bob", max_new_tokens={"nmae": 4})
    with pytest.raises(OptionError, match="positive integer"):
        engine.fill({"properties": {"name": {"type": "string", "maxLength": 20}}}, "Bob", max_new_tokens={"name": 0})
    assert engine.backend.forward_passes == passes
