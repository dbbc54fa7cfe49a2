"""The engine on the real embedded model: waves, strategies, threads, async, budgets, questions,
the pass counts, every ``Stats`` field of both read paths, and equality with the four-pass reading.
"""

import asyncio
import threading
from typing import Literal

import numpy as np
import pytest
from conftest import LoopTicks, load_case, schema_cases
from pydantic import BaseModel, Field

from pcd_core import ChoiceAnswer, DecodeOptions, Engine, NoulAnswer, OptionError, PromptError, SchemaError, ScoreAnswer
from pcd_core.backends.packing import pack_tree
from pcd_core.errors import RequestError
from pcd_core.planning import speculation
from pcd_core.planning.deciding import answer_of, plan_decide
from pcd_core.prompting.question_rows import render_decide_prompt
from pcd_core.reading.read_path import BYPASSED, after_head
from pcd_core.reading.rounds import DecisionTask, RoundStats, decode, plan_rows
from pcd_core.request.questions import DecideRequest
from pcd_core.tokenizer import TextTokenizer

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
    # each attribute is its field's most probable label, as the label's value (not its text)
    for name, field in result.fields.items():
        best = max(field.probabilities, key=field.probabilities.__getitem__)
        assert getattr(result.value, name) == field.value and str(field.value).lower() == best.lower(), name


WAVES = {
    "topic": ["BILLING", "TECHNICAL"],
    "urgent": "boolean",
    "team": {"enum": ["FINANCE", "ENGINEERING"], "depends_on": ["topic"]},
    "escalate": {"type": "boolean", "depends_on": ["team"]},
}


def test_each_depends_on_wave_adds_one_pass_but_the_second_rides_in_the_first(engine, monkeypatch):
    engine.warmup(WAVES)
    result = engine.fill(WAVES, TEXT)
    assert [result.fields[n].wave for n in WAVES] == [0, 1, 1, 2]
    # the input with topic's rows and, behind each of topic's two lines, urgent's and team's; then
    # the chosen lines of both waves with escalate's rows
    assert result.stats.forward_passes == 2
    monkeypatch.setattr(speculation, "SPECULATIVE_TOKENS", 0)
    apart = engine.fill(WAVES, TEXT)
    assert apart.stats.forward_passes == 3  # topic's line, then urgent's and team's with escalate's rows
    for name in WAVES:
        assert apart.fields[name].value == result.fields[name].value, name
        for label, p in apart.fields[name].probabilities.items():
            assert result.fields[name].probabilities[label] == pytest.approx(p, abs=1e-5), (name, label)


@pytest.mark.parametrize("strategy", ["greedy", "exact"])
def test_every_strategy_gives_a_valid_object(engine, strategy):
    result = engine.fill(Ticket, TEXT, strategy=strategy)
    trie = engine.fill(Ticket, TEXT, strategy="trie")
    assert result.fields["topic"].method == strategy
    for name, field in result.fields.items():
        assert sum(field.probabilities.values()) == pytest.approx(1.0, abs=1e-6)
        best = max(field.probabilities, key=field.probabilities.__getitem__)
        assert str(field.value).lower() == best.lower(), name
        # every strategy reads the same model: a clear winner under the trie stays the winner
        if trie.fields[name].probability > 0.8:
            assert field.value == trie.fields[name].value, name


def test_an_unknown_strategy_is_an_option_error_that_costs_no_pass(engine):
    passes = engine.backend.forward_passes
    with pytest.raises(OptionError, match="unknown strategy 'beam'") as caught:
        engine.fill(Ticket, TEXT, strategy="beam")
    assert isinstance(caught.value, ValueError) and not isinstance(caught.value, SchemaError)
    with pytest.raises(OptionError):
        engine.fill(Ticket, TEXT, DecodeOptions().replace(strategy="beam"))
    assert engine.backend.forward_passes == passes


def test_options_and_the_strategy_shorthand_read_the_same_and_both_together_are_refused(engine):
    by_options = engine.fill(Ticket, TEXT, DecodeOptions(strategy="exact"))
    by_keyword = engine.fill(Ticket, TEXT, strategy="exact")
    assert by_options.fields["topic"].method == by_keyword.fields["topic"].method == "exact"
    assert by_options.to_dict()["fields"] == by_keyword.to_dict()["fields"]
    # which of the two would win is not the caller's guess to make: refused before any pass
    passes = engine.backend.forward_passes
    with pytest.raises(OptionError, match="not both"):
        engine.fill(Ticket, TEXT, DecodeOptions(), strategy="exact")
    assert engine.backend.forward_passes == passes


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
        async with LoopTicks(0.01) as ticks:
            result = await engine.afill(Ticket, TEXT)
        return result, ticks.count

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


def fresh(engine):
    """An engine with empty caches on the session's loaded model: a cold request without a reload."""
    return Engine(engine.backend, engine.tokenizer, engine.model_name)


def test_decide_returns_typed_answers_in_two_passes_cold_then_one(engine):
    cold = fresh(engine)
    response = cold.decide(STATE, QUESTIONS)
    assert response.stats.forward_passes == 2  # the head, then the state with every question's row
    assert isinstance(response.answers["refund"], NoulAnswer)
    assert isinstance(response.answers["team"], ChoiceAnswer)
    anger = response.answers["anger"]
    assert isinstance(anger, ScoreAnswer)
    assert anger.score == pytest.approx(sum(i * p for i, p in enumerate(anger.probabilities.values())))
    assert list(anger.legend) == ["0", "1", "2"]
    assert response.usage.output_tokens == 0 and response.usage.input_tokens == response.stats.input_tokens
    assert cold.decide(STATE, QUESTIONS).stats.forward_passes == 1  # the state is the rows' trunk


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


# -- one read path: pass counts and every Stats field, cold, warm and bypassed --------------------
class NewlineHashTokenizer(TextTokenizer):
    """SmolLM2's tokenizer, except that a newline followed by ``<<<`` is one token, as a BPE merge
    would make it. Both heads end in a newline and every request opens its fence with ``<<<``, so the
    request merges with the head's last token: the bypass, which SmolLM2's and Gemma 3's own merges
    never produce (every first character up to U+3000 was probed).
    """

    def __init__(self, hf) -> None:
        super().__init__(hf)
        self.pair = (hf.encode("\n", add_special_tokens=False)[0], hf.encode("<<<", add_special_tokens=False)[0])
        self.merged = hf.encode(" #", add_special_tokens=False)[0]

    def _encode_uncached(self, text: str) -> tuple[int, ...]:
        ids, out = super()._encode_uncached(text), []
        for token in ids:
            if out and (out[-1], token) == self.pair:
                out[-1] = self.merged
            else:
                out.append(token)
        return tuple(out)


@pytest.fixture(scope="module")
def merging(engine):
    return Engine(engine.backend, NewlineHashTokenizer(engine.tokenizer.hf), "merging")


def expected_rows(rounds):
    """Rows and distinct row tokens of trie rounds, laid out independently of the engine's counters;
    a round lists tries, or (lead, trie) pairs for tries read behind a lead (a speculative pass).
    """
    n_rows = n_tokens = 0
    for tries in rounds:
        led = [pair if isinstance(pair, tuple) else ((), pair) for pair in tries]
        rows, _ = plan_rows([(lead + trie.row, path) for lead, trie in led for path in trie.decision_paths()])
        n_rows, n_tokens = n_rows + len(rows), n_tokens + len(pack_tree(rows).tokens)
    return n_rows, n_tokens


HEAD_CACHE = {"cold": "miss", "warm": "hit", "bypassed": "bypassed"}


def check_stats(stats, warnings, tokens_read, case, *, head_ids, whole, answer_lines, rounds, passes):
    """Every field of ``stats`` for a request whose prompt up to the rows is ``whole``."""
    head_cache, n_head = HEAD_CACHE[case], len(head_ids)
    assert (after_head(whole, head_ids) is None) == (case == "bypassed")
    n_prompt = len(whole) - (0 if case == "bypassed" else n_head) + answer_lines
    n_rows, row_tokens = expected_rows(rounds)
    assert (stats.head_cache, stats.forward_passes) == (head_cache, passes)
    assert stats.cached_tokens == (n_head if head_cache == "hit" else 0)
    assert stats.prompt_tokens == n_prompt
    assert (stats.n_rows, stats.row_tokens, stats.rounds) == (n_rows, row_tokens, len(rounds))
    assert stats.input_tokens == (0 if head_cache == "bypassed" else n_head) + n_prompt + row_tokens
    assert tokens_read == stats.input_tokens - stats.cached_tokens  # what the backend itself counted
    assert stats.row_layout == "packed"
    assert stats.compile_ms > 0 and stats.prefill_ms > 0
    assert stats.head_ms > 0.0 if head_cache == "miss" else stats.head_ms >= 0.0  # a prefill, or a lookup
    assert stats.decode_ms > 0 if len(rounds) > 1 else stats.decode_ms == 0
    assert stats.queue_ms == 0.0  # one request at a time: the model was free each time it asked
    parts = stats.compile_ms + stats.head_ms + stats.prefill_ms + stats.decode_ms
    assert stats.total_ms >= parts
    assert (BYPASSED in warnings) == (head_cache == "bypassed")


def scenario(engine, merging, case, text):
    """The engine and text of a case: a fresh engine (cold, warm), or the merging one."""
    return (merging, "#1042 " + text) if case == "bypassed" else (fresh(engine), text)


def measured(engine, call):
    before = engine.backend.counter.tokens_read
    result = call()
    return result, engine.backend.counter.tokens_read - before


@pytest.mark.parametrize("ahead", [False, True], ids=["two-waves", "speculative"])
@pytest.mark.parametrize("case", list(HEAD_CACHE))
def test_fill_stats_are_exact_cold_warm_and_bypassed(engine, merging, case, ahead, monkeypatch):
    if not ahead:
        monkeypatch.setattr(speculation, "SPECULATIVE_TOKENS", 0)
    target, text = scenario(engine, merging, case, TEXT)
    if case == "warm":
        target.warmup(Ticket)
    result, read = measured(target, lambda: target.fill(Ticket, text))
    compiled = target.compile(Ticket)
    first = compiled.field("topic")
    line = first.answer_ids[[label.value for label in first.field.labels].index(result.value.topic)]
    later = [compiled.field("wants_refund").trie, compiled.field("urgent").trie]
    if ahead:  # the second wave behind each of topic's lines, in the first pass: no answer line in the trunk
        rounds = [[first.trie, *[(lead, trie) for lead in first.answer_ids for trie in later]]]
        line = ()
    else:
        rounds = [[first.trie], later]
    whole = target.request_ids(compiled, text)
    passes = {"cold": 3, "warm": 2, "bypassed": 2}[case] - ahead
    check_stats(
        result.stats,
        result.warnings,
        read,
        case,
        head_ids=compiled.head_ids,
        whole=whole,
        answer_lines=len(line),
        rounds=rounds,
        passes=passes,
    )


@pytest.mark.parametrize("case", list(HEAD_CACHE))
def test_decide_stats_are_exact_cold_warm_and_bypassed(engine, merging, case):
    target, state = scenario(engine, merging, case, STATE)
    if case == "warm":
        target.decide(state, {"q": QUESTIONS["refund"]})
    response, read = measured(target, lambda: target.decide(state, QUESTIONS))
    prompt = render_decide_prompt(target.tokenizer)
    plan = plan_decide(target.tokenizer, prompt, DecideRequest(state=state, questions=QUESTIONS), target.context_length)
    passes = {"cold": 2, "warm": 1, "bypassed": 1}[case]
    check_stats(
        response.stats,
        response.warnings,
        read,
        case,
        head_ids=plan.head_ids,
        whole=plan.whole,
        answer_lines=0,
        rounds=[[a.trie for a in plan.asked]],
        passes=passes,
    )
    assert response.usage.input_tokens == response.stats.input_tokens


def test_a_bypassed_head_decides_like_a_cached_one(engine, merging):
    """The bypass reads the same tokens from scratch, so the answers equal a warm read of them."""
    text = "#1042 " + TEXT
    bypassed = merging.fill(Ticket, text)
    compiled = merging.compile(Ticket)
    reference = four_pass_fill(merging.backend, compiled, merging.request_ids(compiled, text))
    assert_same_fields(bypassed, reference, compiled)


# -- equality with the four-pass reading this replaced ----------------------------------------
def four_pass_fill(backend, compiled, whole, strategy="trie"):
    """The reference: the request prefilled on the head, the first field scored alone, its answer
    line prefilled, then one packed pass per later wave, every step a prefill or a score of its own.
    """
    rest = after_head(whole, compiled.head_ids)
    prefix = (
        backend.prefill(whole) if rest is None else backend.prefill(rest, parent=backend.prefill(compiled.head_ids))
    )
    readouts, chosen = {}, {}
    for index, wave in enumerate(compiled.waves):
        if index:
            previous = set(compiled.waves[index - 1])
            lines = [t for f in compiled.fields if f.name in previous for t in f.answer_ids[chosen[f.name]]]
            prefix = backend.prefill(lines, parent=prefix)
        tasks = [DecisionTask(compiled.field(name).trie) for name in wave]
        for name, readout in zip(wave, decode(backend, prefix, tasks, RoundStats()).readouts):
            readouts[name], chosen[name] = readout, readout.best
    return readouts


def assert_same_fields(result, reference, compiled):
    """Same decisions; probabilities and candidate masses within 1e-5."""
    assert set(result.fields) == set(reference)
    for name, readout in reference.items():
        got = result.fields[name]
        assert got.value == compiled.schema.field(name).labels[readout.best].value, name
        np.testing.assert_allclose(list(got.probabilities.values()), readout.probabilities, atol=1e-5, err_msg=name)
        assert got.candidate_mass == pytest.approx(readout.candidate_mass, abs=1e-5), name


@pytest.mark.parametrize("name", schema_cases())
def test_two_pass_fill_equals_the_four_pass_reading_on_every_bundled_schema(engine, name):
    case = load_case(name)
    schema, text = case["json_schema"], case["input"]
    head = engine.warmup(schema)
    result = engine.fill(schema, text)
    assert result.stats.forward_passes == 2
    compiled = engine.compile(schema)
    reference = four_pass_fill(engine.backend, compiled, engine.request_ids(compiled, text), head)
    assert_same_fields(result, reference, compiled)


def test_one_pass_decide_equals_a_state_prefill_then_the_rows(engine):
    case = load_case("refund_request_questions")
    engine.decide(case["state"], case["questions"])  # warm the head
    response = engine.decide(case["state"], case["questions"])
    assert response.stats.forward_passes == 1
    backend = engine.backend
    plan = plan_decide(
        engine.tokenizer,
        render_decide_prompt(engine.tokenizer),
        DecideRequest(state=case["state"], questions=case["questions"]),
        engine.context_length,
    )
    head = backend.prefill(plan.head_ids)
    prefix = backend.prefill(after_head(plan.whole, plan.head_ids), parent=head)
    readouts = decode(backend, prefix, plan.tasks(), RoundStats()).readouts
    for qid, readout, asked in zip(case["questions"], readouts, plan.asked):
        want = answer_of(asked.question, asked.names, readout)
        got = response.answers[qid]
        assert got.type == want.type, qid
        if want.type == "noul":
            assert got.noul == pytest.approx(want.noul, abs=1e-5), qid
        else:
            assert getattr(got, want.type) == pytest.approx(getattr(want, want.type), abs=1e-5), qid
            assert got.probabilities == pytest.approx(want.probabilities, abs=1e-5), qid
        assert got.candidate_mass == pytest.approx(want.candidate_mass, abs=1e-5), qid
