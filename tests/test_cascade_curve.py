"""A cascade's accuracy against cost (pcd_core/evaluation/cascade_curve.py) on synthetic answers.

The first engine is right with exactly its confidence, the second right 90% of the time: escalating
the least confident must raise accuracy toward the second's as the share escalated grows, each point
must equal a brute-force count, and a threshold fitted on one draw for a target must hold about it on
a fresh draw.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcd_core.evaluation.cascade_curve import cascade_curve, escalation_threshold, fit_escalation
from pcd_core.trust.calibration import Calibration, FieldCalibration


def _draw(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, 2, n)
    confidence = rng.uniform(0.5, 1.0, n)
    first_right = rng.uniform(size=n) < confidence
    first_pick = np.where(first_right, gold, 1 - gold)
    first = np.zeros((n, 2))
    first[np.arange(n), first_pick] = confidence
    first[np.arange(n), 1 - first_pick] = 1 - confidence
    second_pick = np.where(rng.uniform(size=n) < 0.9, gold, 1 - gold)
    second = np.full((n, 2), 0.2)
    second[np.arange(n), second_pick] = 0.8
    return first, second, gold


def test_each_point_is_the_count_it_names():
    first, second, gold = _draw(500, 0)
    for point in cascade_curve(first, second, gold, 0.1, 1.0):
        up = first.max(axis=1) < point.threshold
        answer = np.where(up, second.argmax(axis=1), first.argmax(axis=1))
        assert point.escalated == pytest.approx(up.mean())
        assert point.accuracy == pytest.approx((answer == gold).mean())
        assert point.seconds_per_example == pytest.approx(0.1 + 1.0 * up.mean())


def test_escalating_the_least_confident_buys_accuracy_and_ends_at_the_second_engine():
    first, second, gold = _draw(4000, 1)
    points = cascade_curve(first, second, gold, 0.1, 1.0)
    assert points[0].escalated == 0 and points[-1].escalated == 1
    assert points[-1].accuracy == pytest.approx((second.argmax(axis=1) == gold).mean())
    half = escalation_threshold(points, max_escalated=0.5)
    assert half is not None and half.accuracy > points[0].accuracy + 0.05


def test_a_threshold_fitted_for_a_target_holds_about_it_on_fresh_answers():
    points = cascade_curve(*_draw(4000, 2), 0.1, 1.0)
    chosen = escalation_threshold(points, accuracy=0.85)
    assert chosen is not None and chosen.accuracy >= 0.85
    fresh = cascade_curve(*_draw(20000, 3), 0.1, 1.0, thresholds=(chosen.threshold,))[0]
    assert fresh.accuracy == pytest.approx(chosen.accuracy, abs=0.02)
    assert escalation_threshold(points, accuracy=0.99) is None  # beyond what either engine does
    with pytest.raises(ValueError, match="one of the two"):
        escalation_threshold(points)


def test_fit_escalation_meets_each_target_at_a_distinct_top_probability_and_the_file_keeps_it(tmp_path):
    first, second, gold = _draw(2000, 4)
    escalation, short = fit_escalation({"a": first}, {"a": second}, {"a": gold}, "bigger", accuracy=0.85)
    assert short == [] and escalation.next_model == "bigger" and escalation.accuracy == 0.85
    below = escalation.below["a"]
    assert below in set(first.max(axis=1).tolist())  # not a grid point: the exact cut
    # the point it keeps is the count it names, and no smaller escalation reaches the target
    kept = cascade_curve(first, second, gold, 0.0, 0.0, thresholds=(below,))[0]
    assert kept.accuracy >= 0.85 and escalation.on_train["a"]["escalated"] == pytest.approx(kept.escalated)
    lower = [t for t in set(first.max(axis=1).tolist()) if t < below]
    assert all(p.accuracy < 0.85 for p in cascade_curve(first, second, gold, 0.0, 0.0, thresholds=tuple(lower)))
    by_share, _ = fit_escalation({"a": first}, {"a": second}, {"a": gold}, "bigger", max_escalated=0.3)
    within = [p for p in cascade_curve(first, second, gold, 0.0, 0.0, thresholds=(0.0, 0.6, 0.7)) if p.escalated <= 0.3]
    assert by_share.on_train["a"]["escalated"] <= 0.3
    assert by_share.on_train["a"]["accuracy"] >= max(p.accuracy for p in within)
    # out of reach: the most accurate point, and a line that says so
    out_of_reach, short = fit_escalation({"a": first}, {"a": second}, {"a": gold}, "bigger", accuracy=0.99)
    assert len(short) == 1 and "out of reach" in short[0]
    assert out_of_reach.on_train["a"]["accuracy"] < 0.99
    field = FieldCalibration(("x", "y"), 1.0, (0.0, 0.0))
    path = tmp_path / "cal.json"
    Calibration("m", False, {"a": field}, escalation=escalation).save(path)
    assert Calibration.load(path).escalation == escalation
