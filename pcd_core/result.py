"""What the engine returns: a fill's value, one decision per field, the cost, and warnings; a
generated reply (``Generation``) and its cost. The cost is ``Stats`` (``cost.py``) for both.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np

from pcd_core.cost import Stats
from pcd_core.prompting.trie import Strategy
from pcd_core.request.schema import Field, JsonValue, Schema
from pcd_core.request.triggers import Fired

#: how a decision was answered: a decode strategy's zero-shot reading, or a trained head (pcd_core/trust/heads.py)
Method = Literal[Strategy, "head"]

#: below this candidate mass a field carries a warning: the model wanted to write something else
LOW_MASS = 0.5


@dataclass
class FieldResult:
    name: str
    value: JsonValue
    probability: float
    probabilities: dict[str, float]
    candidate_mass: float
    confidence: float
    top: list[tuple[JsonValue, float]]
    method: Method  # the decode strategy that read it (pcd_core/reading/rounds.py), or "head"
    wave: int
    debiased: bool = False  # the content-free prior was divided out (pcd_core/trust/debias.py)
    calibrated: bool = False  # a fitted calibration was applied (pcd_core/trust/calibration_applying.py)
    # the probability is below the calibration's threshold for its target risk (pcd_core/trust/selective.py);
    # the value and probabilities are still the model's reading
    abstained: bool = False
    answer_set: list[JsonValue] | None = None  # the conformal set's values, most probable first; None: not fitted
    # with method "head": the zero-shot probabilities read in the same pass, for comparison
    zero_shot: dict[str, float] | None = None
    # with Engine.fill(..., hidden=True): the final hidden state at the field's first decision point,
    # what pcd calibrate --head probe fits a head on; never serialised
    hidden: np.ndarray | None = field(default=None, repr=False, compare=False)
    # in a cascade (pcd_core/cascade.py): the engine that answered, and, where the field went on to a
    # later engine, why, whether that answer replaced this one, and both readings; None outside one
    engine: str | None = None
    escalation: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = asdict(replace(self, hidden=None))
        del data["hidden"]
        for extra in ("engine", "escalation"):  # only in a cascade: other results keep their shape
            if data[extra] is None:
                del data[extra]
        data["top"] = [list(pair) for pair in self.top]
        return data


@dataclass
class Extraction:
    value: Any
    fields: dict[str, Any]  # FieldResult for decided fields, GeneratedField for generated ones
    stats: Stats
    warnings: list[str] = field(default_factory=list)
    triggers: list[Fired] = field(default_factory=list)  # a session's append: the triggers that fired

    @property
    def values(self) -> dict[str, JsonValue]:
        return {name: result.value for name, result in self.fields.items()}

    def to_dict(self) -> dict[str, Any]:
        shown: dict[str, Any] = {
            "value": self.values,
            "fields": {name: result.to_dict() for name, result in self.fields.items()},
            "stats": self.stats.to_dict(),
            "warnings": list(self.warnings),
        }
        if self.triggers:
            shown["triggers"] = [fired.to_dict() for fired in self.triggers]
        return shown


def low_mass_warnings(masses: dict[str, float], kind: str, threshold: float = LOW_MASS) -> list[str]:
    """One warning per decision (``kind`` is "field" or "question") whose candidate mass is low."""
    return [
        f"{kind} {name!r}: candidate mass {mass:.3f} is below {threshold}; the model wanted to write "
        "something that is not an allowed value"
        for name, mass in masses.items()
        if mass < threshold
    ]


def mass_warnings(results: dict[str, FieldResult], threshold: float = LOW_MASS) -> list[str]:
    return low_mass_warnings({name: r.candidate_mass for name, r in results.items()}, "field", threshold)


@dataclass
class MembershipResult:
    """A multi-label list, decided: each label's probability of belonging, and the labels at >= 0.5."""

    name: str
    value: list[JsonValue]
    memberships: dict[str, float]
    candidate_mass: float  # the lowest of the per-label decisions
    wave: int
    members: dict[str, FieldResult]
    method: Literal["multi-label"] = "multi-label"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": list(self.value),
            "memberships": dict(self.memberships),
            "candidate_mass": self.candidate_mass,
            "wave": self.wave,
            "method": self.method,
        }


def gather_memberships(schema: Schema, decided: dict[str, FieldResult]) -> dict[str, MembershipResult]:
    """One list per multi-label key, from its per-label boolean decisions, labels in schema order."""
    grouped: dict[str, list[tuple[Field, FieldResult]]] = {}
    for spec in schema.fields:
        if spec.member_of is not None:
            grouped.setdefault(spec.member_of[0], []).append((spec, decided[spec.name]))
    gathered = {}
    for name, members in grouped.items():
        inside = {_label_text(spec): result.probabilities["true"] for spec, result in members}
        gathered[name] = MembershipResult(
            name=name,
            value=[
                spec.member_of[1] for spec, result in members if spec.member_of and result.probabilities["true"] >= 0.5
            ],
            memberships=inside,
            candidate_mass=min(result.candidate_mass for _, result in members),
            wave=max(result.wave for _, result in members),
            members={spec.name: result for spec, result in members},
        )
    return gathered


def _label_text(spec: Field) -> str:
    assert spec.member_of is not None
    label = spec.member_of[1]
    return label if isinstance(label, str) else json.dumps(label)


@dataclass
class Generation:
    """A generated reply and what it cost. ``Generation()`` is the empty record that
    ``Engine.stream(..., result=...)`` fills as the reply is generated: ``stats`` is replaced by an
    updated frozen record after each step, so it holds what the reply cost so far.
    """

    text: str = ""
    finish_reason: Literal["stop", "length"] = "length"
    logp_sum: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)

    # the names a reply's cost had before ``stats`` held it, kept for callers that read them
    @property
    def input_tokens(self) -> int:
        return self.stats.input_tokens

    @property
    def output_tokens(self) -> int:
        return self.stats.output_tokens

    @property
    def cached_tokens(self) -> int:
        return self.stats.cached_tokens

    @property
    def forward_passes(self) -> int:
        return self.stats.forward_passes

    @property
    def queue_ms(self) -> float:
        """Waiting for the model behind other requests, summed over the steps."""
        return self.stats.queue_ms
