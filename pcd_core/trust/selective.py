"""Acting on a probability: abstain below a threshold fitted to a target risk, or answer with a set of
labels fitted to a target coverage. Pure functions on arrays and probability lists.

- **Abstention** (selective classification). An answer is given when its top probability is at least
  the field's ``abstain_below``, and abstained from otherwise. Answering the ``k`` most confident train
  examples has an error rate; its one-sided Clopper-Pearson upper bound, at a confidence ``level``, must
  be at or below the target risk, and the threshold is the lowest top probability that passes. The
  level says what the target means:

  - above 0.5 (``DEFAULT_CONFIDENCE``, 0.9, by default) the bound is a promise: the risk is at most
    the target in that share of draws of the labels it is fitted on (0.9: 9 in 10), at the cost of
    coverage. The scan goes from the most confident down and stops at the first ``k`` that fails
    (fixed-sequence testing, as in Angelopoulos et al. 2021, "Learn then Test"), so the one chosen
    holds the bound without a correction for the number tried;
  - at ``CONFIDENCE`` (0.5, which must be asked for) the bound is the error rate's median estimate, so
    nothing is promised. The scan reads the whole curve and keeps the largest ``k`` that passes, and
    that choice of the best of many looks is itself optimistic: on 50 labelled e-mails it answered 30
    held-out ones at an error of 0.23 against 0.10 asked for. It was the default, and no longer is.

  Either scan starts at ``first_tested(risk, level)`` answered examples, fixed before any label is
  seen: a test at the very top, on a handful of answers, says nothing. A target no threshold meets (too
  few examples, or too many confident errors) gives ``NEVER``: the field always abstains, and
  ``supported_risk`` says the lowest target those labels would have met.
- **Both need probabilities the fit never saw.** A threshold fitted on answers whose calibration was
  fitted on the same examples is fitted on probabilities more confident in the gold label than any
  new example's: on 100 labelled e-mails the sets then held the right label 0.76 of the time held out,
  against 0.90 asked for. ``pcd calibrate`` therefore fits the calibration and the thresholds on two
  disjoint parts of the train split (pcd_core/evaluation/decisions.py, ``threshold_split``).
- **Answer sets** (split conformal prediction, the "LAC" score ``1 - p(gold)``, Sadinle et al. 2019).
  The set holds every label whose probability is at least ``set_threshold``; the threshold is one
  minus the ``ceil((n + 1) * coverage)``-th smallest score of the train split, which makes the gold
  label's chance of being in the set at least ``coverage`` on exchangeable data. The top label is
  always in the set, so a set is never empty (that only adds coverage).

``tests/test_selective.py`` checks the bound against scipy-free brute force, and both rules on
synthetic answers whose right rate is known.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: the lowest confidence level of the abstention bound: an estimate that aims at the target, not a
#: promise (the module docstring says why)
CONFIDENCE = 0.5

#: the default confidence level: the risk is at most the target in 9 of 10 draws of the labels
DEFAULT_CONFIDENCE = 0.9

#: the targets ``supported_risk`` tries, lowest first: a hundredth apart
RISK_GRID = tuple(round(0.01 * i, 2) for i in range(1, 100))

#: the threshold of a field that must always abstain: above every probability, and finite in JSON
NEVER = math.nextafter(1.0, 2.0)


def _log_binomial_cdf(errors: int, n: int, rate: float) -> float:
    """The log of P(X <= errors) for X ~ Binomial(n, rate), summed in log space."""
    if rate <= 0.0:
        return 0.0
    if rate >= 1.0:
        return 0.0 if errors >= n else -math.inf
    terms = [
        math.lgamma(n + 1)
        - math.lgamma(i + 1)
        - math.lgamma(n - i + 1)
        + i * math.log(rate)
        + (n - i) * math.log1p(-rate)
        for i in range(errors + 1)
    ]
    top = max(terms)
    return top + math.log(sum(math.exp(t - top) for t in terms))


def risk_upper_bound(errors: int, n: int, delta: float) -> float:
    """The one-sided Clopper-Pearson upper bound on an error rate seen as ``errors`` of ``n``: the rate
    at which ``errors`` or fewer would happen with probability ``delta``; 1 when ``n`` is 0.
    """
    if n == 0 or errors >= n:
        return 1.0
    low, high, log_delta = errors / n, 1.0, math.log(delta)
    for _ in range(60):  # bisection: the CDF falls as the rate rises
        middle = (low + high) / 2
        if _log_binomial_cdf(errors, n, middle) > log_delta:
            low = middle
        else:
            high = middle
    return high


def fewest_to_promise(risk: float, delta: float) -> int:
    """How many answered examples, none wrong, it takes before the bound (at level ``1 - delta``) reaches ``risk``."""
    return math.ceil(math.log(delta) / math.log1p(-risk))


def first_tested(risk: float, level: float = DEFAULT_CONFIDENCE) -> int:
    """The fewest answered examples the scan tests: where an error rate of half the target would pass."""
    delta = 1 - level
    k = fewest_to_promise(risk, delta)
    while risk_upper_bound(int(k * risk / 2), k, delta) > risk:
        k += max(1, k // 20)
    return k


def abstention_threshold(top: np.ndarray, correct: np.ndarray, risk: float, level: float = DEFAULT_CONFIDENCE) -> float:
    """The lowest top probability at which the train answers' error rate is bounded by ``risk`` at
    confidence ``level`` (the module docstring says how); ``NEVER`` when no threshold is.
    """
    if not 0 < risk < 1:
        raise ValueError(f"the target risk must lie in (0, 1), not {risk!r}")
    if not CONFIDENCE <= level < 1:
        raise ValueError(f"the confidence level must lie in [{CONFIDENCE}, 1), not {level!r}")
    promise = level > CONFIDENCE
    delta = 1 - level
    order = np.argsort(-top, kind="mergesort")
    ranked, wrong = top[order], np.cumsum(~correct[order].astype(bool))
    chosen, start = NEVER, first_tested(risk, level) - 1
    for k in range(start, len(ranked)):
        if k + 1 < len(ranked) and ranked[k + 1] == ranked[k]:
            continue  # a threshold answers every example tied at it
        if risk_upper_bound(int(wrong[k]), k + 1, delta) > risk:
            if promise:
                break
            continue
        chosen = float(ranked[k])
    return chosen


def supported_risk(top: np.ndarray, correct: np.ndarray, level: float = DEFAULT_CONFIDENCE) -> float | None:
    """The lowest target of ``RISK_GRID`` that these answers support at ``level`` (some threshold
    meets it); None when none does, not even 0.99.
    """
    for risk in RISK_GRID:
        if abstention_threshold(top, correct, risk, level) != NEVER:
            return risk
    return None


def conformal_threshold(gold_probability: np.ndarray, coverage: float) -> float:
    """The split-conformal probability floor for sets that hold the gold label at rate ``coverage``."""
    if not 0 < coverage < 1:
        raise ValueError(f"the target coverage must lie in (0, 1), not {coverage!r}")
    n = len(gold_probability)
    rank = math.ceil((n + 1) * coverage)
    if rank > n:
        return 0.0  # too few examples for this coverage: every label is in the set
    scores = np.sort(1.0 - np.asarray(gold_probability, dtype=np.float64))
    return float(1.0 - scores[rank - 1])


def answer_set(probabilities: Sequence[float], threshold: float) -> list[int]:
    """The indices of the set, most probable first: every label at ``threshold`` or above, and the top."""
    ranked = sorted(range(len(probabilities)), key=lambda i: (-probabilities[i], i))
    return [i for n, i in enumerate(ranked) if n == 0 or probabilities[i] >= threshold]


def risk_coverage(confidence: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coverage and risk when answering the ``k`` most confident examples, for ``k = 1 .. n``."""
    order = np.argsort(-confidence, kind="mergesort")
    answered = np.arange(1, len(order) + 1)
    wrong = np.cumsum(~correct[order].astype(bool))
    return answered / len(order), wrong / answered
