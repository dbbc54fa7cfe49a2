"""The decision-quality metrics against values worked out by hand on small arrays (model-free)."""

import math

import numpy as np
import pytest

from pcd_core.evaluation import metrics

PROBS = [[0.9, 0.1], [0.6, 0.4], [0.3, 0.7], [0.8, 0.2]]
GOLD = [0, 1, 1, 0]  # predictions are 0, 0, 1, 0: three right


def test_accuracy_counts_the_argmax_matches():
    assert metrics.accuracy(metrics.predictions(PROBS), GOLD) == 0.75


def test_argmax_ties_go_to_the_lower_index():
    assert metrics.predictions([[0.5, 0.5], [0.2, 0.8]]).tolist() == [0, 1]


def test_macro_f1_is_the_mean_of_per_label_f1():
    # label 0: tp 2, fp 1, fn 0 -> 4/5; label 1: tp 1, fp 0, fn 1 -> 2/3
    assert metrics.macro_f1([0, 0, 1, 0], GOLD) == pytest.approx((0.8 + 2 / 3) / 2)


def test_macro_f1_scores_a_never_predicted_gold_label_zero_and_skips_absent_labels():
    # label 2 is gold once and never predicted: F1 0; label 1 is nowhere: left out
    assert metrics.macro_f1([0, 0], [0, 2], n_labels=3) == pytest.approx((2 / 3 + 0.0) / 2)


def test_nll_is_the_mean_negative_log_of_the_gold_probability():
    want = -(math.log(0.9) + math.log(0.4) + math.log(0.7) + math.log(0.8)) / 4
    assert metrics.nll(PROBS, GOLD) == pytest.approx(want)


def test_nll_of_a_zero_gold_probability_is_finite():
    assert metrics.nll([[1.0, 0.0]], [1]) == pytest.approx(-math.log(metrics.EPSILON))


def test_brier_sums_squared_errors_over_labels():
    # (0.01+0.01), (0.36+0.36), (0.09+0.09), (0.04+0.04) -> mean 0.25
    assert metrics.brier(PROBS, GOLD) == pytest.approx(0.25)


def test_brier_counts_every_label_of_a_multi_class_row():
    # gold 2: (0.5)^2 + (0.3)^2 + (0.8)^2 = 0.25 + 0.09 + 0.64
    assert metrics.brier([[0.5, 0.3, 0.2]], [2]) == pytest.approx(0.98)


def test_ece_weights_each_bins_gap_by_its_count():
    # confidences 0.9, 0.6, 0.7, 0.8 fall in four different bins of width 1/15:
    # gaps |1-0.9|, |0-0.6|, |1-0.7|, |1-0.8| -> (0.1+0.6+0.3+0.2)/4
    assert metrics.ece(PROBS, GOLD) == pytest.approx(0.3)


def test_ece_pools_answers_that_share_a_bin():
    # both confidences (0.95, 0.97) are in bin 14: mean confidence 0.96, accuracy 0.5
    assert metrics.ece([[0.95, 0.05], [0.03, 0.97]], [0, 0]) == pytest.approx(0.46)


def test_ece_if_calibrated_is_the_exact_mean_gap_of_answers_right_with_their_confidence():
    # alone in its bin, 0.75 is right (gap 0.25) three times in four and wrong (gap 0.75) once
    assert metrics.ece_if_calibrated([[0.75, 0.25]]) == pytest.approx(0.375)
    # 0.68 and 0.72 share bin 10 (mean 0.70): none right 0.32*0.28, both 0.68*0.72, one the rest,
    # with gaps 0.7, 0.3 and 0.2
    pair = 0.32 * 0.28 * 0.7 + 0.68 * 0.72 * 0.3 + (1 - 0.32 * 0.28 - 0.68 * 0.72) * 0.2
    assert pair == pytest.approx(0.29376)
    assert metrics.ece_if_calibrated([[0.68, 0.32], [0.28, 0.72]]) == pytest.approx(pair)
    # bins are weighted by their counts, as in ece
    together = [[0.75, 0.25], [0.68, 0.32], [0.28, 0.72]]
    assert metrics.ece_if_calibrated(together) == pytest.approx((0.375 + 2 * pair) / 3)


def test_ece_if_calibrated_is_what_calibrated_answers_score_on_average():
    rng = np.random.default_rng(1)
    confidence = rng.uniform(0.5, 1.0, size=60)
    rows = np.stack([confidence, 1 - confidence], axis=1)
    draws = [metrics.ece(rows, (rng.random(60) >= confidence).astype(int)) for _ in range(4000)]
    assert np.mean(draws) == pytest.approx(metrics.ece_if_calibrated(rows), abs=0.003)


def test_reliability_puts_an_edge_value_in_the_bin_below():
    bins = metrics.reliability([[1 / 3, 2 / 3]], [1])
    assert [b["count"] for b in bins].index(1) == 9  # 2/3 = 10/15 closes bin 9, (9/15, 10/15]


def test_auroc_is_the_share_of_right_wrong_pairs_ordered_right():
    # positives 0.9, 0.7, 0.8; negative 0.6: every pair ordered -> 1
    assert metrics.auroc([0.9, 0.6, 0.7, 0.8], [True, False, True, True]) == 1.0
    # positives 0.4, 0.8; negatives 0.5, 0.1: pairs (0.4>0.5 no, 0.4>0.1 yes, 0.8 yes, yes) -> 3/4
    assert metrics.auroc([0.4, 0.5, 0.8, 0.1], [True, False, True, False]) == 0.75


def test_auroc_counts_ties_half():
    # one positive and one negative at 0.5, one positive at 0.9: pairs 0.5 vs 0.5 (1/2), 0.9 vs 0.5 (1)
    assert metrics.auroc([0.5, 0.5, 0.9], [True, False, True]) == 0.75
    assert metrics.auroc([0.3, 0.3, 0.3], [True, False, True]) == 0.5


def test_auroc_is_nan_when_one_class_is_empty():
    assert math.isnan(metrics.auroc([0.1, 0.2], [True, True]))


def test_summarise_reports_every_metric_with_candidate_mass():
    report = metrics.summarise(PROBS, GOLD, candidate_mass=[0.9, 0.1, 0.8, 0.7])
    assert report["accuracy"] == 0.75 and report["brier"] == pytest.approx(0.25)
    assert report["auroc_candidate_mass"] == 1.0  # the one wrong answer has the lowest mass
    assert report["auroc_probability"] == 1.0  # and the lowest confidence, 0.6


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError):
        metrics.nll([[0.5, 0.5]], [0, 1])
