"""``Cascade.fill_many`` / ``decide_many`` (pcd_core/cascade_batch.py) on the embedded model cascading to itself.

Each input of a batch must come back as its own ``fill`` / ``decide`` through the cascade: the same
values, engines and escalation records, probabilities to 1e-5 (an ``Engine``'s batch against its solo
calls); and each later stage must be called once per distinct sub-schema (or question subset) it is
asked, counted by a thin ``Engine`` subclass that records every call it takes. A stage that refuses some inputs (its limits) leaves those inputs'
first answers, marked, and the others escalated; a stage that refuses all leaves every input's; a
stage without ``fill_many`` / ``decide_many`` is asked one input at a time, with the same answers.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from test_cascade import QUESTIONS, SCHEMA

from pcd_core import Engine
from pcd_core.cascade import Cascade, EscalationRule, Stage
from pcd_core.request.limits import Limits
from pcd_core.request.schema import parse_schema
from pcd_core.result import FieldResult

#: an Engine's batch gives each input its solo call's probabilities to 1e-5 (tests/test_batching.py:
#: a wider pass rounds differently in fp32); measured here up to 1.1e-6
TOL = 1e-5
TEXTS = [
    "My card was charged twice for order 1182. Refund the duplicate today or I will dispute it.",
    "Where is my parcel? It is two weeks late.",
    "Thanks, the new plan works great and your team was very helpful.",
    "I would like a quote for fifty licences before Friday.",
    "The app crashes every time I open the billing page. Please fix it.",
]
#: below these top probabilities a field or question goes on: the embedded model is unsure of a
#: different set in each text (its top probabilities on SCHEMA lie between 0.51 and 0.83, on QUESTIONS
#: between 0.43 and 0.81), so a batch's inputs ask a later stage several distinct sets of names
FILL_RULE = EscalationRule(abstained=False, probability_below=0.55)
DECIDE_RULE = EscalationRule(abstained=False, probability_below=0.75)
THIRD = EscalationRule(abstained=False, probability_below=0.6)
RULES = (FILL_RULE, DECIDE_RULE)


class Counted(Engine):
    """The embedded model as a later stage, recording each call it takes: (method, names asked, inputs)."""

    def __init__(self, engine: Engine, **settings: Any) -> None:
        super().__init__(engine.backend, engine.tokenizer, engine.model_name, **settings)
        self.calls: list[tuple[str, tuple[str, ...], int]] = []

    def fill(self, schema: Any, text: str, **keywords: Any) -> Any:
        self.calls.append(("fill", tuple(f.name for f in parse_schema(schema).fields), 1))
        return super().fill(schema, text, **keywords)

    def fill_many(self, schema: Any, texts: list[str], **keywords: Any) -> Any:
        self.calls.append(("fill_many", tuple(f.name for f in parse_schema(schema).fields), len(texts)))
        return super().fill_many(schema, texts, **keywords)

    def decide(self, state: Any, questions: dict[str, Any], **keywords: Any) -> Any:
        self.calls.append(("decide", tuple(questions), 1))
        return super().decide(state, questions, **keywords)

    def decide_many(self, states: Any, questions: dict[str, Any], **keywords: Any) -> Any:
        self.calls.append(("decide_many", tuple(questions), len(states)))
        return super().decide_many(states, questions, **keywords)


class OneAtATime:
    """A stage with ``fill`` and ``decide`` alone (as a user's own engine may be): the embedded model's."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.model_name = engine, "one-at-a-time"

    def fill(self, schema: Any, text: str, **keywords: Any) -> Any:
        return self.engine.fill(schema, text, **keywords)

    def decide(self, state: Any, questions: dict[str, Any], **keywords: Any) -> Any:
        return self.engine.decide(state, questions, **keywords)


def assert_close(expected: Any, got: Any, where: tuple[Any, ...] = ()) -> None:
    """Numbers within ``TOL``, everything else equal, through dicts and lists."""
    if isinstance(expected, float):
        assert abs(got - expected) <= TOL, (where, got, expected)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key, value in expected.items():
            assert_close(value, got[key], (*where, key))
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected), where
        for k, (a, b) in enumerate(zip(expected, got)):
            assert_close(a, b, (*where, k))
    else:
        assert got == expected, where


def assert_same_fill(single: Any, batched: Any) -> None:
    assert batched.values == single.values
    assert list(batched.fields) == list(single.fields)
    for name, expected in single.fields.items():
        got = batched.fields[name]
        assert isinstance(got, FieldResult) and isinstance(expected, FieldResult)
        assert (got.value, got.engine) == (expected.value, expected.engine), name
        assert_close(dict(expected.probabilities), dict(got.probabilities), (name,))
        assert_close(expected.escalation, got.escalation, (name, "escalation"))
    assert [(c.engine, c.asked, c.error is None) for c in batched.stages] == [
        (c.engine, c.asked, c.error is None) for c in single.stages
    ]


def assert_same_decide(single: Any, batched: Any) -> None:
    assert list(batched.answers) == list(single.answers)
    for qid, expected in single.answers.items():
        got = batched.answers[qid]
        assert type(got) is type(expected) and got.engine == expected.engine, qid
        for key in ("choice", "score", "noul", "probabilities", "escalation"):
            assert_close(getattr(expected, key, None), getattr(got, key, None), (qid, key))
    assert [(c.engine, c.asked) for c in batched.stages] == [(c.engine, c.asked) for c in single.stages]


def asked_of(found: Any, stage: str) -> bool:
    """Whether ``stage`` was asked this field or question (a record to it in its escalation chain)."""
    record = found.escalation
    while record:
        if record["to"] == stage:
            return True
        record = record.get("before")
    return False


def expected_calls(results: list[Any], stage: str, method: str) -> Counter:
    """One call of ``method`` per distinct set of names the inputs asked ``stage``, over its inputs."""
    groups: Counter = Counter()
    for result in results:
        answers = result.fields if hasattr(result, "fields") else result.answers
        names = tuple(name for name, found in answers.items() if asked_of(found, stage))
        if names:
            groups[names] += 1
    return Counter({(method, names, n): 1 for names, n in groups.items()})


@pytest.fixture(scope="module")
def stages(engine: Engine) -> tuple[Counted, Counted]:
    return Counted(engine), Counted(engine)


def test_fill_many_equals_each_fill_and_asks_each_stage_once_per_sub_schema(engine, stages):
    second, third = stages
    cascade = Cascade(
        engine, [Stage(second, FILL_RULE, name="second"), Stage(third, THIRD, name="third")], name="first"
    )
    single = [cascade.fill(SCHEMA, text) for text in TEXTS]
    second.calls.clear(), third.calls.clear()
    batched = cascade.fill_many(SCHEMA, TEXTS)
    for one, many in zip(single, batched):
        assert_same_fill(one, many)
    to_second = expected_calls(single, "second", "fill_many")
    to_third = expected_calls(single, "third", "fill_many")
    # the setting this test needs: several sub-schemas at the second stage, and a third stage asked
    assert len(to_second) >= 2 and sum(n for _, _, n in to_second) > len(to_second) and to_third
    assert Counter(second.calls) == to_second and Counter(third.calls) == to_third  # never a fill per input
    costs = {c.engine: c for c in batched[0].stages}
    assert costs["second"].forward_passes > 0 and costs["second"].input_tokens > 0


def test_decide_many_equals_each_decide_and_asks_each_stage_once_per_question_subset(engine, stages):
    second, _ = stages
    cascade = Cascade(engine, [Stage(second, DECIDE_RULE, name="second")], name="first")
    single = [cascade.decide(text, QUESTIONS) for text in TEXTS]
    second.calls.clear()
    batched = cascade.decide_many(TEXTS, QUESTIONS)
    for one, many in zip(single, batched):
        assert_same_decide(one, many)
    to_second = expected_calls(single, "second", "decide_many")
    assert len(to_second) >= 2
    assert Counter(second.calls) == to_second


def test_a_stage_that_refuses_some_inputs_leaves_theirs_marked_and_answers_the_rest(engine):
    limit = 60  # bytes: the short texts fit, the longer ones are over the stage's limit
    assert {len(t.encode()) <= limit for t in TEXTS} == {True, False}
    short = Counted(engine, limits=Limits(max_text_bytes=limit))
    everything = EscalationRule(abstained=False, probability_below=1.0)
    cascade = Cascade(engine, [Stage(short, everything, name="short")], name="first")
    batched = cascade.fill_many(SCHEMA, TEXTS)  # no exception
    alone = engine.fill_many(SCHEMA, TEXTS)
    for text, result, first in zip(TEXTS, batched, alone):
        assert_same_fill(cascade.fill(SCHEMA, text), result)
        refused = len(text.encode()) > limit
        for name, found in result.fields.items():
            assert found.escalation["to"] == "short" and found.escalation["escalated"] is not refused
            if refused:
                assert found.engine == "first" and found.escalation["error"].startswith("LimitError")
                assert_close(dict(first.fields[name].probabilities), dict(found.probabilities), (name,))
        assert (result.stages[-1].error is not None) is refused
        assert any("stage 'short' was not used" in w for w in result.warnings) is refused


def test_a_stage_that_refuses_every_input_leaves_every_first_answer_marked(engine):
    closed = Counted(engine, limits=Limits(max_text_bytes=8))
    everything = EscalationRule(abstained=False, probability_below=1.0)
    cascade = Cascade(engine, [Stage(closed, everything, name="closed")], name="first")
    filled = cascade.fill_many(SCHEMA, TEXTS)
    decided = cascade.decide_many(TEXTS, QUESTIONS)
    for result, first in zip(filled, engine.fill_many(SCHEMA, TEXTS)):
        assert result.values == first.values
        assert all(f.engine == "first" and not f.escalation["escalated"] for f in result.fields.values())
        assert [c.engine for c in result.stages] == ["first", "closed"] and result.stages[-1].error
    for response in decided:
        assert all(a.engine == "first" and a.escalation["error"] for a in response.answers.values())
    assert closed.calls[0] == ("fill_many", tuple(SCHEMA), len(TEXTS))  # the batch first, then each alone


def test_a_stage_without_batched_calls_is_asked_one_input_at_a_time(engine, stages):
    second, _ = stages
    alone = OneAtATime(second)
    batched_stage = [Cascade(engine, [Stage(second, rule, name="stage")], name="first") for rule in RULES]
    one_stage = [Cascade(engine, [Stage(alone, rule, name="stage")], name="first") for rule in RULES]
    second.calls.clear()
    filled = one_stage[0].fill_many(SCHEMA, TEXTS)
    decided = one_stage[1].decide_many(TEXTS, QUESTIONS)
    assert {method for method, _, _ in second.calls} == {"fill", "decide"}
    escalating = sum(any(asked_of(f, "stage") for f in r.fields.values()) for r in filled)
    assert sum(method == "fill" for method, _, _ in second.calls) == escalating
    for one, many in zip(batched_stage[0].fill_many(SCHEMA, TEXTS), filled):
        assert_same_fill(one, many)
    for one, many in zip(batched_stage[1].decide_many(TEXTS, QUESTIONS), decided):
        assert_same_decide(one, many)
