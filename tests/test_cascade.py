"""``Cascade`` (pcd_core/cascade.py) on the embedded model cascading to itself under another calibration.

The first engine carries a calibration that makes chosen fields abstain (a threshold above every
probability), the second reads raw: the fields that abstained, and those that depend on them, must
come back exactly as the second engine answers the smaller schema alone; the others exactly as the
first engine answered them; each says who answered, with both readings and the cost per engine.
"""

from __future__ import annotations

import asyncio

import pytest

from pcd_core import Engine
from pcd_core.cascade import Cascade, EscalationRule, Reading, Stage
from pcd_core.cascade_asking import dependants, sub_schema
from pcd_core.errors import OptionError
from pcd_core.request.schema import parse_schema
from pcd_core.result import FieldResult
from pcd_core.trust.calibration import Calibration, FieldCalibration
from pcd_core.trust.selective import NEVER

TEXT = "My card was charged twice for order 1182. Refund the duplicate today or I will dispute it."
SCHEMA = {
    "urgent": {"type": "boolean", "description": "Does it need an answer today?"},
    "sentiment": {"enum": ["angry", "calm", "happy"], "description": "How the customer feels"},
    "team": {"enum": ["billing", "shipping", "sales"], "description": "Who handles it", "depends_on": "sentiment"},
    "refund": {"type": "boolean", "description": "Does the customer ask for money back?"},
}
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "shipping": None}},
    "urgency": {"type": "score", "instructions": "How urgent is this?", "criteria": ["low", "medium", "high"]},
}


def _abstaining(names_labels: dict[str, tuple[str, ...]]) -> Calibration:
    """A calibration that leaves probabilities as read (T = 1) and makes these fields always abstain."""
    fields = {
        name: FieldCalibration(labels, 1.0, tuple(0.0 for _ in labels), abstain_below=NEVER)
        for name, labels in names_labels.items()
    }
    return Calibration("smollm2-135m", False, fields, abstain_risk=0.1, abstain_confidence=0.9)


@pytest.fixture(scope="module")
def pair(engine: Engine) -> tuple[Engine, Engine]:
    abstaining = _abstaining({"sentiment": ("angry", "calm", "happy"), "refund": ("true", "false")})
    return Engine.load("smollm2-135m", calibration=abstaining), engine


def test_a_rule_names_each_condition_that_holds():
    reading = Reading("a", 0.55, {"a": 0.55, "b": 0.45}, 0.3, True, 2)
    rule = EscalationRule(probability_below=0.6, mass_below=0.5, set_larger_than_one=True)
    assert rule.reasons("f", reading) == (
        "abstained",
        "probability 0.550 < 0.6",
        "candidate mass 0.300 < 0.5",
        "answer set of 2",
    )
    per_field = EscalationRule(per_field={"f": EscalationRule(abstained=False)})
    assert per_field.reasons("f", reading) == () and per_field.reasons("g", reading) == ("abstained",)
    with pytest.raises(OptionError, match="probability_below"):
        EscalationRule(probability_below=1.5)
    with pytest.raises(OptionError, match="later stage"):
        Cascade(object(), [])


def test_a_field_that_depends_on_an_escalated_one_goes_with_it():
    schema = parse_schema(SCHEMA)
    assert dependants(schema, {"sentiment"}) == {"sentiment", "team"}
    sub = sub_schema(schema, {"team"})
    assert [f.name for f in sub.fields] == ["team"] and sub.fields[0].depends_on == ()


def test_escalated_fields_are_the_next_engines_answers_and_the_rest_the_firsts(pair):
    first, second = pair
    cascade = Cascade(first, [Stage(second, name="smollm2-raw")], name="smollm2-abstaining")
    result = cascade.fill(SCHEMA, TEXT)
    alone_first = first.fill(SCHEMA, TEXT)
    alone_second = second.fill(sub_schema(parse_schema(SCHEMA), {"sentiment", "team", "refund"}), TEXT)
    for name in ("sentiment", "team", "refund"):
        got = result.fields[name]
        assert isinstance(got, FieldResult) and got.engine == "smollm2-raw"
        assert got.value == alone_second.fields[name].value
        assert got.probabilities == pytest.approx(alone_second.fields[name].probabilities, abs=1e-5)
        assert got.escalation is not None and got.escalation["escalated"] and got.escalation["to"] == "smollm2-raw"
        earlier, later = got.escalation["readings"]
        assert earlier["engine"] == "smollm2-abstaining" and later["engine"] == "smollm2-raw"
        assert earlier["probabilities"] == pytest.approx(alone_first.fields[name].probabilities, abs=1e-5)
    assert result.fields["sentiment"].escalation["reasons"] == ["abstained"]
    assert result.fields["team"].escalation["reasons"] == ["depends on 'sentiment'"]
    kept = result.fields["urgent"]
    assert kept.engine == "smollm2-abstaining" and kept.escalation is None
    assert kept.probabilities == pytest.approx(alone_first.fields["urgent"].probabilities, abs=1e-5)
    assert list(result.value) == list(SCHEMA) and result.value["team"] == result.fields["team"].value
    costs = {c.engine: c for c in result.stages}
    assert costs["smollm2-abstaining"].asked == 4 and costs["smollm2-raw"].asked == 3
    assert all(c.forward_passes > 0 and c.input_tokens > 0 for c in result.stages)
    assert result.stats.forward_passes == sum(c.forward_passes for c in result.stages)
    assert "cascade" in result.to_dict() and result.to_dict()["fields"]["team"]["engine"] == "smollm2-raw"


def test_nothing_to_escalate_costs_the_first_engine_only(pair):
    _, second = pair
    cascade = Cascade(second, [Stage(second, name="again")])
    result = cascade.fill(SCHEMA, TEXT)
    assert [c.engine for c in result.stages] == ["smollm2-135m"]
    assert {r.engine for r in result.fields.values()} == {"smollm2-135m"}


def test_questions_escalate_the_same_way_and_say_so_on_the_wire(pair, engine):
    abstaining = _abstaining({"team": ("billing", "shipping"), "urgency": ("0", "1", "2")})
    first = Engine.load("smollm2-135m", calibration=abstaining)
    cascade = Cascade(first, [Stage(engine, name="smollm2-raw")], name="first")
    response = cascade.decide(TEXT, QUESTIONS)
    alone = engine.decide(TEXT, {q: QUESTIONS[q] for q in ("team", "urgency")})
    for qid in ("team", "urgency"):
        got = response.answers[qid]
        assert got.engine == "smollm2-raw" and got.escalation["escalated"]
        assert got.probabilities == pytest.approx(alone.answers[qid].probabilities, abs=1e-5)
    assert response.answers["refund"].engine == "first" and response.answers["refund"].escalation is None
    wire = response.to_wire()
    assert wire["answers"]["team"]["x_engine"] == "smollm2-raw"
    assert [c["engine"] for c in wire["x_cascade"]] == ["first", "smollm2-raw"]
    assert "x_engine" not in engine.decide(TEXT, QUESTIONS).to_wire()["answers"]["team"]  # outside a cascade


def test_three_stages_send_on_only_what_the_stage_before_answered(pair, engine):
    first, second = pair
    third_rule = EscalationRule(abstained=False, probability_below=1.0)  # everything the second answered
    cascade = Cascade(first, [Stage(second, name="second"), Stage(engine, third_rule, name="third")], name="first")
    result = cascade.fill(SCHEMA, TEXT)
    assert {n: r.engine for n, r in result.fields.items()} == {
        "urgent": "first",
        "sentiment": "third",
        "team": "third",
        "refund": "third",
    }
    chain = result.fields["sentiment"].escalation
    assert chain["to"] == "third" and chain["before"]["to"] == "second"
    assert [c.engine for c in result.stages] == ["first", "second", "third"]


def test_the_many_and_async_twins_answer_as_the_single_call(pair):
    first, second = pair
    cascade = Cascade(first, [Stage(second, name="raw")], name="first")
    texts = [TEXT, "Where is my parcel? It is two weeks late."]
    many = cascade.fill_many(SCHEMA, texts)
    single = [cascade.fill(SCHEMA, t) for t in texts]
    assert [m.values for m in many] == [s.values for s in single]
    assert asyncio.run(cascade.afill(SCHEMA, TEXT)).values == single[0].values
    decided = cascade.decide_many(texts, QUESTIONS)
    assert [d.answers["team"].choice for d in decided] == [
        cascade.decide(t, QUESTIONS).answers["team"].choice for t in texts
    ]
    assert asyncio.run(cascade.adecide(TEXT, QUESTIONS)).answers["team"].engine == "first"
    assert cascade.model_name == "smollm2-135m"  # every other attribute is the first engine's


def test_a_multi_label_list_stays_with_the_first_engine(pair):
    first, second = pair
    schema = {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["angry", "calm", "happy"]},
            "tags": {"type": "array", "items": {"enum": ["refund", "shipping"]}, "uniqueItems": True},
        },
    }
    result = Cascade(first, [Stage(second, name="raw")], name="first").fill(schema, TEXT)
    assert result.fields["sentiment"].engine == "raw"
    assert result.value["tags"] == first.fill(schema, TEXT).value["tags"]
