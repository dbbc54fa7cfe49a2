"""Jev-style questions and answers: the typed request and response of ``engine.decide``.

These pydantic models are the System One (Jev) wire contract of ``POST /v1/systemone``, declared
once: the answers serialise to the wire by their aliases (``x_candidate_mass``, ``x_logits``,
``x_debiased``, ``x_calibrated``), and the HTTP server, the MCP server and the OpenAI-shaped
``POST /v1/decisions`` (``pcd_integrations/wire/decisions.py``) all translate from these classes. Validation
lives here, so that every adapter rejects the same requests with the same messages:

- 2 to 255 choice options, none blank and no two equal after Unicode normalisation (NFKC, zero-width
  characters removed, whitespace collapsed: the model could not tell them apart);
- 2 to 10 score levels, none empty; noul criteria with only ``"true"``/``"false"`` keys;
- instructions, option descriptions, levels and noul criteria may be text or any JSON object or array
  (rendered as JSON into the question's row), but never empty; a noul may have criteria and no
  instructions; at least one question.

Unknown fields are ignored. ``tests/test_questions.py`` covers each rule without a model.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    computed_field,
    field_serializer,
    field_validator,
    model_validator,
)

from pcd_core.cost import Stats
from pcd_core.request.schema import check_distinct, normalise_option
from pcd_core.request.triggers import Fired

Text = str | dict[str, Any] | list[Any]


def is_blank(value: Any) -> bool:
    """Text with nothing to read: None, blank or invisible text, an empty object or array."""
    if value is None:
        return True
    if isinstance(value, str):
        return not normalise_option(value)
    return isinstance(value, dict | list) and not value


def check_options(names: list[str], shown: list[str] | None = None) -> None:
    """Raise ValueError when an option is blank or two are equal after `normalise_option` (the rule a
    schema's labels follow too: ``schema.check_distinct``).

    ``shown`` is how the message writes each option (default: its ``repr``).
    """
    shown = shown if shown is not None else [repr(name) for name in names]
    for index, name in enumerate(names):
        if not normalise_option(name):
            raise ValueError(f"option names must not be blank, got {shown[index]}")
    check_distinct(names, shown)


def _not_blank(value: Any, what: str) -> Any:
    if is_blank(value):
        raise ValueError(f"{what} must not be empty")
    return value


Instructions = Annotated[Text, AfterValidator(lambda value: _not_blank(value, "instructions"))]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class NoulQuestion(_Wire):
    """A yes/no question; the answer is P(yes). Criteria may describe either side, both or neither.

    Instructions may be left out when the criteria say what to judge.
    """

    type: Literal["noul"] = "noul"
    instructions: Instructions | None = None
    criteria: dict[Literal["true", "false"], JsonValue] | None = None

    @field_validator("criteria", mode="before")
    @classmethod
    def _only_true_false(cls, value: Any) -> Any:
        if isinstance(value, dict) and not set(value) <= {"true", "false"}:
            extra = sorted(set(value) - {"true", "false"}, key=str)
            raise ValueError(f"noul criteria take only the keys 'true' and 'false', not {extra}")
        return value

    @model_validator(mode="after")
    def _something_to_judge(self) -> NoulQuestion:
        if self.instructions is None and all(is_blank(side) for side in (self.criteria or {}).values()):
            raise ValueError("a noul needs instructions, or criteria that say what counts as true or false")
        return self


class ChoiceQuestion(_Wire):
    """One of 2 to 255 named options; a description may be text, JSON or null."""

    type: Literal["choice"] = "choice"
    instructions: Instructions
    criteria: dict[str, JsonValue] = Field(min_length=2, max_length=255)

    @field_validator("criteria")
    @classmethod
    def _distinct_names(cls, value: dict[str, JsonValue]) -> dict[str, JsonValue]:
        check_options(list(value))
        return value


class ScoreQuestion(_Wire):
    """2 to 10 ordered levels, low to high, each text or JSON; the score is the expected level index."""

    type: Literal["score"] = "score"
    instructions: Instructions
    criteria: list[JsonValue] = Field(min_length=2, max_length=10)

    @field_validator("criteria")
    @classmethod
    def _levels(cls, value: list[JsonValue]) -> list[JsonValue]:
        for index, level in enumerate(value):
            _not_blank(level, f"score level {index}")
        return value


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]


def answer_names(question: NoulQuestion | ChoiceQuestion | ScoreQuestion) -> tuple[str, ...]:
    """A question's answers in the order the engine reads them: ``true``, ``false`` for a noul, the
    options as given for a choice, the level indices ``"0"``, ``"1"``, ... for a score. A calibration
    (``pcd_core/trust/calibration.py``) names a question's labels so.
    """
    if isinstance(question, ChoiceQuestion):
        return tuple(question.criteria)
    if isinstance(question, ScoreQuestion):
        return tuple(str(i) for i in range(len(question.criteria)))
    return ("true", "false")


class DecideRequest(_Wire):
    state: Text
    model: str | None = None
    questions: dict[str, Question] = Field(min_length=1)


def _extension(name: str, description: str, **default: Any) -> Any:
    """A field that Python code reads as ``name`` and the wire carries as ``x_<name>``; ``default=``
    makes it optional.
    """
    wire = f"x_{name}"
    return Field(
        validation_alias=AliasChoices(wire, name), serialization_alias=wire, description=description, **default
    )


#: what the ``x_debiased`` / ``x_calibrated`` flags of every answer mean, on every wire
DEBIASED = "Whether the model's lean on content-free inputs was divided out of the probabilities."
CALIBRATED = (
    "Whether a calibration fitted on labelled data (pcd calibrate) was applied to the probabilities; "
    "without one they are the model's beliefs under this prompt, not measured frequencies."
)


ABSTAINED = (
    "Whether the answer's probability is below the threshold a calibration fitted for its target risk "
    "(pcd calibrate --abstain-risk); the answer and probabilities are still the model's reading."
)
ANSWER_SET = (
    "The answers whose probability reaches the threshold a calibration fitted for its target coverage "
    "(pcd calibrate --coverage), most probable first: for a noul true/false, for a score level indices."
)

METHOD = (
    "How the answer was read: 'trie', the model's next-token probabilities (zero-shot), or 'head', a "
    "head trained on labelled data (pcd calibrate --head probe) on the hidden state of the same pass."
)
ZERO_SHOT = "With method 'head': the zero-shot probabilities of the same pass, for comparison; else null."

ORDER_SPREAD = (
    "With order_samples > 1: how far the top answer's probability moved across the rotations of the "
    "option list that were averaged (max - min); null when the options were read in one order."
)


ENGINE = "In a cascade: the engine that gave this answer."
ESCALATION = (
    "In a cascade, where the answer went on to a later engine: why (reasons), to which (to), whether that "
    "engine's answer replaced the earlier one (escalated; error says why not) and both readings."
)


def _is_none(value: Any) -> bool:
    return value is None


class _Answer(BaseModel):
    """Answers are the System One wire: engine extras serialise as ``x_`` fields, every number a float."""

    model_config = ConfigDict(serialize_by_alias=True)

    candidate_mass: float = _extension(
        "candidate_mass",
        "Probability the model put on any allowed answer before renormalising; low means the "
        "question did not fit the state well.",
    )
    debiased: bool = _extension("debiased", DEBIASED, default=False)
    calibrated: bool = _extension("calibrated", CALIBRATED, default=False)
    abstained: bool = _extension("abstained", ABSTAINED, default=False)
    answer_set: list[str] | None = _extension("answer_set", ANSWER_SET, default=None)
    order_spread: float | None = _extension("order_spread", ORDER_SPREAD, default=None)
    method: Literal["trie", "head"] = _extension("method", METHOD, default="trie")
    zero_shot: dict[str, float] | None = _extension("zero_shot", ZERO_SHOT, default=None)
    # in a cascade only (pcd_core/cascade.py), and left off the wire outside one
    engine: str | None = _extension("engine", ENGINE, default=None, exclude_if=_is_none)
    escalation: dict[str, Any] | None = _extension("escalation", ESCALATION, default=None, exclude_if=_is_none)


class NoulAnswer(_Answer):
    type: Literal["noul"] = "noul"
    noul: float = Field(description="P(yes), renormalised over yes and no.")


class _DistributionAnswer(_Answer):
    """What choice and score answers share: the distribution, its peak, and the logits."""

    probabilities: dict[str, float]
    confidence: float = Field(description="The normalised peak (n*max p - 1)/(n - 1), in [0, 1].")
    logits: dict[str, float] = _extension("logits", "Each answer's log-probability before renormalising.")


class ChoiceAnswer(_DistributionAnswer):
    type: Literal["choice"] = "choice"
    choice: str = Field(description="The most probable option, exactly as it was given.")


class ScoreAnswer(_DistributionAnswer):
    type: Literal["score"] = "score"
    score: float = Field(description="Expected level index, sum of i * p_i.")
    legend: dict[str, JsonValue] = Field(description="Level index ('0', '1', ...) to the level as given.")


Answer = Annotated[NoulAnswer | ChoiceAnswer | ScoreAnswer, Field(discriminator="type")]


def distribution(answer: NoulAnswer | ChoiceAnswer | ScoreAnswer) -> list[float]:
    """An answer's probabilities in ``answer_names`` order; a noul's is ``(P(true), P(false))``."""
    if isinstance(answer, NoulAnswer):
        return [answer.noul, 1.0 - answer.noul]
    return list(answer.probabilities.values())


class Usage(BaseModel):
    """The System One and MCP rendering of a request's ``Stats`` (``pcd_core/cost.py``, the one cost
    record): every token read, none generated, the model's forward passes, and the milliseconds it
    waited for the model behind other requests (``pcd_core/concurrency/model_lock.py``).

    ``cached_tokens`` are the head tokens served from the cache. The System One wire carries only
    ``input_tokens`` and ``output_tokens`` here (passes and waiting go in ``x_forward_passes`` and
    ``x_queue_ms``); MCP results carry all of it.
    """

    input_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    forward_passes: int = 0
    queue_ms: float = 0.0

    @classmethod
    def of(cls, stats: Stats) -> Usage:
        """A request's usage as the engine measured it in its ``Stats``."""
        return cls(
            input_tokens=stats.input_tokens,
            output_tokens=stats.output_tokens,
            cached_tokens=stats.cached_tokens,
            forward_passes=stats.forward_passes,
            queue_ms=stats.queue_ms,
        )


class DecideResponse(BaseModel):
    model: str
    answers: dict[str, Answer]
    stats: Stats = Field(default_factory=Stats, exclude=True)  # what it cost; every wire renders its usage from it
    warnings: list[str] = Field(default_factory=list)  # a bypassed head cache, low candidate mass
    # a session's append (pcd_core/sessions/session.py): the triggers that fired; not part of the System One wire
    triggers: list[Fired] = Field(default_factory=list, exclude=True)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def usage(self) -> Usage:
        """The cost as the System One wire and MCP results carry it (``Usage.of(stats)``)."""
        return Usage.of(self.stats)

    @field_serializer("usage")
    def _system_one_usage(self, usage: Usage) -> dict[str, int]:
        return {"input_tokens": int(usage.input_tokens), "output_tokens": 0}

    def to_wire(self) -> dict[str, Any]:
        """The ``POST /v1/systemone`` body: floats everywhere, engine extras as ``x_`` fields."""
        wire = self.model_dump(mode="json")
        wire["x_warnings"] = wire.pop("warnings")  # an engine extra, like every field outside the contract
        wire["x_forward_passes"] = int(self.stats.forward_passes)
        wire["x_queue_ms"] = float(self.stats.queue_ms)  # waiting for the model (pcd_core/concurrency/model_lock.py)
        return wire
