"""Trained heads (pcd_core/trust/heads.py): what they fit, how they apply, and what they refuse."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pcd_core.errors import OptionError, PcdError
from pcd_core.trust.heads import (
    MAX_ITER,
    PATIENCE,
    STRENGTHS,
    TOLERANCE,
    Head,
    _folds,
    _scaling,
    _strength_search,
    fit_head,
    out_of_fold,
)

sklearn = pytest.importorskip("sklearn")
from sklearn.linear_model import LogisticRegression  # noqa: E402

WIDTH = 24


def _clusters(n_per_label: int, n_labels: int, spread: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """States around one centre per label, the label signal in a few coordinates among noisy ones."""
    rng = np.random.default_rng(seed)
    centres = np.zeros((n_labels, WIDTH))
    centres[:, :n_labels] = 3.0 * np.eye(n_labels)
    gold = np.repeat(np.arange(n_labels), n_per_label)
    states = centres[gold] + spread * rng.standard_normal((len(gold), WIDTH)) + 50.0  # far from the origin
    return states, gold


@pytest.mark.parametrize("n_labels", [2, 5])
def test_a_head_separates_held_out_states_and_matches_the_library(n_labels):
    states, gold = _clusters(100, n_labels, spread=1.0, seed=0)
    labels = [f"label{k}" for k in range(n_labels)]
    head = fit_head(states, gold, labels, "model-a")
    test_states, test_gold = _clusters(40, n_labels, spread=1.0, seed=1)
    probabilities = head.probabilities(test_states)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-12)
    # the best any rule can do here: the nearest true centre (equal spreads, equal priors)
    centres = np.zeros((n_labels, WIDTH))
    centres[:, :n_labels] = 3.0 * np.eye(n_labels)
    nearest = np.argmin((((test_states - 50.0)[:, None, :] - centres[None]) ** 2).sum(axis=2), axis=1)
    bayes = float(np.mean(nearest == test_gold))
    assert float(np.mean(probabilities.argmax(axis=1) == test_gold)) >= bayes - 0.05
    # the two-label case keeps one row in scikit-learn: the expanded head must give its probabilities
    library = LogisticRegression(C=head.strength, tol=1e-10, max_iter=5000).fit((states - head.mean) / head.scale, gold)
    np.testing.assert_allclose(probabilities, library.predict_proba((test_states - head.mean) / head.scale), atol=1e-5)
    np.testing.assert_allclose(head.probabilities(test_states[0]), probabilities[0])


@pytest.mark.parametrize(("n_labels", "spread"), [(2, 1.0), (5, 1.0), (3, 4.0)])
def test_the_search_stops_past_the_best_strength_and_chooses_as_the_whole_grid(n_labels, spread):
    """Against the library's search over every strength on the same folds: the same strength and the
    same head, from fewer fits wherever the best strength lies two or more below the grid's end."""
    from sklearn.linear_model import LogisticRegressionCV

    states, gold = _clusters(60, n_labels, spread=spread, seed=4)
    mean, scale = _scaling(states)
    folds = _folds(gold, 0, None)
    search = _strength_search((states - mean) / scale, gold, folds, n_labels)
    whole = LogisticRegressionCV(
        Cs=list(STRENGTHS),
        l1_ratios=(0.0,),
        cv=folds,
        scoring="neg_log_loss",
        tol=TOLERANCE,
        max_iter=MAX_ITER,
        use_legacy_attributes=False,
    ).fit((states - mean) / scale, gold)
    assert STRENGTHS[search.chosen] == whole.C_
    assert search.walked == min(search.chosen + 1 + PATIENCE, len(STRENGTHS))
    head = fit_head(states, gold, [f"label{k}" for k in range(n_labels)], "model-a")
    np.testing.assert_allclose(head.probabilities(states), whole.predict_proba((states - mean) / scale), atol=1e-6)


def test_a_label_one_fold_holds_whole_is_searched_and_scored_out_of_fold_as_unknown():
    """Three examples of a rare label in one group of near-duplicates land in one fold: the fits of
    the other folds never see it, and the search and the out-of-fold scores must still hold all labels."""
    states, gold = _clusters(30, 3, spread=1.0, seed=5)
    rare = np.flatnonzero(gold == 2)[:3]
    keep = np.concatenate([np.flatnonzero(gold != 2), rare])
    states, gold = states[keep], gold[keep]
    groups = np.arange(len(gold))
    groups[-3:] = -1  # the rare label's three examples are one group
    head = fit_head(states, gold, ["x", "y", "z"], "model-a", groups=groups)
    assert head.weights.shape == (3, WIDTH)
    rows = out_of_fold(states, gold, head, groups=groups)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_array_equal(rows[-3:, 2], 0.0)  # scored by a fit that never saw the label
    assert float(np.mean(rows[:-3].argmax(axis=1) == gold[:-3])) >= 0.9


def test_noise_gets_a_strong_penalty_and_near_uniform_probabilities():
    rng = np.random.default_rng(3)
    states, gold = rng.standard_normal((120, WIDTH)), np.tile([0, 1, 2], 40)
    head = fit_head(states, gold, ["a", "b", "c"], "model-a")
    assert head.strength <= 1e-2  # cross-validation picked a weak fit: there is nothing to learn
    assert float(np.abs(head.probabilities(rng.standard_normal((50, WIDTH))) - 1 / 3).max()) < 0.1


def test_a_head_survives_its_file_and_refuses_another_model():
    states, gold = _clusters(10, 3, spread=1.0, seed=2)
    head = fit_head(states, gold, ["x", "y", "z"], "smollm2-135m")
    again = Head.from_dict(json.loads(json.dumps(head.to_dict())))
    np.testing.assert_allclose(again.probabilities(states), head.probabilities(states))
    assert (again.labels, again.model, again.n_train) == (("x", "y", "z"), "smollm2-135m", 30)
    again.check_model("smollm2-135m", WIDTH)
    with pytest.raises(OptionError, match="fitted on 'smollm2-135m'"):
        again.check_model("qwen2.5-coder-0.5b", WIDTH)
    with pytest.raises(OptionError, match="hidden size"):
        again.check_model("smollm2-135m", 896)
    with pytest.raises(OptionError, match="hidden size 24"):
        again.probabilities(np.zeros(896))


@pytest.mark.parametrize(
    "broken",
    [
        {"labels": ["x"]},  # missing fields
        {"weights": [[0.0] * WIDTH] * 2},  # two rows for three labels
        {"scale": [0.0] * WIDTH},  # a zero scale would divide by zero
    ],
)
def test_a_malformed_head_is_refused(broken):
    states, gold = _clusters(5, 3, spread=1.0, seed=4)
    data = fit_head(states, gold, ["x", "y", "z"], "m").to_dict()
    data = {k: v for k, v in data.items() if k in broken} if "labels" in broken else {**data, **broken}
    with pytest.raises(PcdError, match="malformed"):
        Head.from_dict(data)


def test_too_few_examples_of_a_label_is_a_typed_error():
    states, gold = _clusters(5, 3, spread=1.0, seed=5)
    keep = np.concatenate([np.flatnonzero(gold != 2), np.flatnonzero(gold == 2)[:1]])
    with pytest.raises(OptionError, match=r"too few of \['z'\]"):
        fit_head(states[keep], gold[keep], ["x", "y", "z"], "m")
