"""``order_samples``: K rotations of a choice's or a score's options read as sibling rows of one pass.

The reference for a choice is independent of the code under test: the same question asked K times
through the public ``decide``, its options rotated by hand, each answer's probabilities keyed by
name and averaged. On the embedded model K = 3 costs the forward passes of K = 1.
"""

import pytest

from pcd_core.errors import OptionError
from pcd_core.testing import oracle_engine

STATE = "The blender arrived cracked and I was charged twice for it."
OPTIONS = {"billing": "money, charges, invoices", "shipping": "delivery and damage", "sales": None, "legal": None}


def _rotated(options, shift):
    items = list(options.items())
    return dict(items[shift:] + items[:shift])


def _choice(options):
    return {"type": "choice", "instructions": "Which team should handle it?", "criteria": options}


def test_a_choice_read_in_k_rotations_is_the_mean_of_the_k_rotated_questions():
    engine = oracle_engine(window=8)
    sampled = engine.decide(STATE, {"team": _choice(OPTIONS)}, order_samples=2).answers["team"]
    # K = 2 over four options: the list as given, and rotated by two
    readings = [engine.decide(STATE, {"team": _choice(_rotated(OPTIONS, s))}).answers["team"] for s in (0, 2)]
    expected = {name: sum(r.probabilities[name] for r in readings) / 2 for name in OPTIONS}
    assert sampled.probabilities == pytest.approx(expected)
    assert sampled.choice == max(expected, key=expected.get)
    assert list(sampled.probabilities) == list(OPTIONS)  # the answer keeps the order the caller gave
    tops = [r.probabilities[sampled.choice] for r in readings]
    assert sampled.order_spread == pytest.approx(max(tops) - min(tops))
    assert engine.decide(STATE, {"team": _choice(OPTIONS)}).answers["team"].order_spread is None


def test_a_score_read_in_rotations_keeps_each_levels_number_and_reports_its_spread():
    engine = oracle_engine(window=400)  # a window that sees the listing, so the rotations read differently
    score = {"type": "score", "instructions": "How angry is the customer?", "criteria": ["calm", "annoyed", "furious"]}
    one = engine.decide(STATE, {"s": score}).answers["s"]
    three = engine.decide(STATE, {"s": score}, order_samples=3).answers["s"]
    assert set(three.probabilities) == {"0", "1", "2"} and sum(three.probabilities.values()) == pytest.approx(1.0)
    assert three.order_spread is not None and three.order_spread >= 0
    assert three.probabilities != pytest.approx(one.probabilities)  # the other listings were read


def test_a_noul_has_no_list_to_rotate():
    engine = oracle_engine(window=8)
    question = {"q": {"type": "noul", "instructions": "Was the customer charged twice?"}}
    assert engine.decide(STATE, question, order_samples=3).answers == engine.decide(STATE, question).answers


@pytest.mark.parametrize("bad", [0, 9, -1])
def test_order_samples_outside_one_to_eight_is_an_option_error(bad):
    with pytest.raises(OptionError, match="order_samples"):
        oracle_engine().decide(STATE, {"team": _choice(OPTIONS)}, order_samples=bad)


def test_three_rotations_cost_the_passes_of_one_on_the_embedded_model(engine):
    questions = {
        "team": _choice(OPTIONS),
        "anger": {"type": "score", "instructions": "How angry?", "criteria": ["calm", "annoyed", "furious"]},
        "refund": {"type": "noul", "instructions": "Does the customer want money back?"},
    }
    engine.decide(STATE, questions)  # the head is cached from here on
    one = engine.decide(STATE, questions)
    three = engine.decide(STATE, questions, order_samples=3)
    assert three.stats.forward_passes == one.stats.forward_passes
    assert three.stats.n_rows > one.stats.n_rows
    assert three.answers["team"].order_spread is not None and three.answers["refund"].order_spread is None
    assert sum(three.answers["team"].probabilities.values()) == pytest.approx(1.0)


def test_answers_read_in_k_orders_are_debiased_by_a_prior_read_in_the_same_k_orders():
    from pcd_core.request.questions import DecideRequest

    engine = oracle_engine(window=8)
    questions = {"team": _choice(OPTIONS)}
    asked = DecideRequest(state="", questions=questions).questions
    prior_one, prior_three = (engine.question_priors(asked, k)["team"] for k in (1, 3))
    assert prior_three != pytest.approx(prior_one)  # the rotations move the content-free reading too
    raw = engine.decide(STATE, questions, order_samples=3, debias=False, calibrate=False).answers["team"]
    debiased = engine.decide(STATE, questions, order_samples=3, debias=True, calibrate=False).answers["team"]
    scaled = [raw.probabilities[name] / p for name, p in zip(OPTIONS, prior_three)]
    expected = {name: value / sum(scaled) for name, value in zip(OPTIONS, scaled)}
    assert debiased.probabilities == pytest.approx(expected)
