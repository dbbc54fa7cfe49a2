"""Every bundled schema fills on both embedded models: complete, schema-valid, each value its field's most
probable label, and the same reading whether the input is filled alone or in a batch."""

import json

import pytest
from conftest import load_case, schema_cases

CASES = schema_cases()


def assert_valid(result, schema):
    properties = schema["properties"]
    assert list(result.values) == list(properties)
    for name, spec in properties.items():
        value = result.values[name]
        if spec.get("type") == "boolean":
            assert value is True or value is False, name
        else:
            assert value in spec["enum"], name
        field = result.fields[name]
        assert 0.0 <= field.candidate_mass <= 1.0 + 1e-9
        assert sum(field.probabilities.values()) == pytest.approx(1.0, abs=1e-9)
        assert 0.0 <= field.confidence <= 1.0
        best = max(field.probabilities, key=field.probabilities.__getitem__)
        assert field.probability == pytest.approx(field.probabilities[best], abs=1e-9), name
        assert json.dumps(value) == best or str(value) == best or str(value).lower() == best.lower(), (name, best)


@pytest.mark.parametrize("name", CASES)
def test_schema_fills_on_smollm2(engine, name):
    case = load_case(name)
    result = engine.fill(case["json_schema"], case["input"])
    assert_valid(result, case["json_schema"])
    # the batched read path (one pass per wave for the group) gives this input the same reading
    (batched,) = engine.fill_many(case["json_schema"], [case["input"]])
    assert batched.values == result.values
    for name, field in result.fields.items():
        for label, p in field.probabilities.items():
            assert batched.fields[name].probabilities[label] == pytest.approx(p, abs=1e-4), (name, label)


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_schema_fills_on_gemma3_without_a_chat_template(gemma_engine, name):
    assert not gemma_engine.tokenizer.chat_template
    case = load_case(name)
    result = gemma_engine.fill(case["json_schema"], case["input"])
    assert_valid(result, case["json_schema"])
    assert gemma_engine.compile(case["json_schema"]).prompt.layout == "plain"
