"""Many inputs read together (``pcd_core/planning/batching.py``) on the real embedded model, torch fp32.

Each input of ``fill_many`` / ``decide_many`` must get the answers and probabilities of its own solo
call to 1e-5, on every bundled schema and question set, with inputs of very different lengths, a
batch split by the token budget and open fields; a neighbour's text must not move an input's
probabilities; a warm batch costs the passes of one solo call.
"""

import asyncio
from typing import Literal

import pytest
from conftest import load_case, schema_cases
from pydantic import BaseModel, Field

from pcd_core import PromptError
from pcd_core.planning.batching import BATCH_STEM_TOKENS, _groups
from pcd_core.result import FieldResult

TOL = 1e-5
LOG_TOL = 1e-4
TEXT = "I was billed twice for March ($49 each). Refund the duplicate within 12 hours or I cancel."
OTHERS = ["The app crashes when I upload a photo.", "Do you sell gift cards? I would like three of them."]


class Ticket(BaseModel):
    topic: Literal["BILLING", "TECHNICAL", "SALES"] = Field(description="What the ticket is about")
    wants_refund: bool = Field(description="Whether the customer asks for money back")
    urgent: bool


class Noted(BaseModel):
    topic: Literal["BILLING", "TECHNICAL", "SALES"]
    summary: str = Field(max_length=40)


def assert_same_fill(solo, batched):
    assert batched.values == solo.values
    assert list(batched.fields) == list(solo.fields)
    for name, expected in solo.fields.items():
        got = batched.fields[name]
        if isinstance(expected, FieldResult):
            assert got.value == expected.value, name
            for label, p in expected.probabilities.items():
                assert abs(got.probabilities[label] - p) <= TOL, (name, label, got.probabilities[label], p)
        else:
            assert got.text == expected.text, name


def assert_close(expected, got, tol, where):
    """Numbers within ``tol``, everything else equal, through dicts and lists."""
    if isinstance(expected, float):
        assert abs(got - expected) <= tol, (where, got, expected)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys(), where
        for key, value in expected.items():
            assert_close(value, got[key], tol, (*where, key))
    elif isinstance(expected, list):
        assert len(got) == len(expected), where
        for k, (a, b) in enumerate(zip(expected, got)):
            assert_close(a, b, tol, (*where, k))
    else:
        assert got == expected, where


def assert_same_decide(solo, batched):
    assert list(batched.answers) == list(solo.answers)
    for qid, expected in solo.answers.items():
        got = batched.answers[qid].model_dump()
        for key, value in expected.model_dump().items():
            # log-masses are fp32 logs of sums, so a wider pass's rounding moves them up to ~1e-5 when
            # the probabilities move ~1e-6; the probabilities and answers are what 1e-5 is asked of
            assert_close(value, got[key], LOG_TOL if key == "x_logits" else TOL, (qid, key))


def passes(engine, call):
    before = engine.backend.forward_passes
    result = call()
    return result, engine.backend.forward_passes - before


@pytest.mark.parametrize("name", schema_cases())
def test_every_bundled_schema_fills_each_input_as_its_solo_call(engine, name):
    case = load_case(name)
    schema, task = case["json_schema"], case.get("task", "")
    texts = ["Help.", case["input"], f"{case['input']}\n\n{case['input']}"]  # 2 to several hundred tokens
    batched = engine.fill_many(schema, texts, task=task)
    for text, got in zip(texts, batched):
        assert_same_fill(engine.fill(schema, text, task=task), got)


def test_the_bundled_question_set_decides_each_state_as_its_solo_call(engine):
    case = load_case("refund_request_questions")
    states = [case["state"], "Where is my parcel?", f"{case['state']} {case['state']}"]
    solo = [engine.decide(state, case["questions"]) for state in states]  # the last two warm
    batched, n_passes = passes(engine, lambda: engine.decide_many(states, case["questions"]))
    assert n_passes == 1
    for expected, got in zip(solo, batched):
        assert_same_decide(expected, got)


def test_order_samples_and_greedy_read_as_their_solo_calls(engine):
    case = load_case("refund_request_questions")
    states = [case["state"], "I changed my mind, cancel it."]
    for state, got in zip(states, engine.decide_many(states, case["questions"], order_samples=2)):
        assert_same_decide(engine.decide(state, case["questions"], order_samples=2), got)
    texts = [TEXT, *OTHERS]
    for text, got in zip(texts, engine.fill_many(Ticket, texts, strategy="greedy")):
        assert_same_fill(engine.fill(Ticket, text, strategy="greedy"), got)


def test_a_warm_batch_of_fills_is_one_pass_a_group_and_a_lone_long_input_runs_solo(engine):
    texts = [TEXT, *OTHERS]
    engine.warmup(Ticket)
    solo, solo_passes = passes(engine, lambda: engine.fill(Ticket, texts[0]))
    batched, batch_passes = passes(engine, lambda: engine.fill_many(Ticket, texts))
    # Ticket's second wave is read behind each answer of its first, in the first pass (speculation.py)
    assert solo_passes == batch_passes == 1
    assert all(r.stats.forward_passes == 1 and r.stats.head_cache == "hit" for r in batched)
    assert_same_fill(solo, batched[0])
    # more inputs than one group holds: one pass per group, and an input alone in its group runs solo
    many = texts * 6
    compiled = engine.compile(Ticket)
    stems = [len(engine.request_ids(compiled, text)) - len(compiled.head_ids) for text in many]
    groups = _groups(range(len(many)), stems)
    alone = len(many) - sum(len(group) for group in groups)
    assert len(groups) > 1 and sum(stems) > BATCH_STEM_TOKENS
    assert all(sum(stems[k] for k in group) <= BATCH_STEM_TOKENS for group in groups)
    taken = [stems[k] for group in groups for k in group]
    assert taken == sorted(taken), "inputs are grouped shortest request first, so a batch pads little"
    results, n_passes = passes(engine, lambda: engine.fill_many(Ticket, many))
    assert n_passes == len(groups) + alone
    for text, got in zip(many[:3], results):
        assert_same_fill(engine.fill(Ticket, text), got)


def test_a_batch_over_the_token_budget_takes_more_passes_and_the_same_answers(engine):
    texts = [TEXT, *OTHERS, "Please call me back about the invoice."]
    engine.warmup(Ticket)
    whole, whole_passes = passes(engine, lambda: engine.fill_many(Ticket, texts))
    saved = engine.backend.max_tokens_per_pass
    engine.backend.max_tokens_per_pass = 48  # about one input's request and rows per pass
    try:
        split, split_passes = passes(engine, lambda: engine.fill_many(Ticket, texts))
    finally:
        engine.backend.max_tokens_per_pass = saved
    assert whole_passes == 1 and split_passes >= 2 * len(texts)
    for text, a, b in zip(texts, whole, split):
        assert_same_fill(a, b)
        assert_same_fill(engine.fill(Ticket, text), b)


def test_a_neighbours_text_does_not_move_an_inputs_probabilities(engine):
    first = engine.fill_many(Ticket, [TEXT, OTHERS[0]])[0]
    swapped = engine.fill_many(Ticket, [OTHERS[1], TEXT, OTHERS[1] * 3])[1]
    assert_same_fill(first, swapped)


def test_open_fields_generate_as_solo_calls_and_closed_only_reads_batch(engine):
    texts = [TEXT, OTHERS[0]]
    for text, got in zip(texts, engine.fill_many(Noted, texts)):
        assert_same_fill(engine.fill(Noted, text), got)
    engine.warmup(Noted)
    closed, n_passes = passes(engine, lambda: engine.fill_many(Noted, texts, generate=False))
    assert n_passes == 1  # one closed field: one wave, one pass for both inputs
    for text, got in zip(texts, closed):
        assert_same_fill(engine.fill(Noted, text, generate=False), got)


def test_a_bad_input_refuses_the_whole_batch_before_any_pass(engine):
    with pytest.raises(PromptError, match="context"):
        passes(engine, lambda: engine.fill_many(Ticket, [TEXT, "word " * 9000]))
    before = engine.backend.forward_passes
    with pytest.raises(PromptError):
        engine.fill_many(Ticket, [TEXT, "word " * 9000])
    assert engine.backend.forward_passes == before


def test_async_batches_answer_as_the_sync_ones(engine):
    case = load_case("refund_request_questions")
    states, texts = [case["state"], "Where is my parcel?"], [TEXT, OTHERS[0]]

    async def both():
        return await engine.afill_many(Ticket, texts), await engine.adecide_many(states, case["questions"])

    fills, decides = asyncio.run(both())
    for a, b in zip(engine.fill_many(Ticket, texts), fills):
        assert_same_fill(a, b)
    for a, b in zip(engine.decide_many(states, case["questions"]), decides):
        assert_same_decide(a, b)


def test_a_batchs_later_rounds_take_each_request_from_the_round_before(engine, monkeypatch):
    """A warm batch of fills reads its requests in the first round only: the torch backend keeps the
    keys of each group's request (``StemMemo``) and the later round reads the rows. Without the memo
    the later round reads every request again; the answers are the same either way, and each input's
    own.
    """
    from pcd_core.backends import torch_batched
    from pcd_core.planning import speculation

    monkeypatch.setattr(speculation, "SPECULATIVE_TOKENS", 0)  # a later wave of its own, after the first

    class Triage(BaseModel):  # "shipping" and "safety" part after their first token: two rounds
        team: Literal["safety", "billing", "shipping", "accounts"]
        mood: Literal["calm", "annoyed", "angry"]

    texts = [TEXT, *OTHERS]
    engine.warmup(Triage)
    solo = [engine.fill(Triage, text) for text in texts]
    assert all(one.stats.forward_passes == 2 for one in solo)
    counter = engine.backend.counter
    before = counter.tokens_read
    kept = engine.fill_many(Triage, texts)
    kept_read = counter.tokens_read - before
    monkeypatch.setattr(torch_batched, "STEM_MEMO_TOKENS", 0)
    engine.backend._stems = None
    before = counter.tokens_read
    again = engine.fill_many(Triage, texts)
    again_read = counter.tokens_read - before
    compiled = engine.compile(Triage)
    requests = sum(len(engine.request_ids(compiled, text)) - len(compiled.head_ids) for text in texts)
    assert kept_read < again_read - requests // 2  # at least half the requests were not read again
    for alone, with_memo, without in zip(solo, kept, again, strict=True):
        assert_same_fill(alone, with_memo)
        assert_same_fill(alone, without)
