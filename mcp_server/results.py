"""The typed results of the MCP tools: each becomes a tool's `outputSchema` and `structured_content`.

Every result carries `model` and `usage` (`pcd_core.request.questions.Usage`, rendered from the engine's one
cost record, `pcd_core.cost.Stats`), so that an agent can see what answered and what it cost. Behind a
cascade (`pcd-mcp --then ...`) every answer and decided field also names the engine that gave it and its
escalation record, and `cascade` gives each engine's cost; outside one they are left out. The `decide` answers are the System One answer models of
`pcd_core.request.questions` themselves, so they are the `POST /v1/systemone` wire format by construction;
`tests/test_mcp_server.py` checks the schemas and the numbers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, JsonValue

from pcd_core import Answer, Usage
from pcd_core.request.questions import (
    ABSTAINED,
    ANSWER_SET,
    CALIBRATED,
    DEBIASED,
    ENGINE,
    ESCALATION,
    METHOD,
    ORDER_SPREAD,
    ZERO_SHOT,
)

__all__ = [
    "NO_AT",
    "Trust",
    "YES_AT",
    "ChoiceResult",
    "DecideResult",
    "FieldDecision",
    "FieldGenerated",
    "FieldMemberships",
    "FillResult",
    "NoulResult",
    "ScoreResult",
    "Usage",
    "verdict_of",
]

#: `noul` at or above this is a "yes" verdict. The band is symmetric around 0.5 and wide enough that a
#: verdict is never a coin flip; a caller who needs another cut-off reads `noul` itself.
YES_AT = 0.65
#: `noul` at or below this is a "no" verdict; between NO_AT and YES_AT the verdict is "uncertain".
NO_AT = 0.35


#: in a cascade, what each engine spent on the request (``pcd_core.cascade_escalation.StageCost``); absent outside one
STAGES = "In a cascade: per engine, the fields or questions it was asked and its passes, tokens and time."


def _absent(value: Any) -> bool:
    return value is None


def verdict_of(noul: float) -> Literal["yes", "no", "uncertain"]:
    """The verdict for P(yes) = `noul`, by the band above."""
    if noul >= YES_AT:
        return "yes"
    if noul <= NO_AT:
        return "no"
    return "uncertain"


class Trust(BaseModel):
    """Whether the probabilities were debiased and calibrated (``x_debiased`` / ``x_calibrated`` on
    the System One wire), so that an agent knows whether a 0.8 was measured to mean 80%; and, where
    the calibration fitted them, whether the engine abstained and which answers its set holds.
    """

    debiased: bool = Field(default=False, description=DEBIASED)
    calibrated: bool = Field(default=False, description=CALIBRATED)
    abstained: bool = Field(default=False, description=ABSTAINED)
    answer_set: list[JsonValue] | None = Field(default=None, description=ANSWER_SET)
    order_spread: float | None = Field(default=None, description=ORDER_SPREAD)
    method: str = Field(default="trie", description=METHOD)
    zero_shot: dict[str, float] | None = Field(default=None, description=ZERO_SHOT)
    engine: str | None = Field(default=None, description=ENGINE, exclude_if=_absent)
    escalation: dict[str, JsonValue] | None = Field(default=None, description=ESCALATION, exclude_if=_absent)


class NoulResult(Trust):
    """A yes/no judgement."""

    noul: float = Field(description="P(yes), renormalised over yes and no.")
    verdict: Literal["yes", "no", "uncertain"] = Field(
        description=f"'yes' when noul >= {YES_AT}, 'no' when noul <= {NO_AT}, otherwise 'uncertain'."
    )
    candidate_mass: float = Field(
        description="Probability the model put on yes or no at all, before renormalising; low means the "
        "question did not fit the state well."
    )
    model: str
    usage: Usage


class ChoiceResult(Trust):
    """One option picked from a closed set."""

    choice: str = Field(description="The most probable option, exactly as it was given.")
    confidence: float = Field(description="The normalised peak (n*max p - 1)/(n - 1), in [0, 1].")
    probabilities: dict[str, float] = Field(description="Every option's probability; they sum to 1.")
    runner_up: str = Field(description="The second most probable option.")
    candidate_mass: float = Field(description="Probability on any option before renormalising.")
    model: str
    usage: Usage


class ScoreResult(Trust):
    """A position on an ordered scale."""

    score: float = Field(description="Expected level index, sum of i * p_i, from 0 to len(levels) - 1.")
    nearest_level: JsonValue = Field(description="The level whose index is closest to score, as it was given.")
    confidence: float = Field(description="The normalised peak of the level probabilities, in [0, 1].")
    probabilities: dict[str, float] = Field(description="Level index ('0', '1', ...) to probability.")
    legend: dict[str, JsonValue] = Field(description="Level index ('0', '1', ...) to the level as given.")
    candidate_mass: float = Field(description="Probability on any level before renormalising.")
    model: str
    usage: Usage


class DecideResult(BaseModel):
    """Many answers about one state, exactly as `POST /v1/systemone` returns them."""

    model: str
    answers: dict[str, Answer] = Field(description="Question id to answer, in the System One format.")
    usage: Usage
    cascade: list[dict[str, JsonValue]] | None = Field(default=None, description=STAGES, exclude_if=_absent)


class FieldDecision(Trust):
    """How one closed field of a filled object was decided."""

    kind: Literal["decided"] = "decided"
    value: Any = Field(description="The chosen value.")
    probability: float = Field(description="Probability of the chosen value among the allowed ones.")
    candidate_mass: float = Field(description="Probability on any allowed value before renormalising.")
    confidence: float


class FieldMemberships(BaseModel):
    """How a multi-label list (an array of enum values) was decided: each label on its own, yes or no."""

    kind: Literal["multi-label"] = "multi-label"
    value: list[JsonValue] = Field(description="The labels whose membership probability is at least 0.5.")
    memberships: dict[str, float] = Field(description="Each label's probability of being in the list.")
    candidate_mass: float = Field(description="The lowest candidate mass of the per-label decisions.")


class FieldGenerated(BaseModel):
    """How an open field (a string, a number, a nested object, a free list) was written: generated
    greedily under its JSON Schema, so it is valid, but it has no probabilities over alternatives.
    """

    kind: Literal["generated"] = "generated"
    value: JsonValue = Field(description="The generated value.")
    text: str = Field(description="The value as the model wrote it, in JSON.")
    n_tokens: int = Field(description="Tokens written, those the grammar forced included.")
    mean_probability: float = Field(description="Mean probability of the tokens the model chose.")


FilledField = Annotated[FieldDecision | FieldMemberships | FieldGenerated, Field(discriminator="kind")]


class FillResult(BaseModel):
    """A JSON object filled against a schema: closed fields decided, open ones generated."""

    value: dict[str, Any] = Field(description="The filled object; it validates against the schema.")
    fields: dict[str, FilledField] = Field(description="Per field, how it was decided or generated (its kind).")
    warnings: list[str] = Field(description="Soft problems, such as a field with low candidate mass.")
    model: str
    usage: Usage
    cascade: list[dict[str, JsonValue]] | None = Field(default=None, description=STAGES, exclude_if=_absent)
