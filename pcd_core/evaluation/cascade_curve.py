"""A cascade's accuracy against its cost, from two engines' answers on the same labelled examples.

For a field the first engine answers with probability rows and the next engine answers alone, a
threshold ``t`` escalates every example whose first top probability is below ``t``: the cascade's
answer is then the next engine's there and the first's elsewhere. ``cascade_curve`` gives, per
threshold, the share escalated, the accuracy, and the time per example (the first engine on every
example, the next one on the escalated ones), beside each engine alone. ``escalation_threshold``
picks the threshold for a target (an accuracy to reach, or a share of examples to escalate at most)
on one split, to be checked on another. For a one-field schema (polarity, 20ng-5) the next engine
asked alone is what a cascade asks it; with more fields, a smaller schema is another prompt
(docs/cascades.md). ``tests/test_cascade_curve.py`` checks both on synthetic answers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

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
