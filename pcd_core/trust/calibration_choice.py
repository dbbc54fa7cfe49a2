"""The default calibration fit: which of a few candidate fits to use, chosen per field by
cross-validation on the train split itself, so that it holds on a user's first 50-200 examples.

No one fit is best everywhere. On a binary set a small model may lean so hard to one label that its
raw answers are right less often than the majority class (SmolLM2-135M on polarity: accuracy 0.50 raw,
0.69 debiased, docs/eval/smollm2-135m.polarity.json), and then only debiasing or a per-label bias
repairs the confidence; on twenty topics a per-label bias fitted on a hundred examples mostly fits
noise. So each candidate (``CANDIDATES``: raw or debiased, temperature alone or with per-label biases,
or no fit at all) is scored by its mean held-out negative log-likelihood over ``FOLDS`` folds of the
train split, and the simplest one whose score is within one standard error of the best one's (the
paired per-example difference) is kept: with few examples that is the reading closest to the raw one.
The fits themselves shrink toward the raw reading too: ``1/T`` under a ``N(1, TEMPERATURE_SD**2)``
prior and the biases under ``N(0, BIAS_SD**2)`` (pcd_core/trust/calibration_fitting.py), priors that weigh less as
the train split grows.

``tests/test_calibration_choice.py`` checks that a leaning model gets a debiased or biased fit and an
already calibrated one keeps its raw reading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pcd_core.trust.calibration import LOG_FLOOR
from pcd_core.trust.calibration_fitting import BIAS_SD, fit

#: the prior standard deviation of 1/T: at 100 examples it weighs like one example at T = 2
TEMPERATURE_SD = 1.0

FOLDS = 5


@dataclass(frozen=True)
class Candidate:
    name: str
    debias: bool
    temperature: bool  # fit 1/T (else T = 1)
    bias: bool  # fit a bias per label


#: simplest first: the one-standard-error rule keeps the first within reach of the best
CANDIDATES = (
    Candidate("raw", False, False, False),
    Candidate("debiased", True, False, False),
    Candidate("temperature", False, True, False),
    Candidate("debiased temperature", True, True, False),
    Candidate("temperature + bias", False, True, True),
    Candidate("debiased temperature + bias", True, True, True),
)


@dataclass(frozen=True)
class Choice:
    candidate: Candidate
    temperature: float
    bias: tuple[float, ...]
    cv_nll: dict[str, float]  # each candidate's mean held-out NLL over the folds, in nats


def _fitted(candidate: Candidate, logp: np.ndarray, gold: np.ndarray) -> tuple[float, tuple[float, ...]]:
    if not candidate.temperature:
        return 1.0, tuple(0.0 for _ in range(logp.shape[1]))
    return fit(logp, gold, bias=candidate.bias, bias_sd=BIAS_SD, temperature_sd=TEMPERATURE_SD)


def _example_nll(logp: np.ndarray, gold: np.ndarray, temperature: float, bias: tuple[float, ...]) -> np.ndarray:
    z = np.maximum(logp, LOG_FLOOR) / temperature + np.asarray(bias)
    z = z - z.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(z).sum(axis=1))
    return log_norm - z[np.arange(len(gold)), gold]


def choose_fit(raw_logp: np.ndarray, debiased_logp: np.ndarray, gold: np.ndarray, seed: int = 0) -> Choice:
    """The candidate fit the module docstring describes, refitted on every example given."""
    n = len(gold)
    folds = min(FOLDS, n)
    order = np.random.default_rng(seed).permutation(n)
    losses = {c.name: np.zeros(n) for c in CANDIDATES}
    if folds >= 2:
        for part in np.array_split(order, folds):
            rest = np.setdiff1d(order, part)
            for candidate in CANDIDATES:
                logp = debiased_logp if candidate.debias else raw_logp
                temperature, bias = _fitted(candidate, logp[rest], gold[rest])
                losses[candidate.name][part] = _example_nll(logp[part], gold[part], temperature, bias)
    best = min(CANDIDATES, key=lambda c: float(losses[c.name].mean()))
    chosen = best
    for candidate in CANDIDATES:  # simplest first
        difference = losses[candidate.name] - losses[best.name]
        standard_error = float(difference.std(ddof=1)) / math.sqrt(n) if n > 1 else 0.0
        if float(difference.mean()) <= standard_error:
            chosen = candidate
            break
    temperature, bias = _fitted(chosen, debiased_logp if chosen.debias else raw_logp, gold)
    return Choice(chosen, temperature, bias, {name: float(loss.mean()) for name, loss in losses.items()})
