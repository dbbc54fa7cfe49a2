"""Thresholds an agent acts on (pcd_core/evaluation/decisions.py, probing.py) on synthetic answers.

A trained head's abstention and answer-set thresholds are fitted on its out-of-fold probabilities
(pcd_core/trust/heads.py ``out_of_fold``): on states of pure noise a weakly regularised head fits its own
train examples well, and its out-of-fold probabilities must not (they never saw the example they
score). On states of known structure, the thresholds fitted that way must hold their targets on
held-out answers, and ``decision_report`` must report them under ``head`` beside the zero-shot ones.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pcd_core.evaluation.decisions import decision_report, fitted_thresholds, with_decisions
from pcd_core.evaluation.probing import fit_heads
from pcd_core.evaluation.runner import Answers, FieldAnswers
from pcd_core.trust.calibration import Calibration, FieldCalibration
from pcd_core.trust.heads import Head, fit_head, out_of_fold
from pcd_core.trust.selective import NEVER

pytest.importorskip("sklearn", reason="fitting a head needs the 'heads' extra")

LABELS = ("north", "south", "east")
WIDTH = 16


def _answers(n: int, seed: int, signal: float = 1.6) -> Answers:
    """``n`` examples: flat zero-shot rows, and states whose gold coordinate is raised by ``signal``,
    so that a probe is right often but not always (about 0.75 at 1.6) and its confidence means something.
    """
    rng = np.random.default_rng(seed)
    gold = rng.integers(0, len(LABELS), n)
    out = FieldAnswers(LABELS)
    for label in gold:
        state = rng.standard_normal(WIDTH)
        state[label] += signal
        out.probabilities.append([0.4, 0.3, 0.3])
        out.candidate_mass.append(0.9)
        out.gold.append(int(label))
        out.hidden.append(state)
    return Answers(None, {"wind": out}, {"wind": (1 / 3, 1 / 3, 1 / 3)})


def test_out_of_fold_probabilities_do_not_know_their_own_label() -> None:
    rng = np.random.default_rng(7)
    states, gold = rng.standard_normal((90, 60)), np.tile([0, 1, 2], 30)
    weak = replace(fit_head(states, gold, LABELS, "m"), strength=100.0)  # barely regularised: it can memorise
    from sklearn.linear_model import LogisticRegression

    standardised = (states - states.mean(axis=0)) / states.std(axis=0)
    in_sample = LogisticRegression(C=100.0, max_iter=5000).fit(standardised, gold).predict(standardised)
    assert float(np.mean(in_sample == gold)) == 1.0  # 60 noise coordinates, 90 examples: separable
    rows = out_of_fold(states, gold, weak)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-12)
    assert float(np.mean(rows.argmax(axis=1) == gold)) < 0.5  # chance is 1/3


def test_out_of_fold_rows_follow_the_heads_folds_and_seed() -> None:
    train = _answers(150, 0).fields["wind"]
    head = fit_head(train.states(), train.gold, LABELS, "m", seed=3)
    again = out_of_fold(train.states(), train.gold, head, seed=3)
    np.testing.assert_allclose(out_of_fold(train.states(), train.gold, head, seed=3), again)
    assert not np.allclose(out_of_fold(train.states(), train.gold, head, seed=4), again)


def test_head_thresholds_fitted_out_of_fold_hold_their_targets_held_out() -> None:
    train, test = _answers(1500, 1), _answers(3000, 2)
    heads = fit_heads(train, "model-a", abstain_risk=0.1, coverage=0.9)
    head = heads["wind"]
    assert head.abstain_below is not None and 0.34 < head.abstain_below < 1
    assert head.set_threshold is not None and 0 < head.set_threshold < 0.5
    report = decision_report(test, Calibration("model-a", False, {}, {}, abstain_risk=0.1, coverage=0.9, heads=heads))
    held_out = report["head"]["overall"]
    assert held_out["n"] == 3000.0 and "wind" in report["head"]["fields"]
    assert held_out["risk"] <= 0.1 + 0.02 and 0.2 < held_out["coverage"] < 1  # answers some, not all
    assert 0.88 <= held_out["set_coverage"] <= 0.94 and 1 < held_out["mean_set_size"] < 3
    # the brute-force reading of the same numbers, from the head's rows and its two thresholds
    rows, gold = head.probabilities(test.fields["wind"].states()), np.asarray(test.fields["wind"].gold)
    answered = rows.max(axis=1) >= head.abstain_below
    assert held_out["coverage"] == pytest.approx(answered.mean())
    assert held_out["risk"] == pytest.approx(np.mean(rows[answered].argmax(axis=1) != gold[answered]))
    in_set = [rows[i, gold[i]] >= head.set_threshold or rows[i].argmax() == gold[i] for i in range(len(gold))]
    assert held_out["set_coverage"] == pytest.approx(np.mean(in_set))


def test_in_sample_thresholds_answer_more_than_out_of_fold_ones_on_noise() -> None:
    """What out-of-fold fitting prevents: on states that carry nothing, a head fitted on its own
    examples looks right often enough to answer; the out-of-fold rows show it is not.
    """
    rng = np.random.default_rng(11)
    states, gold = rng.standard_normal((300, 120)), np.tile([0, 1, 2], 100)
    weak = replace(fit_head(states, gold, LABELS, "m"), strength=100.0)
    in_sample = weak.probabilities(states)
    naive, _ = fitted_thresholds(in_sample, gold, 0.1, None)
    honest, _ = fitted_thresholds(out_of_fold(states, gold, weak), gold, 0.1, None)
    assert naive is not None and naive < 1 and honest == NEVER


def test_a_head_without_thresholds_adds_no_head_rows_and_zero_shot_rows_stay() -> None:
    train, test = _answers(200, 3), _answers(200, 4)
    zero_shot = Calibration("model-a", False, {"wind": FieldCalibration(LABELS, 1.0, (0.0, 0.0, 0.0))}, {})
    calibration = with_decisions(zero_shot, train, None, 0.9)
    plain = replace(calibration, heads=fit_heads(train, "model-a"))
    report = decision_report(test, plain)
    assert "head" not in report and report["fields"]["wind"]["set_coverage"] >= 0.85
    headed = replace(calibration, heads=fit_heads(train, "model-a", coverage=0.9))
    both = decision_report(test, headed)
    assert both["fields"] == report["fields"] and set(both["head"]["fields"]) == {"wind"}


def test_a_head_keeps_its_thresholds_through_its_file_and_refuses_bad_ones() -> None:
    train = _answers(120, 5).fields["wind"]
    head = replace(fit_head(train.states(), train.gold, LABELS, "m"), abstain_below=0.7, set_threshold=0.2)
    again = Head.from_dict(head.to_dict())
    assert (again.abstain_below, again.set_threshold) == (0.7, 0.2)
    older = {k: v for k, v in head.to_dict().items() if k not in ("abstain_below", "set_threshold")}
    assert Head.from_dict(older).abstain_below is None and Head.from_dict(older).set_threshold is None
    with pytest.raises(Exception, match="malformed"):
        Head.from_dict({**head.to_dict(), "abstain_below": 3.0})
