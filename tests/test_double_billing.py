"""The seven-field double-billing ticket, on SmolLM2-135M.

Every field is reported (``pytest -s`` prints them). SmolLM2-135M is a very small model: it reads the
topic, the refund request and the routing right, and these are asserted; it also leans toward the
first listed value on mood, plan and spam, and those are only reported (with the probability it
gives the right answer), since asserting a wrong answer would freeze a model's mistake.
"""

import json
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCHEMA = json.loads((EXAMPLES / "ticket_schema.json").read_text())
TICKET = (EXAMPLES / "ticket.txt").read_text()
RIGHT = {
    "sentiment": "NEGATIVE",
    "topic": "BILLING",
    "wants_refund": True,
    "is_spam": False,
    "deadline": "12_HOURS",
    "plan": "PREMIUM",
    "route_to": "BILLING_TEAM",
}


@pytest.fixture(scope="module")
def result(engine):
    return engine.fill(SCHEMA, TICKET)


def test_every_field_is_reported(result):
    for name, right in RIGHT.items():
        field = result.fields[name]
        key = right if isinstance(right, str) else json.dumps(right)
        print(
            f"{name:14} {field.value!s:14} p={field.probability:.3f} mass={field.candidate_mass:.3f} "
            f"p(right={key})={field.probabilities[key]:.3f}"
        )
    assert list(result.values) == list(RIGHT)


@pytest.mark.parametrize("name", ["topic", "wants_refund", "route_to"])
def test_the_model_gets_these_right(result, name):
    assert result.values[name] == RIGHT[name]
    assert result.fields[name].probability > 0.6


def test_the_deadline_follows_the_shared_1_branch(result):
    # 1_HOUR and 12_HOURS share the token "1": both must get mass through the branch
    probabilities = result.fields["deadline"].probabilities
    assert probabilities["1_HOUR"] > 0.01 and probabilities["12_HOURS"] > 0.01
    assert probabilities["1_HOUR"] + probabilities["12_HOURS"] > probabilities["NONE"]


def test_a_warm_repeat_is_identical_and_costs_two_passes(engine, result):
    again = engine.fill(SCHEMA, TICKET)
    assert again.values == result.values
    assert again.stats.forward_passes == 2
