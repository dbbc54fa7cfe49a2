"""The engine on the real embedded model: waves, strategies, threads, async, budgets, questions."""

import asyncio
import threading
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from pcd_core import ChoiceAnswer, NoulAnswer, PromptError, SchemaError, ScoreAnswer
from pcd_core.errors import RequestError

TEXT = "I was billed twice for March ($49 each). Refund the duplicate within 12 hours or I cancel."


class Ticket(BaseModel):
    topic: Literal["BILLING", "TECHNICAL", "SALES"] = Field(description="What the ticket is about")
    wants_refund: bool = Field(description="Whether the customer asks for money back")
    urgent: bool


def test_pydantic_schema_returns_an_instance_with_real_types(engine):
    result = engine.fill(Ticket, TEXT)
    assert isinstance(result.value, Ticket)
    assert isinstance(result.value.wants_refund, bool)
    assert result.fields["topic"].wave == 0 and result.fields["urgent"].wave == 1


def test_depends_on_adds_two_passes_per_wave(engine):
    schema = {
        "topic": ["BILLING", "TECHNICAL"],
        "urgent": "boolean",
        "team": {"enum": ["FINANCE", "ENGINEERING"], "depends_on": ["topic"]},
        "escalate": {"type": "boolean", "depends_on": ["team"]},
    }
    engine.warmup(schema)
    result = engine.fill(schema, TEXT)
    assert [result.fields[n].wave for n in schema] == [0, 1, 1, 2]
    assert result.stats.forward_passes == 6  # input, topic, its line, urgent+team, their lines, escalate


@pytest.mark.parametrize("strategy", ["greedy", "exact"])
def test_every_strategy_gives_a_valid_object(engine, strategy):
    result = engine.fill(Ticket, TEXT, strategy=strategy)
    assert result.fields["topic"].method == strategy
    assert result.value.topic in ("BILLING", "TECHNICAL", "SALES")


def test_unknown_strategy_is_a_schema_error(engine):
    with pytest.raises(SchemaError, match="unknown strategy"):
        engine.fill(Ticket, TEXT, strategy="beam")


def test_threads_share_one_engine_without_cross_talk(engine):
    texts = [TEXT, "The app crashes when I upload a photo.", "Can I get a quote for 50 seats?"]
    expected = [engine.fill(Ticket, t).values for t in texts]
    got = [None] * 6

    def work(k):
        got[k] = engine.fill(Ticket, texts[k % 3]).values

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == expected * 2


def test_afill_does_not_block_the_event_loop(engine):
    async def scenario():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        result = await engine.afill(Ticket, TEXT)
        task.cancel()
        return result, ticks

    result, ticks = asyncio.run(scenario())
    assert ticks > 0 and isinstance(result.value, Ticket)


def test_fill_many_matches_single_fills(engine):
    texts = [TEXT, "The app crashes when I upload a photo."]
    assert [r.values for r in engine.fill_many(Ticket, texts)] == [engine.fill(Ticket, t).values for t in texts]


def test_an_input_over_the_context_is_rejected_not_truncated(engine):
    with pytest.raises(PromptError, match="context"):
        engine.fill(Ticket, "word " * 9000)


STATE = "The blender arrived cracked and the motor smells of burning plastic. I want my money back."
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
    "team": {
        "type": "choice",
        "instructions": "Which team should own this?",
        "criteria": {"returns": "refunds and returns", "safety": "hazards", "sales": None},
    },
    "anger": {
        "type": "score",
        "instructions": "How angry is the customer?",
        "criteria": ["calm", "annoyed", "furious"],
    },
}


def _numbers(answer):
    if isinstance(answer, NoulAnswer):
        return [answer.noul]
    return list(answer.probabilities.values())


def test_decide_returns_typed_answers_in_three_passes_cold_then_two(engine):
    response = engine.decide(STATE, QUESTIONS)
    assert isinstance(response.answers["refund"], NoulAnswer)
    assert isinstance(response.answers["team"], ChoiceAnswer)
    anger = response.answers["anger"]
    assert isinstance(anger, ScoreAnswer)
    assert anger.score == pytest.approx(sum(i * p for i, p in enumerate(anger.probabilities.values())))
    assert list(anger.legend) == ["0", "1", "2"]
    assert response.usage.output_tokens == 0 and response.usage.input_tokens > 0
    assert engine.decide(STATE, QUESTIONS).stats.forward_passes == 2  # the state, then every row


def test_answers_do_not_depend_on_ids_order_or_other_questions(engine):
    base = engine.decide(STATE, QUESTIONS).answers
    renamed = engine.decide(STATE, {f"q_{k}_ünï": v for k, v in QUESTIONS.items()}).answers
    reordered = engine.decide(STATE, dict(reversed(list(QUESTIONS.items())))).answers
    extra = dict(QUESTIONS, other={"type": "noul", "instructions": "Is the order older than a year?"})
    added = engine.decide(STATE, extra).answers
    for key in QUESTIONS:
        for variant in (renamed[f"q_{key}_ünï"], reordered[key], added[key]):
            assert _numbers(variant) == pytest.approx(_numbers(base[key]), abs=1e-5)


def test_noul_criteria_may_be_absent_null_or_one_sided(engine):
    for criteria in (
        None,
        {"true": "they ask for a refund"},
        {"false": "they only complain"},
        {"true": "refund", "false": None},
    ):
        answer = engine.decide(STATE, {"q": {"type": "noul", "instructions": "Refund?", "criteria": criteria}})
        assert 0.0 <= answer.answers["q"].noul <= 1.0


def test_many_options_use_two_letter_codes_and_names_come_back_byte_for_byte(engine):
    names = {f"Ωption {i} – «{i}»": None for i in range(60)}
    answer = engine.decide(
        "The answer is option 7.", {"q": {"type": "choice", "instructions": "Which option?", "criteria": names}}
    ).answers["q"]
    assert list(answer.probabilities) == list(names)
    assert answer.choice in names
    assert sum(answer.probabilities.values()) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "question",
    [
        {"type": "choice", "instructions": "x", "criteria": {"only": None}},
        {"type": "choice", "instructions": "x", "criteria": {str(i): None for i in range(256)}},
        {"type": "score", "instructions": "x", "criteria": ["one"]},
        {"type": "score", "instructions": "x", "criteria": {"a": "b"}},
        {"type": "noul", "instructions": "x", "criteria": {"maybe": "?"}},
        {"type": "poll", "instructions": "x"},
        {"instructions": "x"},
    ],
)
def test_invalid_questions_are_rejected_before_the_model(engine, question):
    passes = engine.backend.forward_passes
    with pytest.raises(RequestError):  # a PcdError that keeps pydantic's details
        engine.decide(STATE, {"q": question})
    assert engine.backend.forward_passes == passes


def test_an_empty_question_set_is_rejected(engine):
    with pytest.raises(RequestError):  # a PcdError that keeps pydantic's details
        engine.decide(STATE, {})


def test_a_state_over_the_context_is_rejected(engine):
    with pytest.raises(PromptError):
        engine.decide("word " * 9000, QUESTIONS)
