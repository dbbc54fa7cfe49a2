"""Decision-quality metrics on plain arrays: how often the answers are right, and whether a 0.8 means 80%.

Every function takes ``probabilities`` as an ``(n, k)`` array whose rows sum to 1 over the allowed
labels and ``gold`` as ``n`` label indices. Nothing here knows about models, so
``tests/test_metrics.py`` checks each against values worked out by hand on small arrays.

- ``ece``: expected calibration error over 15 equal-width confidence bins (Guo et al. 2017), the
  confidence being the top probability; bin ``b`` holds ``(b/15, (b+1)/15]`` and the first also holds 0.
- ``ece_if_calibrated``: the ECE that answers with these same confidences would show on average if
  they were perfectly calibrated, i.e. if each were right with exactly its confidence. On a few hundred
  examples it is far from 0 (a bin of 20 answers at 0.5 is off by 0.09 on average by chance alone), so
  it is the yardstick a measured ECE is read against: an ECE near it is as good as this many examples
  can show.
- ``auroc``: the probability that a random right answer scores above a random wrong one, ties counted
  half (the Mann-Whitney statistic). It says whether a score can tell right from wrong, whatever its scale.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: keeps the log of a zero probability finite; a model that gives the gold label 0 costs 36.8 nats
EPSILON = 1e-16

ECE_BINS = 15

Rows = Sequence[Sequence[float]] | np.ndarray  # (n, k) probabilities
Indices = Sequence[int] | np.ndarray  # n label indices
Scores = Sequence[float] | Sequence[bool] | np.ndarray


def _arrays(probabilities: Rows, gold: Indices) -> tuple[np.ndarray, np.ndarray]:
    p = np.asarray(probabilities, dtype=np.float64)
    g = np.asarray(gold, dtype=np.int64)
    if p.ndim != 2 or g.shape != (p.shape[0],):
        raise ValueError(f"probabilities must be (n, k) and gold (n,); got {p.shape} and {g.shape}")
    return p, g


def predictions(probabilities: Rows) -> np.ndarray:
    """The arg-max label per row; ties go to the lower index, as the engine breaks them."""
    return np.argmax(np.asarray(probabilities, dtype=np.float64), axis=1)


def accuracy(predicted: Indices, gold: Indices) -> float:
    pred, g = np.asarray(predicted), np.asarray(gold)
    return float(np.mean(pred == g)) if len(g) else math.nan


def macro_f1(predicted: Indices, gold: Indices, n_labels: int | None = None) -> float:
    """The unweighted mean of per-label F1. Labels that are neither gold nor predicted anywhere are
    left out (they have no F1); a label that is one but never the other scores 0.
    """
    pred, g = np.asarray(predicted), np.asarray(gold)
    labels = range(n_labels) if n_labels is not None else sorted(set(pred.tolist()) | set(g.tolist()))
    scores = []
    for label in labels:
        tp = int(np.sum((pred == label) & (g == label)))
        fp = int(np.sum((pred == label) & (g != label)))
        fn = int(np.sum((pred != label) & (g == label)))
        if tp + fp + fn == 0:
            continue
        scores.append(2 * tp / (2 * tp + fp + fn))
    return float(np.mean(scores)) if scores else math.nan


def nll(probabilities: Rows, gold: Indices) -> float:
    """Mean negative log-likelihood of the gold label, in nats."""
    p, g = _arrays(probabilities, gold)
    return float(np.mean(-np.log(np.maximum(p[np.arange(len(g)), g], EPSILON))))


def brier(probabilities: Rows, gold: Indices) -> float:
    """Multi-class Brier score: the mean over examples of the squared distance to the one-hot gold
    vector, summed over labels (0 is perfect, 2 is certain and wrong).
    """
    p, g = _arrays(probabilities, gold)
    onehot = np.zeros_like(p)
    onehot[np.arange(len(g)), g] = 1.0
    return float(np.mean(np.sum((p - onehot) ** 2, axis=1)))


def _bin_of(confidence: np.ndarray, n_bins: int) -> np.ndarray:
    """Each confidence's bin: bin b holds (b/n, (b+1)/n]; ceil puts an edge value in the bin below it,
    and 0 goes to bin 0. ``reliability`` and ``ece_if_calibrated`` bin alike through it.
    """
    return np.clip(np.ceil(confidence * n_bins).astype(np.int64) - 1, 0, n_bins - 1)


def reliability(probabilities: Rows, gold: Indices, n_bins: int = ECE_BINS) -> list[dict[str, float]]:
    """Per confidence bin: its edges, how many answers fall in it, their mean confidence and accuracy."""
    p, g = _arrays(probabilities, gold)
    confidence = p.max(axis=1)
    correct = predictions(p) == g
    index = _bin_of(confidence, n_bins)
    bins = []
    for b in range(n_bins):
        inside = index == b
        count = int(inside.sum())
        bins.append(
            {
                "low": b / n_bins,
                "high": (b + 1) / n_bins,
                "count": count,
                "confidence": float(confidence[inside].mean()) if count else math.nan,
                "accuracy": float(correct[inside].mean()) if count else math.nan,
            }
        )
    return bins


def ece(probabilities: Rows, gold: Indices, n_bins: int = ECE_BINS) -> float:
    """Expected calibration error: the count-weighted mean gap between accuracy and confidence per bin."""
    bins = reliability(probabilities, gold, n_bins)
    total = sum(b["count"] for b in bins)
    if total == 0:
        return math.nan
    return float(sum(b["count"] * abs(b["accuracy"] - b["confidence"]) for b in bins if b["count"]) / total)


def _poisson_binomial(chances: np.ndarray) -> np.ndarray:
    """The distribution of the number of successes of independent trials with these chances."""
    counts = np.zeros(len(chances) + 1)
    counts[0] = 1.0
    for i, chance in enumerate(chances, 1):
        counts[1 : i + 1] = counts[1 : i + 1] * (1 - chance) + counts[:i] * chance
        counts[0] *= 1 - chance
    return counts


def ece_if_calibrated(probabilities: Rows, n_bins: int = ECE_BINS) -> float:
    """The expected ECE of answers with these confidences if each were right with exactly its
    confidence: per bin, the exact mean of ``|accuracy - confidence|`` when the number right follows
    the Poisson-binomial law of the confidences (no sampling, so no seed).
    """
    p = np.asarray(probabilities, dtype=np.float64)
    if p.ndim != 2 or not len(p):
        return math.nan
    confidence = p.max(axis=1)
    index = _bin_of(confidence, n_bins)
    total = 0.0
    for b in range(n_bins):
        chances = confidence[index == b]
        if len(chances):
            law = _poisson_binomial(chances)
            gaps = np.abs(np.arange(len(chances) + 1) / len(chances) - chances.mean())
            total += len(chances) * float(law @ gaps)
    return total / len(p)


def auroc(scores: Scores, positive: Scores) -> float:
    """Area under the ROC curve of ``scores`` for telling ``positive`` (e.g. right answers) from the
    rest, with tied scores counted half. NaN when either class is empty: there is nothing to tell apart.
    """
    s = np.asarray(scores, dtype=np.float64)
    pos = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    # average ranks give every member of a tie the mean of the ranks it spans
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_scores = s[order]
    start = 0
    while start < len(s):
        end = start
        while end + 1 < len(s) and sorted_scores[end + 1] == sorted_scores[start]:
            end += 1
        ranks[order[start : end + 1]] = (start + end) / 2.0 + 1.0
        start = end + 1
    u = ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def summarise(
    probabilities: Rows,
    gold: Indices,
    candidate_mass: Scores | None = None,
) -> dict[str, float]:
    """Every metric of one set of answers, as the report prints them."""
    p, g = _arrays(probabilities, gold)
    pred = predictions(p)
    correct = pred == g
    report = {
        "n": float(len(g)),
        "accuracy": accuracy(pred, g),
        "macro_f1": macro_f1(pred, g, p.shape[1]),
        "nll": nll(p, g),
        "brier": brier(p, g),
        "ece": ece(p, g),
        "ece_if_calibrated": ece_if_calibrated(p),
        "auroc_probability": auroc(p.max(axis=1), correct),
    }
    if candidate_mass is not None:
        report["auroc_candidate_mass"] = auroc(candidate_mass, correct)
    return report
