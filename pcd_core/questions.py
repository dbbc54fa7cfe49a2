"""Jev-style questions and answers: the typed request and response of ``engine.decide``.

These pydantic models are the wire contract of ``POST /v1/systemone`` (REFERENCE.md section 3) and are
reused as they are by the HTTP server, the MCP server and the framework adapters. Validation lives
here, so every adapter rejects the same requests with the same messages: 2 to 255 choice options,
2 to 10 score levels, noul criteria with only ``"true"``/``"false"`` keys, at least one question.
Unknown fields are ignored. ``tests/test_questions.py`` covers each rule.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Text = str | dict[str, Any] | list[Any]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class NoulQuestion(_Wire):
    """A yes/no question; the answer is P(yes). Criteria may describe either side, both or neither."""

    type: Literal["noul"] = "noul"
    instructions: Text
    criteria: dict[Literal["true", "false"], str | None] | None = None

    @field_validator("criteria", mode="before")
    @classmethod
    def _only_true_false(cls, value: Any) -> Any:
        if isinstance(value, dict) and not set(value) <= {"true", "false"}:
            extra = sorted(set(value) - {"true", "false"})
            raise ValueError(f"noul criteria take only the keys 'true' and 'false', not {extra}")
        return value


class ChoiceQuestion(_Wire):
    """One of 2 to 255 named options; descriptions may be null."""

    type: Literal["choice"] = "choice"
    instructions: Text
    criteria: dict[str, str | None] = Field(min_length=2, max_length=255)

    @field_validator("criteria")
    @classmethod
    def _names_not_blank(cls, value: dict[str, str | None]) -> dict[str, str | None]:
        if any(not name.strip() for name in value):
            raise ValueError("option names must not be blank")
        return value


class ScoreQuestion(_Wire):
    """2 to 10 ordered levels, low to high; the score is the expected level index."""

    type: Literal["score"] = "score"
    instructions: Text
    criteria: list[str] = Field(min_length=2, max_length=10)


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


class DecideRequest(_Wire):
    state: Text
    model: str | None = None
    questions: dict[str, Question] = Field(min_length=1)


class NoulAnswer(BaseModel):
    type: Literal["noul"] = "noul"
    noul: float
    candidate_mass: float

    def to_wire(self) -> dict[str, Any]:
        return {"type": "noul", "noul": float(self.noul), "x_candidate_mass": float(self.candidate_mass)}


class _DistributionAnswer(BaseModel):
    """What choice and score answers share: the distribution, its peak, and the x_ extensions."""

    probabilities: dict[str, float]
    confidence: float
    candidate_mass: float
    logits: dict[str, float]

    def _distribution_wire(self) -> dict[str, Any]:
        return {
            "probabilities": {k: float(v) for k, v in self.probabilities.items()},
            "confidence": float(self.confidence),
            "x_candidate_mass": float(self.candidate_mass),
            "x_logits": {k: float(v) for k, v in self.logits.items()},
        }


class ChoiceAnswer(_DistributionAnswer):
    type: Literal["choice"] = "choice"
    choice: str

    def to_wire(self) -> dict[str, Any]:
        return {"type": "choice", "choice": self.choice, **self._distribution_wire()}


class ScoreAnswer(_DistributionAnswer):
    type: Literal["score"] = "score"
    score: float
    legend: dict[str, str]

    def to_wire(self) -> dict[str, Any]:
        return {"type": "score", "score": float(self.score), "legend": dict(self.legend), **self._distribution_wire()}


Answer = NoulAnswer | ChoiceAnswer | ScoreAnswer


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int = 0


class DecideResponse(BaseModel):
    model: str
    answers: dict[str, Answer]
    usage: Usage
    stats: Any = Field(default=None, exclude=True)
    warnings: list[str] = Field(default_factory=list)  # a bypassed head cache, low candidate mass

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "model": self.model,
            "answers": {qid: answer.to_wire() for qid, answer in self.answers.items()},
            "usage": {"input_tokens": int(self.usage.input_tokens), "output_tokens": 0},
        }
        if self.stats is not None:
            wire["x_forward_passes"] = int(self.stats.forward_passes)
        return wire
