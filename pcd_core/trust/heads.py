"""Trained heads: a linear probe on the hidden state a decision already reads, fitted on a user's labels.

Zero-shot, a small model is a weak decider (SmolLM2-135M: 0.50 on polarity, 0.30 on five topics); its
final hidden state at the field's first decision point often separates the labels far better than
its next-token probabilities do. That state is the LM head's input at a position the engine reads
anyway (``Backend.score(..., hidden=True)``, pcd_core/backends/base.py), so a head costs no pass and
no row token.

A head is multinomial logistic regression on standardised states (scikit-learn's
``LogisticRegression``, the ``heads`` extra), its L2 strength chosen by stratified cross-validation on
the train split by log-loss (``_strength_search``), so that its probabilities are calibrated where
they were fitted. Applying a head is numpy alone: a served engine never needs scikit-learn. Each head
names the model it was fitted on and the width of its states, and refuses any other
(``check_model``): a probe of one model's states means nothing on another's.

A head can carry its own abstention and answer-set thresholds (pcd_core/trust/selective.py), fitted on its
*out-of-fold* probabilities (``out_of_fold``): each train example scored by a head refitted, at the
chosen strength, on the folds that leave it out. The head's probabilities on its own train examples
are more confident than on new ones, so thresholds fitted on them would answer too often; the
out-of-fold ones were never fitted on the example they score.

``tests/test_heads.py`` fits heads on states of known structure and on the real model's states;
``tests/test_eval_decisions.py`` checks that out-of-fold probabilities do not know their own label.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pcd_core.backends.base import FINAL_STATE
from pcd_core.errors import OptionError, PcdError

INSTALL_HINT = "fitting a head needs scikit-learn: pip install 'pcd-engine[heads]'"

#: the L2 strengths tried (scikit-learn's C, the inverse strength), weakest fit first
STRENGTHS = tuple(float(c) for c in np.logspace(-4, 2, 13))

#: cross-validation folds, fewer when a label has fewer train examples than this
FOLDS = 5

#: the search stops once this many strengths in a row after the best have a higher held-out loss
PATIENCE = 2

#: lbfgs run to the optimum: the library's default tolerance leaves probabilities 1e-4 short of it
TOLERANCE = 1e-8
MAX_ITER = 5000


@dataclass(frozen=True, eq=False)
class Head:
    """One field's probe: ``softmax(weights @ (hidden - mean) / scale + bias)`` over ``labels``."""

    labels: tuple[str, ...]
    model: str
    mean: np.ndarray  # [width]
    scale: np.ndarray  # [width]
    weights: np.ndarray  # [labels, width]
    bias: np.ndarray  # [labels]
    strength: float  # the C cross-validation chose
    n_train: int
    # answer only at a top probability >= this; None: never abstain (fitted on out-of-fold probabilities)
    abstain_below: float | None = None
    # the answer set holds every label of probability >= this, and the top one; None: no set
    set_threshold: float | None = None
    # what the states it reads hold, a leading run of Backend.hidden_parts (pcd_core/backends/base.py);
    # a head saved before there were parts read the final state alone
    parts: tuple[str, ...] = FINAL_STATE

    @property
    def width(self) -> int:
        return int(self.mean.shape[0])

    def check_model(self, model: str, width: int) -> None:
        """Refuse states of another model: same name and same hidden size, or a typed error."""
        if model != self.model or width != self.width:
            raise OptionError(
                f"this head was fitted on {self.model!r} (hidden size {self.width}), not {model!r} "
                f"(hidden size {width}); refit it with pcd calibrate --head probe on that model"
            )

    def probabilities(self, hidden: np.ndarray) -> np.ndarray:
        """Label probabilities for states ``[n, width]`` (or one state ``[width]``). States that hold
        more parts than the head reads (a final-state head on a backend that gives the middle layers'
        mean too) are read up to the head's width: the parts come in ``Backend.hidden_parts``' order.
        """
        states = np.atleast_2d(np.asarray(hidden, dtype=np.float64))
        part = self.width // len(self.parts)
        if states.shape[1] < self.width or states.shape[1] % part:
            raise OptionError(
                f"a head reading the {'+'.join(self.parts)} state of hidden size {part} ({self.width} values) got "
                f"states of size {states.shape[1]}"
            )
        states = states[:, : self.width]
        scores = ((states - self.mean) / self.scale) @ self.weights.T + self.bias
        scores -= scores.max(axis=1, keepdims=True)
        weights = np.exp(scores)
        probabilities = weights / weights.sum(axis=1, keepdims=True)
        return probabilities[0] if np.ndim(hidden) == 1 else probabilities

    def to_dict(self) -> dict[str, Any]:
        return {
            "labels": list(self.labels),
            "model": self.model,
            "mean": self.mean.tolist(),
            "scale": self.scale.tolist(),
            "weights": self.weights.tolist(),
            "bias": self.bias.tolist(),
            "strength": self.strength,
            "n_train": self.n_train,
            "abstain_below": self.abstain_below,
            "set_threshold": self.set_threshold,
            "parts": list(self.parts),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Head:
        try:
            head = cls(
                labels=tuple(str(label) for label in data["labels"]),
                model=str(data["model"]),
                mean=np.asarray(data["mean"], dtype=np.float64),
                scale=np.asarray(data["scale"], dtype=np.float64),
                weights=np.asarray(data["weights"], dtype=np.float64),
                bias=np.asarray(data["bias"], dtype=np.float64),
                strength=float(data["strength"]),
                n_train=int(data["n_train"]),
                # a head saved before heads had thresholds has neither: it never abstains
                abstain_below=_optional_float(data.get("abstain_below")),
                set_threshold=_optional_float(data.get("set_threshold")),
                parts=tuple(str(part) for part in data.get("parts") or FINAL_STATE),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise PcdError(f"a head in the calibration file is malformed: {error}") from error
        n_labels, width = len(head.labels), head.width
        shapes_agree = (
            head.scale.shape == (width,) and head.weights.shape == (n_labels, width) and head.bias.shape == (n_labels,)
        )
        parts_agree = head.parts[:1] == FINAL_STATE and width % len(head.parts) == 0
        if n_labels < 2 or not shapes_agree or not parts_agree or not np.all(head.scale > 0):
            raise PcdError("a head in the calibration file is malformed: its shapes or scales do not agree")
        for threshold in (head.abstain_below, head.set_threshold):
            if threshold is not None and not 0 <= threshold <= 2:
                raise PcdError(f"a head in the calibration file is malformed: a threshold of {threshold!r}")
        return head


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _train_states(hidden: np.ndarray, gold: Sequence[int], labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The states and gold indices as arrays, checked: one state per gold index, two or more of every label.

    Every label needs at least two examples (a fold must be able to hold one out); a label never seen
    cannot be predicted, so that is a typed error rather than a head that silently never says it.
    """
    states = np.asarray(hidden, dtype=np.float64)
    answers = np.asarray(gold, dtype=np.int64)
    if states.ndim != 2 or len(states) != len(answers):
        raise OptionError(f"a head needs one state per example: {states.shape} states, {len(answers)} labels")
    counts = np.bincount(answers, minlength=len(labels))
    if len(counts) > len(labels) or int(counts.min()) < 2:
        scarce = [label for label, count in zip(labels, counts) if count < 2]
        raise OptionError(f"a head needs two or more train examples of every label; too few of {scarce}")
    return states, answers


def _folds(answers: np.ndarray, seed: int, groups: np.ndarray | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The stratified folds of the strength search, the same ones for the same labels, groups and seed.

    With ``groups`` (pcd_core/trust/near_duplicates.py) no group is split across folds, so a held-out example
    has no near-copy in the fold that scores it; without any group of two or more, the folds are drawn
    as before groups existed.
    """
    from sklearn.model_selection import StratifiedGroupKFold, StratifiedKFold

    n_splits = min(FOLDS, int(np.bincount(answers).min()))
    positions = np.zeros((len(answers), 1))
    if groups is not None and len(np.unique(groups)) < len(answers):
        grouped = StratifiedGroupKFold(n_splits=n_splits, shuffle=True, random_state=seed)
        return list(grouped.split(positions, answers, groups))
    return list(StratifiedKFold(n_splits=n_splits, shuffle=True, random_state=seed).split(positions, answers))


def _scaling(states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per coordinate, the mean and the standard deviation a head standardises its states by; a
    constant coordinate carries nothing, so it is left unscaled.
    """
    mean, scale = states.mean(axis=0), states.std(axis=0)
    scale[scale == 0] = 1.0
    return mean, scale


def _rows(weights: np.ndarray, bias: np.ndarray, n_labels: int) -> tuple[np.ndarray, np.ndarray]:
    """A scikit-learn fit's scores as one row per label: with two labels it keeps one row, the second's."""
    if n_labels == 2:
        return np.vstack([np.zeros_like(weights), weights]), np.concatenate([[0.0], bias])
    return np.asarray(weights, dtype=np.float64), np.asarray(bias, dtype=np.float64)


def _require_sklearn() -> None:
    """Refuse to fit before any work when the ``heads`` extra is missing, with its install hint."""
    try:
        import sklearn  # noqa: F401
    except ImportError as error:
        raise PcdError(INSTALL_HINT) from error


def _regression(strength: float) -> Any:
    """An L2 logistic regression run to the optimum; a refit of the same object starts from its last
    solution (``_strength_search`` walks the strengths so), a new one from zero.
    """
    from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=strength, tol=TOLERANCE, max_iter=MAX_ITER, warm_start=True)


@dataclass(frozen=True)
class Search:
    """What ``_strength_search`` found: the chosen index into ``STRENGTHS``, how many strengths it fitted,
    and the mean of the chosen fits' weights and biases, where the final fit starts (None: from zero).
    """

    chosen: int
    walked: int
    start: tuple[np.ndarray, np.ndarray] | None


def _strength_search(
    standard: np.ndarray, answers: np.ndarray, folds: list[tuple[np.ndarray, np.ndarray]], n_labels: int
) -> Search:
    """The strength whose fits have the least held-out log-loss summed over ``folds``.

    Each fold's regression walks the strengths from the strongest penalty (the smallest C) to the
    weakest, warm-started from the previous one's solution, as ``LogisticRegressionCV`` does; unlike it,
    the walk stops ``PATIENCE`` strengths past the best once each of them scored worse. The held-out loss
    of an L2 path falls to one minimum and rises after it (every head in docs/eval/heads/ chose 0.032 or
    less), and the weak penalties past it are the slowest fits: in one fold of SmolLM2-135M's 1,000 20ng
    states the seven from C = 0.1 up took 80% of the whole grid's time, for fits never chosen.
    """
    from sklearn.metrics import log_loss

    fits = [_regression(STRENGTHS[0]) for _ in folds]
    everyone = np.arange(n_labels)
    best, best_loss, worse, start = 0, np.inf, 0, None
    for index, strength in enumerate(STRENGTHS):
        loss = 0.0
        for fit, (kept, left_out) in zip(fits, folds):
            fit.set_params(C=strength)
            fit.fit(standard[kept], answers[kept])
            loss += log_loss(answers[left_out], _full_rows(fit, standard[left_out], n_labels), labels=everyone)
        if loss < best_loss:
            best, best_loss, worse = index, loss, 0
            same = len({f.coef_.shape for f in fits}) == 1  # a fold without some label fits fewer rows
            start = (
                (np.mean([f.coef_ for f in fits], axis=0), np.mean([f.intercept_ for f in fits], axis=0))
                if same
                else None
            )
        else:
            worse += 1
            if worse == PATIENCE:
                break
    return Search(best, index + 1, start)


def _full_rows(fit: Any, standard: np.ndarray, n_labels: int) -> np.ndarray:
    """A fold fit's probabilities over every label: a label its train folds lacked gets none."""
    rows = np.zeros((len(standard), n_labels))
    rows[:, fit.classes_] = fit.predict_proba(standard)
    return rows


def fit_head(
    hidden: np.ndarray,
    gold: Sequence[int],
    labels: Sequence[str],
    model: str,
    *,
    seed: int = 0,
    parts: tuple[str, ...] = FINAL_STATE,
    groups: np.ndarray | None = None,
) -> Head:
    """Fit one field's head on train states ``[n, width]`` holding ``parts`` and their gold label
    indices (``_train_states`` says what they need), its strength chosen on folds that keep each of
    ``groups`` whole (``_folds``), then fitted on all of them from the folds' mean solution.
    """
    _require_sklearn()
    states, answers = _train_states(hidden, gold, labels)
    mean, scale = _scaling(states)
    standard = (states - mean) / scale
    search = _strength_search(standard, answers, _folds(answers, seed, groups), len(labels))
    model_fit = _regression(STRENGTHS[search.chosen])
    if search.start is not None:
        model_fit.coef_, model_fit.intercept_ = search.start
    model_fit.fit(standard, answers)
    weights, bias = _rows(model_fit.coef_, model_fit.intercept_, len(labels))
    return Head(
        labels=tuple(labels),
        model=model,
        mean=mean,
        scale=scale,
        weights=weights,
        bias=bias,
        strength=STRENGTHS[search.chosen],
        n_train=len(answers),
        parts=parts,
    )


def out_of_fold(
    hidden: np.ndarray, gold: Sequence[int], head: Head, *, seed: int = 0, groups: np.ndarray | None = None
) -> np.ndarray:
    """Each train example's label probabilities ``[n, labels]`` from a head fitted without it (nor
    without any example of its group).

    The folds are those ``fit_head`` searched the strength on (same labels, groups and seed); in each, the
    states are standardised on the other folds alone and the regression refitted there at the
    ``head``'s strength. The strength itself was chosen on all folds: one number, against the head's
    hundreds of weights, so it leaks little of the example into its own score. A label whose every
    example one fold holds (one group of near-duplicates) is unknown to that fold's fit: its examples
    get none of it, which is what a head that never saw the label would say.
    """
    _require_sklearn()
    states, answers = _train_states(hidden, gold, head.labels)
    probabilities = np.zeros((len(answers), len(head.labels)))
    for kept, left_out in _folds(answers, seed, groups):
        mean, scale = _scaling(states[kept])
        fold_fit = _regression(head.strength)
        fold_fit.fit((states[kept] - mean) / scale, answers[kept])
        probabilities[left_out] = _full_rows(fold_fit, (states[left_out] - mean) / scale, len(head.labels))
    return probabilities
