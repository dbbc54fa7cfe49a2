"""The OpenAI Decisions API (``POST /v1/decisions``) as pydantic models over the System One questions.

The shapes are those of the ``openai`` package's ``client.decisions.create`` (``openai/types/
decision_create_params.py`` and ``decision.py``, version 3.51): ``input`` is a string or a list of user
messages whose content is a string or ``input_text`` / ``input_json`` parts; ``questions`` is a list of
1 to 200 ``predicate``, ``choice`` (2 to 255 distinct ``{value, description}``, a value a string or a
boolean) and ``score`` (2 to 10 ``{label, description}`` levels), each with an optional ``name``. Images
are refused with a message that says so: the engine reads text only.

Each question becomes a `pcd_core.questions` model when it is validated, so the System One rules and
messages apply here unchanged, and both routes make the same ``engine.decide`` call. Answers come back
in question order with their names; a choice's values keep their JSON type (``true`` stays a boolean).
Each answer says, as on ``/v1/systemone``, whether it was debiased and calibrated (``x_debiased``,
``x_calibrated``); a calibration covers a question by its id here, ``questions[i]``. An answer the
engine abstained from (a calibration fitted with ``--abstain-risk``) is OpenAI's ``refusal``, with the
reading it declined in ``x_answer``.
A predicate is a noul; a boolean choice value is shown to the model as ``true``/``false``, so ``true``
and ``"true"`` in one question are refused as equal options. ``tests/test_questions.py`` covers the
translation, ``tests/test_decisions_api.py`` the route with the real ``openai`` client.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from .. import questions as systemone
from ..questions import (
    CALIBRATED,
    DEBIASED,
    ChoiceQuestion,
    DecideResponse,
    NoulQuestion,
    ScoreQuestion,
    Text,
    check_options,
)

#: The most questions one request may ask, as the OpenAI API admits.
MAX_QUESTIONS = 200
ChoiceValue = StrictStr | StrictBool


class _Model(BaseModel):
    # Fields this server does not use (prompt_cache_key, safety_identifier, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")


class InputText(_Model):
    type: Literal["input_text"]
    text: StrictStr


class InputJson(_Model):
    type: Literal["input_json"]
    data: dict[str, Any] | list[dict[str, Any]]


class InputImage(_Model):
    type: Literal["input_image"]

    @model_validator(mode="after")
    def _refuse(self) -> InputImage:
        raise ValueError("images are not supported: pcd-engine reads text only; send input_text parts")


Part = Annotated[InputText | InputJson | InputImage, Field(discriminator="type")]


def _as_parts(value: Any) -> Any:
    """A plain string is one text part; lists are checked part by part."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


def _as_text(parts: list[InputText | InputJson | InputImage]) -> Text:
    """One part is its own text or JSON; several are joined when all are text, else kept as a JSON array."""
    values = [part.text if isinstance(part, InputText) else part.data for part in parts]  # type: ignore[union-attr]
    if len(values) == 1:
        return values[0]
    texts = [value for value in values if isinstance(value, str)]
    if len(texts) == len(values):
        return "\n\n".join(texts)
    return values


class InputMessage(_Model):
    role: Literal["user"]
    content: list[Part] = Field(min_length=1)
    type: Literal["message"] = "message"

    @model_validator(mode="before")
    @classmethod
    def _only_user(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("role", "user") != "user":
            raise ValueError(f"only user messages are supported, not role {value.get('role')!r}")
        if isinstance(value, dict) and "role" not in value and value.get("type") not in (None, "message"):
            raise ValueError(f"only user messages are supported, not {value.get('type')!r} items")
        return value

    @field_validator("content", mode="before")
    @classmethod
    def _content_parts(cls, value: Any) -> Any:
        return _as_parts(value)


class _Question(_Model):
    instructions: list[Part] = Field(min_length=1)
    name: StrictStr | None = None
    _question: NoulQuestion | ChoiceQuestion | ScoreQuestion = PrivateAttr()

    @field_validator("instructions", mode="before")
    @classmethod
    def _instruction_parts(cls, value: Any) -> Any:
        return _as_parts(value)

    def _build(self, kind: type[Any], **fields: Any) -> None:
        """The System One question, so that its rules (and messages) apply here too."""
        try:
            self._question = kind(instructions=_as_text(self.instructions), **fields)
        except ValidationError as error:
            raise ValueError(error.errors()[0]["msg"].removeprefix("Value error, ")) from None

    @property
    def question(self) -> NoulQuestion | ChoiceQuestion | ScoreQuestion:
        return self._question


class PredicateQuestion(_Question):
    """A statement about the input; the answer is the probability that it is true (a System One noul)."""

    type: Literal["predicate"]

    @model_validator(mode="after")
    def _to_noul(self) -> PredicateQuestion:
        self._build(NoulQuestion)
        return self


class ChoiceOption(_Model):
    value: ChoiceValue
    description: StrictStr = ""


def option_name(value: str | bool) -> str:
    """How a choice value is shown to the model: a boolean as JSON (``true``), a string as it is."""
    return ("true" if value else "false") if isinstance(value, bool) else value


class DecisionChoiceQuestion(_Question):
    type: Literal["choice"]
    choices: list[ChoiceOption] = Field(min_length=2, max_length=255)

    @model_validator(mode="after")
    def _to_choice(self) -> DecisionChoiceQuestion:
        names = [option_name(option.value) for option in self.choices]
        try:
            check_options(names, [json.dumps(option.value, ensure_ascii=False) for option in self.choices])
        except ValueError as error:
            raise ValueError(f"choices must be distinct as the model reads them: {error}") from None
        criteria = {name: option.description or None for name, option in zip(names, self.choices)}
        self._build(ChoiceQuestion, criteria=criteria)
        return self


class ScoreLevel(_Model):
    label: StrictStr
    description: StrictStr = ""

    def as_level(self) -> str:
        return f"{self.label}: {self.description}" if self.description.strip() else self.label


class DecisionScoreQuestion(_Question):
    type: Literal["score"]
    levels: list[ScoreLevel] = Field(min_length=2, max_length=10)

    @model_validator(mode="after")
    def _to_score(self) -> DecisionScoreQuestion:
        blank = [i for i, level in enumerate(self.levels) if not level.label.strip()]
        if blank:
            raise ValueError(f"score level {blank[0]} must have a label")
        self._build(ScoreQuestion, criteria=[level.as_level() for level in self.levels])
        return self


DecisionQuestion = Annotated[
    PredicateQuestion | DecisionChoiceQuestion | DecisionScoreQuestion, Field(discriminator="type")
]


class DecisionRequest(_Model):
    """The body of ``POST /v1/decisions``."""

    model: StrictStr
    input: list[InputMessage] = Field(min_length=1)
    questions: list[DecisionQuestion] = Field(min_length=1, max_length=MAX_QUESTIONS)

    @field_validator("input", mode="before")
    @classmethod
    def _string_input(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    def state(self) -> Text:
        """The state the engine reads: the messages' parts, in order, as `_as_text` joins them."""
        return _as_text([part for message in self.input for part in message.content])

    def engine_questions(self) -> dict[str, NoulQuestion | ChoiceQuestion | ScoreQuestion]:
        """The System One questions, keyed by position (ids never reach the model)."""
        return {question_id(i): q.question for i, q in enumerate(self.questions)}


#: Every field name of the request models: the parts of a pydantic error location that are a path in
#: the body (the rest are union tags and member names such as ``choice`` or ``str``).
FIELD_NAMES = frozenset(
    name
    for model in (
        DecisionRequest,
        InputMessage,
        InputText,
        InputJson,
        PredicateQuestion,
        DecisionChoiceQuestion,
        ChoiceOption,
        DecisionScoreQuestion,
        ScoreLevel,
    )
    for name in model.model_fields
)


def question_id(index: int) -> str:
    return f"questions[{index}]"


def _flag(description: str) -> Any:
    """An answer's ``x_debiased`` / ``x_calibrated`` extension, as on ``/v1/systemone``."""
    return Field(default=False, description=description)


class PredicateAnswer(_Model):
    type: Literal["predicate"] = "predicate"
    name: str | None
    probability: float
    x_debiased: bool = _flag(DEBIASED)
    x_calibrated: bool = _flag(CALIBRATED)


class ChoiceProbability(_Model):
    value: ChoiceValue
    probability: float


class DecisionChoiceAnswer(_Model):
    type: Literal["choice"] = "choice"
    name: str | None
    choice: ChoiceValue
    probabilities: list[ChoiceProbability]
    confidence: float
    x_debiased: bool = _flag(DEBIASED)
    x_calibrated: bool = _flag(CALIBRATED)


class ScoreProbability(_Model):
    value: int = Field(description="The level's index, from 0.")
    label: str
    probability: float


class DecisionScoreAnswer(_Model):
    type: Literal["score"] = "score"
    name: str | None
    score: float = Field(description="Expected level index, sum of i * p_i.")
    probabilities: list[ScoreProbability]
    confidence: float
    x_debiased: bool = _flag(DEBIASED)
    x_calibrated: bool = _flag(CALIBRATED)


class RefusalAnswer(_Model):
    """OpenAI's refusal (openai >= 3.57): the engine abstained, its probability being below the threshold a
    calibration fitted for a target risk (pcd_core/selective.py); the reading it declined is ``x_answer``.
    """

    type: Literal["refusal"] = "refusal"
    name: str | None
    x_abstained: bool = Field(default=True, description=systemone.ABSTAINED)
    x_answer: PredicateAnswer | DecisionChoiceAnswer | DecisionScoreAnswer = Field(
        description="The answer the engine read and declined to give, with its probabilities."
    )


DecisionAnswer = Annotated[
    PredicateAnswer | DecisionChoiceAnswer | DecisionScoreAnswer | RefusalAnswer, Field(discriminator="type")
]


class InputTokensDetails(_Model):
    cached_tokens: int = Field(description="Head tokens served from the engine's prefix cache.")
    # The engine has no explicit cache breakpoints, so nothing is written to a cache on request.
    cache_write_tokens: int = 0


class OutputTokensDetails(_Model):
    reasoning_tokens: int = 0


class DecisionUsage(_Model):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class DecisionResponse(_Model):
    """The answer of ``POST /v1/decisions``; the ``x_`` fields here and on the answers are this engine's
    extensions.
    """

    model: str
    answers: list[DecisionAnswer]
    usage: DecisionUsage
    x_forward_passes: int
    x_queue_ms: float = Field(0.0, description="Milliseconds the request waited for the model.")


def _answer(question: PredicateQuestion | DecisionChoiceQuestion | DecisionScoreQuestion, answer: Any) -> Any:
    flags = {"x_debiased": answer.debiased, "x_calibrated": answer.calibrated}
    if isinstance(question, PredicateQuestion) and isinstance(answer, systemone.NoulAnswer):
        return PredicateAnswer(name=question.name, probability=answer.noul, **flags)
    if isinstance(question, DecisionChoiceQuestion) and isinstance(answer, systemone.ChoiceAnswer):
        values = {option_name(option.value): option.value for option in question.choices}
        return DecisionChoiceAnswer(
            name=question.name,
            choice=values[answer.choice],
            probabilities=[ChoiceProbability(value=values[n], probability=p) for n, p in answer.probabilities.items()],
            confidence=answer.confidence,
            **flags,
        )
    if isinstance(question, DecisionScoreQuestion) and isinstance(answer, systemone.ScoreAnswer):
        levels = [
            ScoreProbability(value=i, label=level.label, probability=answer.probabilities[str(i)])
            for i, level in enumerate(question.levels)
        ]
        return DecisionScoreAnswer(
            name=question.name, score=answer.score, probabilities=levels, confidence=answer.confidence, **flags
        )
    raise TypeError(f"a {type(answer).__name__} does not answer a {question.type} question")


def _answer_or_refusal(question: Any, answer: Any) -> Any:
    read = _answer(question, answer)
    return RefusalAnswer(name=question.name, x_answer=read) if answer.abstained else read


def decision_response(request: DecisionRequest, response: DecideResponse) -> DecisionResponse:
    """The OpenAI answer to ``request`` from the engine's System One ``response``; an abstained answer
    becomes a refusal.
    """
    answers = [_answer_or_refusal(q, response.answers[question_id(i)]) for i, q in enumerate(request.questions)]
    usage = response.usage
    return DecisionResponse(
        model=response.model,
        answers=answers,
        usage=DecisionUsage(
            input_tokens=usage.input_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
            total_tokens=usage.input_tokens + usage.output_tokens,
        ),
        x_forward_passes=usage.forward_passes,
        x_queue_ms=response.stats.queue_ms if response.stats is not None else 0.0,
    )
