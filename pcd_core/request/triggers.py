"""Triggers: what a session (``session.py``) watches for after each turn, and what fired.

A conversation monitor does not want the whole result after every turn; it wants to know when a
decision moved: the answer changed, a probability rose over a threshold or fell under one, a
calibrated answer started or stopped abstaining. ``Trigger`` says which, for one field or question;
``TriggerState`` keeps what it saw last, and ``TriggerState.step`` compares that with the new
``Observation`` and returns a ``Fired`` record (value and probability before and after) or None.

A threshold has a hysteresis band: ``above=0.7, hysteresis=0.05`` fires when the probability reaches
0.7, then stays quiet until it has fallen under 0.65 and may fire again, so a probability that
wobbles around the threshold fires once, not every turn. ``tests/test_triggers.py`` checks each
condition on scripted observations, and on a real session.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from pcd_core.errors import OptionError

JsonValue = Any
Condition = Literal["changed", "above", "below", "abstained"]
DEFAULT_HYSTERESIS = 0.05


@dataclass(frozen=True)
class Observation:
    """One field's or question's reading after one turn: its value, the probability a threshold
    compares (``Trigger.label``'s, else P(true) of a boolean or a noul, else the top answer's), and
    whether a calibration abstained. An open field has a value and no probability.
    """

    value: JsonValue
    probability: float | None
    abstained: bool = False


@dataclass(frozen=True)
class Fired:
    """A trigger that fired on one append: which, on what turn, and the reading before and after
    (``before_*`` are None on a session's first turn).
    """

    trigger: str
    field: str
    condition: str  # "changed", "above 0.7", "below 0.3", "abstained", "answered"
    turn: int  # 1 for the session's first append
    before_value: JsonValue
    after_value: JsonValue
    before_probability: float | None
    after_probability: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "trigger": self.trigger,
            "field": self.field,
            "condition": self.condition,
            "turn": self.turn,
            "before": {"value": self.before_value, "probability": self.before_probability},
            "after": {"value": self.after_value, "probability": self.after_probability},
        }


@dataclass(frozen=True)
class Trigger:
    """One condition on one field (a fill's key) or question (a decide's id).

    Exactly one of ``changed``, ``above``, ``below`` and ``abstained`` is set. ``label`` names the
    answer whose probability ``above``/``below`` compare (a choice's option, an enum's value); without
    it a boolean or a noul compares P(true) and anything else its top answer's probability.
    ``abstained=True`` fires when the answer starts abstaining, ``False`` when it stops.
    """

    field: str
    changed: bool = False
    above: float | None = None
    below: float | None = None
    abstained: bool | None = None
    label: str | None = None
    hysteresis: float = DEFAULT_HYSTERESIS
    name: str = ""

    def __post_init__(self) -> None:
        chosen = [self.changed, self.above is not None, self.below is not None, self.abstained is not None]
        if sum(chosen) != 1:
            raise OptionError(
                f"a trigger on {self.field!r} takes exactly one of changed=True, above=p, below=p or "
                f"abstained=True/False; got {sum(chosen)}"
            )
        for key in ("above", "below"):
            p = getattr(self, key)
            if p is not None and not (isinstance(p, int | float) and 0.0 < p < 1.0):
                raise OptionError(f"{key} is a probability strictly between 0 and 1, got {p!r}")
        if not (isinstance(self.hysteresis, int | float) and 0.0 <= self.hysteresis < 0.5):
            raise OptionError(f"hysteresis is a probability band from 0 to 0.5, got {self.hysteresis!r}")
        if not self.name:
            object.__setattr__(self, "name", f"{self.field} {self.condition}")

    @property
    def condition(self) -> str:
        if self.changed:
            return "changed"
        if self.above is not None:
            return f"above {self.above:g}"
        if self.below is not None:
            return f"below {self.below:g}"
        return "abstained" if self.abstained else "answered"


@dataclass(frozen=True)
class TriggerState:
    """A trigger and what it last saw: the last observation, and whether a threshold may fire again
    (``armed``: it has been back outside its band since it last fired).
    """

    trigger: Trigger
    last: Observation | None = None
    armed: bool = True

    def step(self, now: Observation, turn: int) -> tuple[TriggerState, Fired | None]:
        """The state after ``now``, and what fired (None: nothing)."""
        t, before = self.trigger, self.last
        fires, armed = False, self.armed
        if t.changed:
            fires = before is not None and before.value != now.value
        elif t.abstained is not None:
            fires = now.abstained == t.abstained and (before.abstained != t.abstained if before else t.abstained)
        elif now.probability is not None:
            p = now.probability
            if t.above is not None:
                fires = armed and p >= t.above
                armed = (not fires) and (armed or p < t.above - t.hysteresis)
            elif t.below is not None:
                fires = armed and p <= t.below
                armed = (not fires) and (armed or p > t.below + t.hysteresis)
        state = replace(self, last=now, armed=armed)
        if not fires:
            return state, None
        return state, Fired(
            t.name,
            t.field,
            t.condition,
            turn,
            before.value if before else None,
            now.value,
            before.probability if before else None,
            now.probability,
        )


def observe(
    value: JsonValue, probabilities: dict[str, float] | None, label: str | None, abstained: bool = False
) -> Observation:
    """An ``Observation`` from a reading: ``probabilities`` keyed by answer names (None for an open
    field); a boolean's or a noul's are keyed ``"true"`` / ``"false"``.
    """
    if probabilities is None:
        return Observation(value, None, abstained)
    if label is not None:
        if label not in probabilities:
            raise OptionError(f"no answer {label!r} to watch; the answers are {', '.join(probabilities)}")
        return Observation(value, probabilities[label], abstained)
    if "true" in probabilities and set(probabilities) <= {"true", "false"}:
        return Observation(value, probabilities["true"], abstained)
    return Observation(value, max(probabilities.values()), abstained)
