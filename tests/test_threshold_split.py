"""The abstention promise (pcd_core/trust/selective.py, pcd_core/evaluation/decisions.py), model-free.

The calibration and the thresholds are fitted on two disjoint parts of the train split
(``threshold_split``), and the thresholds' targets are then checked on fresh answers of the same
law that neither fit saw: answer sets must hold the gold label at the target rate on average over
many train draws, and the abstention bound (at its default confidence, 0.9) must keep the error at
or below the target in about that share of draws. A target the labels cannot support is named with
the risk they can.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcd_core.errors import PcdError
from pcd_core.evaluation.decisions import (
    choose_calibration,
    decision_report,
    threshold_split,
    unsupported,
    with_decisions,
)
from pcd_core.evaluation.runner import Answers, FieldAnswers
from pcd_core.trust.selective import NEVER

LABELS = ("spam", "ham", "unsure")


def _answers(n: int, seed: int, offset: int = 0) -> Answers:
    """``n`` examples whose gold label is drawn from ``softmax(z)`` while the model reports the
    overconfident ``softmax(3 z + lean)``: a calibration has something to fix, and fitting it
    moves the probabilities the thresholds are fitted on.
    """
    rng = np.random.default_rng(seed)
    out = FieldAnswers(LABELS)
    for i in range(n):
        z = rng.normal(0.0, 2.0, len(LABELS))
        truth = np.exp(z) / np.exp(z).sum()
        said = np.exp(3 * z + np.array([1.0, 0.0, -1.0]))
        out.probabilities.append(list(said / said.sum()))
        out.candidate_mass.append(0.9)
        out.gold.append(int(rng.choice(len(LABELS), p=truth)))
        out.texts.append(f"example {offset + i}")
    return Answers(None, {"kind": out}, {"kind": (1 / 3, 1 / 3, 1 / 3)})


def _fitted(train: Answers, risk: float | None, coverage: float | None):
    parted = threshold_split(train)
    calibration = choose_calibration(parted.fit, "m", {})
    return parted, with_decisions(calibration, parted.thresholds, risk, coverage)


def test_the_split_parts_examples_disjointly_in_read_order():
    train = _answers(101, 0)
    parted = threshold_split(train)
    fit, thresholds = parted.fit.fields["kind"], parted.thresholds.fields["kind"]
    assert parted.sizes() == (51, 50)
    assert not set(fit.texts) & set(thresholds.texts)
    assert fit.texts == train.fields["kind"].texts[:51]
    assert thresholds.gold == train.fields["kind"].gold[51:]
    with pytest.raises(PcdError, match="at least 2"):
        threshold_split(_answers(1, 0))


def test_sets_fitted_on_the_other_part_hold_the_target_on_examples_no_fit_saw():
    fresh = _answers(4000, 999, offset=10_000)
    coverages = []
    for seed in range(12):
        _, calibration = _fitted(_answers(120, seed), None, 0.9)
        report = decision_report(fresh, calibration)
        coverages.append(report["overall"]["set_coverage"])
    # split conformal: at least 0.9 in expectation over train draws, and not far above it
    assert 0.885 <= float(np.mean(coverages)) <= 0.96  # 0.9 in expectation; 12 draws of about 0.03 each


def test_the_default_abstention_bound_keeps_fresh_risk_below_the_target_in_most_draws():
    fresh = _answers(4000, 998, offset=10_000)
    held, answered = [], []
    for seed in range(12):
        _, calibration = _fitted(_answers(400, 100 + seed), 0.2, None)
        assert calibration.abstain_confidence == 0.9
        overall = decision_report(fresh, calibration)["overall"]
        answered.append(overall["coverage"])
        held.append(overall["risk"] is None or overall["risk"] <= 0.2)
    assert np.mean(held) >= 0.8  # promised in 9 of 10 draws
    assert np.mean(answered) > 0.2  # and it answers: not the trivial abstain-always rule


def test_a_risk_the_labels_cannot_support_is_named_with_the_one_they_can():
    parted, calibration = _fitted(_answers(60, 3), 0.01, None)
    assert calibration.fields["kind"].abstain_below == NEVER
    lines = unsupported(calibration, parted.thresholds, 0.01)
    assert len(lines) == 1
    assert "the 30 threshold labels cannot support risk 0.01 at confidence 0.90" in lines[0]
    assert "the lowest they support is" in lines[0] or "support no risk" in lines[0]
    assert unsupported(calibration, parted.thresholds, None) == []
