"""The default calibration's cross-validated choice (pcd_core/trust/calibration_choice.py), model-free.

Synthetic answers whose truth is known: a model that leans hard to one label (right less often than
the majority class, as SmolLM2-135M on polarity) must get a fit that undoes the lean; a model that is
already calibrated must keep its raw reading at 100 examples, since any fit there only adds noise.
"""

import numpy as np

from pcd_core.evaluation import metrics
from pcd_core.trust.calibration_choice import CANDIDATES, choose_fit


def _log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _binary(n, lean, seed):
    """Gold drawn from softmax(z); the model reads softmax(z + lean); its content-free prior is softmax(lean)."""
    rng = np.random.default_rng(seed)
    z = np.stack([rng.normal(0, 1.5, n), np.zeros(n)], axis=1)
    truth = np.exp(_log_softmax(z))
    gold = (rng.uniform(size=n) > truth[:, 0]).astype(int)
    read = _log_softmax(z + np.array(lean))
    prior = _log_softmax(np.array([lean]))
    return read, _log_softmax(read - prior), gold


def _apply(logp, choice):
    return np.exp(_log_softmax(np.maximum(logp, -30.0) / choice.temperature + np.array(choice.bias)))


def test_a_leaning_model_gets_a_fit_that_undoes_the_lean_and_beats_both_readings_on_fresh_answers():
    raw, debiased, gold = _binary(100, [3.0, 0.0], seed=0)
    choice = choose_fit(raw, debiased, gold)
    assert choice.candidate.name != "raw"
    assert choice.cv_nll[choice.candidate.name] < choice.cv_nll["raw"]
    fresh_raw, fresh_debiased, fresh_gold = _binary(5000, [3.0, 0.0], seed=1)
    calibrated = _apply(fresh_debiased if choice.candidate.debias else fresh_raw, choice)
    accuracy = metrics.accuracy(metrics.predictions(calibrated), fresh_gold)
    assert accuracy >= metrics.accuracy(metrics.predictions(np.exp(fresh_raw)), fresh_gold)
    assert accuracy >= metrics.accuracy(metrics.predictions(np.exp(fresh_debiased)), fresh_gold) - 0.01
    assert metrics.ece(calibrated, fresh_gold) < 0.05 < metrics.ece(np.exp(fresh_raw), fresh_gold)


def test_a_calibrated_model_keeps_its_raw_reading_at_a_hundred_examples():
    raw, _, gold = _binary(100, [0.0, 0.0], seed=2)
    choice = choose_fit(raw, raw, gold)
    assert choice.candidate == CANDIDATES[0]
    assert choice.temperature == 1.0 and choice.bias == (0.0, 0.0)


def test_every_candidate_is_scored_and_the_choice_is_refitted_on_all_examples():
    raw, debiased, gold = _binary(60, [2.0, 0.0], seed=3)
    choice = choose_fit(raw, debiased, gold)
    assert set(choice.cv_nll) == {c.name for c in CANDIDATES}
    assert all(np.isfinite(v) for v in choice.cv_nll.values())
    assert choose_fit(raw, debiased, gold) == choice  # the folds are seeded
