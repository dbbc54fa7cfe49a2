"""What a fill returns: the value, one decision per field, the cost, and warnings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .readout import Readout
from .schema import Field, JsonValue

#: below this candidate mass a field carries a warning: the model wanted to write something else
LOW_MASS = 0.5


@dataclass
class Stats:
    forward_passes: int = 0
    input_tokens: int = 0  # every token read: the head (cached or not), the request and every row
    prompt_tokens: int = 0  # tokens prefilled for this request outside the cached head
    cached_tokens: int = 0  # head tokens served from the cache (0 on a miss)
    row_tokens: int = 0
    n_rows: int = 0
    rounds: int = 0
    compile_ms: float = 0.0
    head_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    total_ms: float = 0.0
    row_layout: str = "packed"
    head_cache: str = "hit"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FieldResult:
    name: str
    value: JsonValue
    probability: float
    probabilities: dict[str, float]
    candidate_mass: float
    confidence: float
    top: list[tuple[JsonValue, float]]
    method: str
    wave: int
    debiased: bool = False  # the content-free prior was divided out (pcd_core/debias.py)
    calibrated: bool = False  # a fitted calibration was applied (pcd_core/calibration.py)

    @classmethod
    def from_readout(
        cls, spec: Field, readout: Readout, method: str, wave: int, debiased: bool = False, calibrated: bool = False
    ) -> FieldResult:
        ranked = readout.ranked()
        return cls(
            name=spec.name,
            value=spec.labels[readout.best].value,
            probability=readout.probabilities[readout.best],
            probabilities={label.text: p for label, p in zip(spec.labels, readout.probabilities)},
            candidate_mass=readout.candidate_mass,
            confidence=readout.confidence,
            top=[(spec.labels[i].value, readout.probabilities[i]) for i in ranked[:5]],
            method=method,
            wave=wave,
            debiased=debiased,
            calibrated=calibrated,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["top"] = [list(pair) for pair in self.top]
        return data


@dataclass
class Extraction:
    value: Any
    fields: dict[str, FieldResult]
    stats: Stats
    warnings: list[str] = field(default_factory=list)

    @property
    def values(self) -> dict[str, JsonValue]:
        return {name: result.value for name, result in self.fields.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": self.values,
            "fields": {name: result.to_dict() for name, result in self.fields.items()},
            "stats": self.stats.to_dict(),
            "warnings": list(self.warnings),
        }


def mass_warnings(results: dict[str, FieldResult], threshold: float = LOW_MASS) -> list[str]:
    return [
        f"field {r.name!r}: candidate mass {r.candidate_mass:.3f} is below {threshold}; the model "
        "wanted to write something that is not an allowed value"
        for r in results.values()
        if r.candidate_mass < threshold
    ]
