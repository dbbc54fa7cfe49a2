"""Abstention thresholds and conformal answer sets (pcd_core/trust/selective.py), model-free.

The Clopper-Pearson bound is checked against its definition by direct summation of the binomial law;
the threshold and the sets against synthetic answers whose chance of being right is known, on fresh
draws of the same law, so a rule that only fits its own train split would fail.
"""

import math

import numpy as np
import pytest

from pcd_core.trust.selective import (
    CONFIDENCE,
    DEFAULT_CONFIDENCE,
    NEVER,
    abstention_threshold,
    answer_set,
    conformal_threshold,
    fewest_to_promise,
    risk_coverage,
    risk_upper_bound,
    supported_risk,
)


def _binomial_cdf(errors, n, rate):
    return sum(math.comb(n, i) * rate**i * (1 - rate) ** (n - i) for i in range(errors + 1))


@pytest.mark.parametrize(("errors", "n"), [(0, 10), (3, 50), (12, 200), (0, 45)])
def test_the_upper_bound_is_the_rate_at_which_so_few_errors_have_chance_delta(errors, n):
    bound = risk_upper_bound(errors, n, 0.1)
    assert _binomial_cdf(errors, n, bound) == pytest.approx(0.1, abs=1e-6)
    assert _binomial_cdf(errors, n, bound - 0.01) > 0.1  # a lower rate would make them likelier
    assert bound > errors / n


def test_no_errors_need_log_delta_over_log_one_minus_risk_examples():
    n = fewest_to_promise(0.05, 0.1)
    assert risk_upper_bound(0, n, 0.1) <= 0.05 < risk_upper_bound(0, n - 1, 0.1)


def _answers(n, seed):
    """Confidences uniform in [0.5, 1]; each answer right with exactly its confidence."""
    rng = np.random.default_rng(seed)
    confidence = rng.uniform(0.5, 1.0, n)
    return confidence, rng.uniform(size=n) < confidence


def test_at_confidence_0_9_the_threshold_holds_the_target_risk_on_fresh_answers():
    confidence, correct = _answers(4000, 0)
    threshold = abstention_threshold(confidence, correct, 0.10, level=0.9)
    fresh_confidence, fresh_correct = _answers(20000, 1)
    answered = fresh_confidence >= threshold
    risk = 1 - fresh_correct[answered].mean()
    assert risk <= 0.10
    # and it is not the trivial answer-nothing rule: the exact risk above t is (1 - t) / 2 when
    # confidences are uniform on [0.5, 1], so t = 0.8 reaches 0.10 and a bound at n = 4000 is near it
    assert 0.8 <= threshold < 0.87
    assert answered.mean() > 0.25


@pytest.mark.parametrize("seed", [0, 5, 6])
def test_at_the_median_confidence_fresh_risk_lands_about_the_target_with_more_coverage(seed):
    confidence, correct = _answers(4000, seed)
    aimed = abstention_threshold(confidence, correct, 0.10, level=CONFIDENCE)
    promised = abstention_threshold(confidence, correct, 0.10, level=0.9)
    fresh_confidence, fresh_correct = _answers(50000, seed + 100)
    answered = fresh_confidence >= aimed
    assert abs((1 - fresh_correct[answered].mean()) - 0.10) <= 0.02
    assert aimed <= promised  # the promise costs coverage, never gives it


@pytest.mark.parametrize("level", [0.3, 1.0])
def test_a_confidence_level_outside_half_to_one_is_refused(level):
    confidence, correct = _answers(100, 4)
    with pytest.raises(ValueError, match="confidence level"):
        abstention_threshold(confidence, correct, 0.1, level=level)


def test_the_median_scan_is_not_ended_by_an_early_error_but_a_promise_is():
    # two errors among the 7 most confident answers, then 293 right ones, then only wrong ones: the
    # scan that stops at its first failure never gets past the dip; the estimate reads on, past the
    # right run, into the wrong tail until 10% of the answered are wrong (about 31 of them)
    confidence = np.linspace(0.99, 0.5, 400)
    correct = np.ones(400, dtype=bool)
    correct[[3, 5]] = False
    correct[300:] = False
    aimed = abstention_threshold(confidence, correct, 0.10, level=CONFIDENCE)
    assert confidence[340] < aimed <= confidence[310]
    assert abstention_threshold(confidence, correct, 0.10, level=0.9) > aimed


def test_a_target_no_threshold_can_hold_means_always_abstain():
    confidence, correct = _answers(30, 2)
    assert abstention_threshold(confidence, correct, 0.01) == NEVER
    assert NEVER > 1.0 and math.isfinite(NEVER)


def test_tied_confidences_are_answered_together():
    confidence = np.array([0.9, 0.9, 0.9, 0.6])
    correct = np.array([True, True, False, True])
    threshold = abstention_threshold(confidence, correct, 0.99)
    assert threshold in (0.9, 0.6)


def test_conformal_sets_hold_the_right_label_at_the_target_rate_on_fresh_answers():
    rng = np.random.default_rng(3)

    def draw(n):
        logits = rng.normal(0, 2.0, (n, 5))
        p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        gold = np.array([rng.choice(5, p=row) for row in p])
        return p, gold

    p, gold = draw(2000)
    threshold = conformal_threshold(p[np.arange(len(gold)), gold], 0.9)
    fresh, fresh_gold = draw(10000)
    sets = [answer_set(list(row), threshold) for row in fresh]
    coverage = np.mean([g in s for s, g in zip(sets, fresh_gold)])
    assert 0.88 <= coverage <= 0.93
    assert np.mean([len(s) for s in sets]) < 5


def test_a_set_always_holds_the_top_label_first():
    assert answer_set([0.2, 0.5, 0.3], 0.9) == [1]
    assert answer_set([0.2, 0.5, 0.3], 0.25) == [1, 2]


def test_too_few_examples_for_the_coverage_put_every_label_in_the_set():
    assert conformal_threshold(np.array([0.9, 0.8, 0.7]), 0.9) == 0.0


def test_risk_coverage_answers_the_most_confident_first():
    coverage, risk = risk_coverage(np.array([0.9, 0.6, 0.8]), np.array([True, False, False]))
    assert coverage.tolist() == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert risk.tolist() == pytest.approx([0.0, 0.5, 2 / 3])


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1])
def test_a_target_outside_zero_one_is_refused(bad):
    with pytest.raises(ValueError):
        abstention_threshold(np.array([0.9]), np.array([True]), bad)
    with pytest.raises(ValueError):
        conformal_threshold(np.array([0.9]), bad)


def test_the_default_is_a_promise_at_nine_in_ten():
    confidence, correct = _answers(4000, 7)
    assert DEFAULT_CONFIDENCE == 0.9
    assert abstention_threshold(confidence, correct, 0.10) == abstention_threshold(confidence, correct, 0.10, level=0.9)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_supported_risk_is_the_lowest_target_some_threshold_meets(seed):
    confidence, correct = _answers(60, seed)
    supported = supported_risk(confidence, correct)
    assert supported is not None
    assert abstention_threshold(confidence, correct, supported) != NEVER
    below = round(supported - 0.01, 2)
    assert below <= 0 or abstention_threshold(confidence, correct, below) == NEVER


def test_answers_that_are_all_wrong_support_no_risk():
    assert supported_risk(np.linspace(0.9, 0.6, 40), np.zeros(40, dtype=bool)) is None
