"""A cascade's accuracy against its cost, from two engines' answers on the same labelled examples.

For a field the first engine answers with probability rows and the next engine answers alone, a
threshold ``t`` escalates every example whose first top probability is below ``t``: the cascade's
answer is then the next engine's there and the first's elsewhere. ``cascade_curve`` gives, per
threshold, the share escalated, the accuracy, and the time per example (the first engine on every
example, the next one on the escalated ones), beside each engine alone. ``escalation_threshold``
picks the threshold for a target (an accuracy to reach, or a share of examples to escalate at most)
on one split, to be checked on another. For a one-field schema (polarity, 20ng-5) the next engine
asked alone is what a cascade asks it; with more fields, a smaller schema is another prompt
(docs/cascades.md). ``fit_escalation`` fits one threshold per field for such a target on the train
split (``pcd calibrate --cascade``), at every distinct top probability rather than on the grid, and
saves it in the calibration (``Escalation``), whose probabilities it was fitted on.
``tests/test_cascade_curve.py`` checks them on synthetic answers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pcd_core.trust.calibration import Escalation

#: the thresholds the curve is read at: 0 (never escalate) to just above 1 (always)
GRID = tuple(round(0.05 * i, 2) for i in range(21)) + (1.01,)


@dataclass(frozen=True)
class CascadePoint:
    threshold: float  # escalate where the first engine's top probability is below this
    escalated: float  # share of examples escalated
    accuracy: float
    seconds_per_example: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cascade_curve(
    first: np.ndarray,
    second: np.ndarray,
    gold: np.ndarray,
    first_seconds: float,
    second_seconds: float,
    thresholds: tuple[float, ...] = GRID,
) -> list[CascadePoint]:
    """Per threshold, the cascade on these examples; ``*_seconds`` are each engine's time per example."""
    top = first.max(axis=1)
    first_right = first.argmax(axis=1) == gold
    second_right = second.argmax(axis=1) == gold
    points = []
    for t in thresholds:
        up = top < t
        right = np.where(up, second_right, first_right)
        points.append(
            CascadePoint(
                float(t), float(up.mean()), float(right.mean()), first_seconds + second_seconds * float(up.mean())
            )
        )
    return points


def escalation_threshold(
    points: list[CascadePoint], *, accuracy: float | None = None, max_escalated: float | None = None
) -> CascadePoint | None:
    """The cheapest point that reaches ``accuracy`` (escalating least), or, with ``max_escalated``, the
    most accurate point that escalates at most that share; None when no point qualifies.
    """
    if (accuracy is None) == (max_escalated is None):
        raise ValueError("give a target accuracy or a most escalated share, one of the two")
    if accuracy is not None:
        reaching = [p for p in points if p.accuracy >= accuracy]
        return min(reaching, key=lambda p: (p.escalated, -p.accuracy)) if reaching else None
    assert max_escalated is not None
    within = [p for p in points if p.escalated <= max_escalated]
    return max(within, key=lambda p: (p.accuracy, -p.escalated)) if within else None


def fit_escalation(
    first: dict[str, np.ndarray],
    second: dict[str, np.ndarray],
    gold: dict[str, np.ndarray],
    next_model: str,
    *,
    accuracy: float | None = None,
    max_escalated: float | None = None,
) -> tuple[Escalation, list[str]]:
    """Per field, the threshold that meets the target on these answers (rows of the first engine as its
    calibration gives them, the next engine's rows, gold indices, all on the same examples), and a line
    for each field whose target is out of reach: that field keeps the most accurate point there is.
    """
    below, on_train, short = {}, {}, []
    for name, rows in first.items():
        top = rows.max(axis=1)
        # escalating below each distinct top probability, and below 1.01 (every example), are all the choices
        thresholds = (0.0, *sorted(set(top.tolist()) - {0.0}), 1.01)
        points = cascade_curve(rows, second[name], gold[name], 0.0, 0.0, thresholds)
        chosen = escalation_threshold(points, accuracy=accuracy, max_escalated=max_escalated)
        if chosen is None:  # only an accuracy can be out of reach: every share has the point 0
            chosen = max(points, key=lambda p: (p.accuracy, -p.escalated))
            short.append(
                f"{name}: accuracy {accuracy} is out of reach on the train split (the cascade reaches "
                f"{chosen.accuracy:.3f}, escalating {chosen.escalated:.3f}); keeping that point"
            )
        below[name] = chosen.threshold
        on_train[name] = {"escalated": chosen.escalated, "accuracy": chosen.accuracy, "n": float(len(top))}
    return Escalation(next_model, below, accuracy, max_escalated, on_train), short
