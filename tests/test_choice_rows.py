"""A choice's rows grow like its options, on the real embedded model.

Past the tokenizer's single-token letters a choice is read through two-letter codes: one row per
first letter, each carrying the question's whole option list. The list must be read once, the
second letters hanging from it; counting each row whole once split a 255-option question into 15
passes that read the list 15 times. The tree's answers are checked here against each option's
continuation read alone, and the row-token limit against the rows the engine really reads.
"""

from __future__ import annotations

import math

import pytest

from pcd_core import Engine
from pcd_core.backends.packing import pack_tree, plan_chunks
from pcd_core.bench.choices import STATE, choice_question
from pcd_core.errors import LimitError
from pcd_core.planning.deciding import plan_decide
from pcd_core.prompting.question_rows import render_decide_prompt
from pcd_core.prompting.trie import Variant
from pcd_core.request.limits import Limits
from pcd_core.request.questions import DecideRequest, distribution


def plan_for(engine, questions):
    request = DecideRequest(state=STATE, questions=questions)
    return plan_decide(engine.tokenizer, render_decide_prompt(engine.tokenizer), request, engine.context_length)


# -- the chunker, without a model -----------------------------------------------------------------
def test_rows_that_share_a_start_longer_than_the_pass_bound_stay_in_one_pass():
    stem = tuple(range(100, 5100))  # a question's 5000-token option list, over 4096
    rows = [stem + (k,) for k in range(16)]  # its 16 first letters
    assert plan_chunks(rows, 4096) == [list(range(16))]
    assert len(pack_tree(rows).tokens) == 5016


def test_unrelated_rows_still_split_at_the_bound_and_one_token_keeps_one_row_per_pass():
    rows = [(k, 1, 2, 3) for k in range(6)]
    assert [len(chunk) for chunk in plan_chunks(rows, 8)] == [2, 2, 2]
    shared = [(7, 7, 7, k, k) for k in range(4)]  # each adds two tokens to the stem
    assert plan_chunks(shared, 1) == [[0], [1], [2], [3]]


def test_rows_of_one_question_are_grouped_whatever_order_they_come_in():
    first, second = tuple(range(50)), tuple(range(1000, 1050))
    rows = [first + (1,), second + (1,), first + (2,), second + (2,)]
    chunks = plan_chunks(rows, 60)
    assert sorted(sorted(chunk) for chunk in chunks) == [[0, 2], [1, 3]]


# -- the real model ---------------------------------------------------------------------------
def test_row_tokens_grow_linearly_with_the_options(engine):
    counts = {}
    for n in (64, 128, 255):
        plan = plan_for(engine, {"q": choice_question(n)})
        trie = plan.asked[0].trie
        n_branch_rows = len(trie.decision_paths())
        counts[n] = plan.row_tokens()
        # the option list once, each branch row adding its few code tokens
        assert counts[n] <= len(trie.row) + 3 * n_branch_rows, n
        assert counts[n] < 13 * n, n  # about 12 tokens per "- queue 17 -> answer "AB"" line
    assert counts[255] / counts[64] < 1.1 * 255 / 64  # linear, not quadratic (old: 46,245 / 769)


def test_a_255_option_choice_is_one_warm_pass_reading_each_row_token_once(engine):
    question = {"q": choice_question(255)}
    engine.decide(STATE, {"q": choice_question(2)})  # the shared head, cached
    response = engine.decide(STATE, question)
    plan = plan_for(engine, question)
    assert response.stats.forward_passes == 1
    assert response.stats.row_tokens == plan.row_tokens() < 13 * 255
    assert response.answers["q"].choice in question["q"]["criteria"]
    assert sum(response.answers["q"].probabilities.values()) == pytest.approx(1.0)


def alone(engine, plan, index: int = 0) -> list[float]:
    """Each option's probability from its own continuation, read after the question's row in a pass
    of its own: at every token where options part, the probability of its token among the allowed
    ones, multiplied down to the token that settles it (a forced decision tree).
    """
    backend, trie = engine.backend, plan.asked[index].trie
    variants: tuple[Variant, ...] = trie.variants
    start = len(trie.row)
    row = backend.prefill(trie.row, parent=backend.prefill(plan.whole))
    masses = [0.0] * len(plan.asked[index].names)
    for variant in variants:
        logp = 0.0
        for depth in range(start, len(variant.ids)):
            above = [v for v in variants if v.ids[:depth] == variant.ids[:depth]]
            allowed = sorted({v.ids[depth] for v in above})
            read = backend.next_logp(row if depth == start else backend.prefill(variant.ids[start:depth], parent=row))
            logp += read[variant.ids[depth]] - math.log(sum(math.exp(read[t]) for t in allowed))
            if {v.label for v in above if v.ids[depth] == variant.ids[depth]} == {variant.label}:
                break  # this token settles the option
        masses[variant.label] = math.exp(logp)
    return masses


def test_the_tree_answers_equal_each_option_read_alone(engine):
    question = {"q": choice_question(60)}  # past the single-token letters: two-letter codes
    plan = plan_for(engine, question)
    assert any(len(path) == 1 for path in plan.asked[0].trie.decision_paths())  # a second letter is read
    answer = engine.decide(STATE, question, debias=False).answers["q"]
    expected = alone(engine, plan)
    assert sum(expected) == pytest.approx(1.0, abs=1e-9)
    assert list(answer.probabilities.values()) == pytest.approx(expected, abs=1e-5)


def test_a_question_over_the_pass_bound_is_still_one_pass_with_the_same_answers(engine):
    from pcd_core.backends.torch_backend import TorchBackend

    question = {"q": choice_question(60), "n": {"type": "noul", "instructions": "Is the customer angry?"}}
    tight = Engine(TorchBackend(engine.backend.model, max_tokens_per_pass=64), engine.tokenizer, "tight")
    assert len(plan_for(engine, question).asked[0].trie.row) > 64
    tight.decide(STATE, {"q": choice_question(2)})
    engine.decide(STATE, {"q": choice_question(2)})
    narrow, wide = tight.decide(STATE, question, debias=False), engine.decide(STATE, question, debias=False)
    assert (narrow.stats.forward_passes, wide.stats.forward_passes) == (2, 1)  # the noul in a pass of its own
    for qid in question:
        assert distribution(narrow.answers[qid]) == pytest.approx(distribution(wide.answers[qid]), abs=1e-5)


def test_rows_over_the_limit_are_refused_before_any_pass_with_the_real_count(engine):
    question = {"q": choice_question(128)}
    n_tokens = plan_for(engine, question).row_tokens()
    at_limit = Engine(engine.backend, engine.tokenizer, "limited", limits=Limits(max_row_tokens=n_tokens))
    below = Engine(engine.backend, engine.tokenizer, "limited", limits=Limits(max_row_tokens=n_tokens - 1))
    passes = engine.backend.forward_passes
    with pytest.raises(LimitError, match="max_row_tokens") as refused:
        below.decide(STATE, question)
    assert engine.backend.forward_passes == passes
    assert (refused.value.setting, refused.value.value, refused.value.limit) == (
        "max_row_tokens",
        n_tokens,
        n_tokens - 1,
    )
    assert "fewer options" in str(refused.value)
    assert at_limit.decide(STATE, question).stats.row_tokens == n_tokens
