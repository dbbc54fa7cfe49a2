"""Contextual calibration (Zhao et al. 2021, "Calibrate before use"): a label prior read without labels.

A small model leans to some labels whatever the input says (SmolLM2-135M picks the first listed value
on most ticket fields). The lean is measured by reading the same prompt with a few content-free inputs
(``CONTENT_FREE``) in place of the text: their mean label distribution is the prior ``p_cf``, and a
debiased answer is ``p / p_cf``, renormalised over the allowed labels. Candidate mass is left raw: it
measures whether the model wanted to write an allowed value at all, which the prior does not change.

Pure functions on ``Readout``s; the engine measures the prior once per compiled schema and caches it
beside the head. ``tests/test_debias.py`` shows that an oracle model's known bias is removed exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from pcd_core.reading.readout import Readout, renormalise

#: neutral stand-ins for the input, read through the same prompt (Zhao et al. use "N/A", "[MASK]", "")
CONTENT_FREE = ("N/A", "[MASK]", "none")

#: a prior probability below this is floored, so that dividing by it cannot make a label certain
PRIOR_FLOOR = 1e-6


def content_free_prior(distributions: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """The mean of one field's renormalised distributions over the content-free inputs, floored."""
    if not distributions:
        raise ValueError("a prior needs at least one content-free reading")
    n = len(distributions[0])
    mean = [sum(d[i] for d in distributions) / len(distributions) for i in range(n)]
    return tuple(max(p, PRIOR_FLOOR) for p in mean)


def content_free_priors(read: Callable[[str], dict[str, list[float]]]) -> dict[str, tuple[float, ...]]:
    """Per field (or question) that ``read`` returns a distribution for, its prior over the
    ``CONTENT_FREE`` inputs; ``read`` reads one input raw (no debiasing, no calibration).
    """
    readings = [read(text) for text in CONTENT_FREE]
    return {name: content_free_prior([r[name] for r in readings]) for name in readings[0]}


def with_probabilities(readout: Readout, log_scores: Sequence[float]) -> Readout:
    """``readout`` with its probabilities (and so its best label) recomputed from ``log_scores``; the
    measured log masses and the candidate mass are kept as read.
    """
    probabilities = renormalise(list(log_scores))
    best = max(range(len(probabilities)), key=lambda i: (probabilities[i], -i))
    return replace(readout, probabilities=probabilities, best=best)


def log_probabilities(readout: Readout) -> list[float]:
    return [math.log(p) if p > 0 else -math.inf for p in readout.probabilities]


def debiased(readout: Readout, prior: Sequence[float]) -> Readout:
    """``p / prior``, renormalised; a label the model gave no mass keeps none."""
    if len(prior) != len(readout.probabilities):
        raise ValueError(f"the prior has {len(prior)} labels, the readout {len(readout.probabilities)}")
    return with_probabilities(readout, [lp - math.log(q) for lp, q in zip(log_probabilities(readout), prior)])
