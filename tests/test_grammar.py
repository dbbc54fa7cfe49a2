"""Grammar masks for open rows on the real SmolLM2 tokenizer: llguidance does the constraining."""

import json

import numpy as np
import pytest

from pcd_core.errors import SchemaError
from pcd_core.prompting.grammar import GrammarTokenizer, RowMatcher, check_value_schema


@pytest.fixture(scope="module")
def grammar(engine):
    return GrammarTokenizer(engine.tokenizer.hf, engine.tokenizer.eos_ids)


def written(grammar, matcher, text):
    ids = grammar.encode(text)
    matcher.consume(ids)
    return ids


def test_pattern_forces_the_fixed_part_of_a_code(grammar):
    matcher = RowMatcher.start(grammar, {"type": "string", "pattern": "^TKT-[0-9]{3}$"}, ",")
    forced = grammar.decode(matcher.forced())
    assert forced == ' "TKT-'


def test_max_length_leaves_only_the_closing_quote(grammar):
    matcher = RowMatcher.start(grammar, {"type": "string", "maxLength": 3}, ",")
    written(grammar, matcher, ' "abc')
    allowed = np.flatnonzero(matcher.allowed())
    assert {grammar.decode([int(t)]) for t in allowed} <= {'"', '",'}
    assert matcher.accepts(grammar.encode('",'))


def test_integer_bounds_refuse_a_number_out_of_range(grammar):
    matcher = RowMatcher.start(grammar, {"type": "integer", "minimum": 0, "maximum": 50}, ",")
    assert matcher.accepts(grammar.encode(" 42,"))
    assert not matcher.accepts(grammar.encode(" 420,"))
    assert not matcher.accepts(grammar.encode(" -1,"))


def test_escaped_quotes_and_unicode_stay_inside_the_string(grammar):
    matcher = RowMatcher.start(grammar, {"type": "string"}, ",")
    text = " " + json.dumps('Zoë said "ça va?"', ensure_ascii=False) + ","
    assert matcher.accepts(grammar.encode(text))
    assert not matcher.accepts(grammar.encode(' "a"b",'))


def test_nested_object_keys_are_forced(grammar):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    matcher = RowMatcher.start(grammar, schema, ",")
    assert grammar.decode(matcher.forced()).startswith(' {"city')


def test_line_end_closes_the_value(grammar):
    matcher = RowMatcher.start(grammar, {"type": "boolean"}, ",\n")
    written(grammar, matcher, " true")
    assert not matcher.done
    written(grammar, matcher, ",\n")
    assert matcher.done


def test_a_schema_the_engine_cannot_compile_names_the_field(grammar):
    with pytest.raises(SchemaError, match="'code'"):
        check_value_schema("code", {"type": "string", "pattern": "(unclosed"}, grammar)


def test_decode_is_exact_bytes(grammar):
    text = ' "  two  spaces ,  "'
    assert grammar.decode(grammar.encode(text)) == text
