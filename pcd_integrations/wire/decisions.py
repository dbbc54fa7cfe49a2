"""The OpenAI Decisions API (``POST /v1/decisions``) as pydantic models over the System One questions.

The shapes are those of the ``openai`` package's ``client.decisions.create`` (``openai/types/
decision_create_params.py`` and ``decision.py``, version 3.57). ``input`` (a string, or messages, tool
calls and their outputs) is declared in ``decision_input.py``, which also splits it into the state,
the earlier turns and the caller's instructions that ``Engine.decide`` reads. ``questions`` is a list
of 1 to 400 ``predicate``, ``choice`` (2 to 255 distinct ``{value, description}``, a value a string or
a boolean) and ``score`` (2 to 10 ``{label, description}`` levels), each with an optional ``name``;
``prompt_cache_key`` asks the engine to keep the earlier turns in its head cache. Images, in the input
or in instructions, are refused with a message that says so: the engine reads text only.

Each question becomes a `pcd_core.request.questions` model when it is validated, so the System One rules and
messages apply here unchanged, and both routes make the same ``engine.decide`` call. Answers come back
in question order with their names; a choice's values keep their JSON type (``true`` stays a boolean).
Each answer says, as on ``/v1/systemone``, whether it was debiased and calibrated (``x_debiased``,
``x_calibrated``); a calibration covers a question by its id here, ``questions[i]``. An answer the
engine abstained from (a calibration fitted with ``--abstain-risk``) is OpenAI's ``refusal``, with the
reading it declined in ``x_answer``. A choice's or a score's answer read in several orders of its
options (``pcd serve --order-samples K``) carries ``x_order_spread``.
A predicate is a noul; a boolean choice value is shown to the model as ``true``/``false``, so ``true``
and ``"true"`` in one question are refused as equal options. ``tests/test_questions.py`` covers the
translation, ``tests/test_decisions_api.py`` the route with the real ``openai`` client.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    StrictBool,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from pcd_core import ChoiceQuestion, Conversation, DecideResponse, NoulQuestion, ScoreQuestion, Stats
from pcd_core.request import questions as systemone
from pcd_core.request.questions import CALIBRATED, DEBIASED, Text, check_options
from pcd_integrations.wire.decision_input import (
    INPUT_MODELS,
    InputItem,
    Part,
    WireModel,
    as_parts,
    as_text,
    check_items,
    split_input,
)

#: The most questions one request may ask, as the OpenAI API admits.
MAX_QUESTIONS = 400
ChoiceValue = StrictStr | StrictBool


class _Question(WireModel):
    instructions: list[Part] = Field(min_length=1)
    name: StrictStr | None = None
    _question: NoulQuestion | ChoiceQuestion | ScoreQuestion = PrivateAttr()

    @field_validator("instructions", mode="before")
    @classmethod
    def _instruction_parts(cls, value: Any) -> Any:
        return as_parts(value)

    def _build(self, kind: type[Any], **fields: Any) -> None:
        """The System One question, so that its rules (and messages) apply here too."""
        try:
            self._question = kind(instructions=as_text(self.instructions), **fields)
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


class ChoiceOption(WireModel):
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


class ScoreLevel(WireModel):
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


class DecisionRequest(WireModel):
    """The body of ``POST /v1/decisions``.

    The input is split into what the engine reads (``state_and_context``): system and developer
    messages are the caller's instructions; the user messages that end the input are the state (their
    parts joined, as one message's are); every item before them is an earlier turn. An input that
    ends with another item (a tool's output, an assistant's reply) has that item as its state.
    """

    model: StrictStr
    input: list[InputItem] = Field(min_length=1)
    questions: list[DecisionQuestion] = Field(min_length=1, max_length=MAX_QUESTIONS)
    prompt_cache_key: StrictStr | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _string_input(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    @field_validator("input")
    @classmethod
    def _calls_answered_in_order(cls, items: list[Any]) -> list[Any]:
        return check_items(items)

    def state_and_context(self) -> tuple[Text, Conversation]:
        """The state, and the conversation before it (``decision_input.split_input``)."""
        return split_input(self.input)

    def engine_questions(self) -> dict[str, NoulQuestion | ChoiceQuestion | ScoreQuestion]:
        """The System One questions, keyed by position (ids never reach the model)."""
        return {question_id(i): q.question for i, q in enumerate(self.questions)}


#: Every field name of the request models: the parts of a pydantic error location that are a path in
#: the body (the rest are union tags and member names such as ``choice`` or ``str``).
FIELD_NAMES = frozenset(
    name
    for model in (
        DecisionRequest,
        *INPUT_MODELS,
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


class _HowRead(WireModel):
    """How an answer was read (``x_method``: zero-shot ``trie`` or a trained ``head``) and, from a head,
    the zero-shot probabilities of the same pass (``x_zero_shot``, keyed by the answer names of
    ``/v1/systemone``), as there.
    """

    x_method: Literal["trie", "head"] = Field(default="trie", description=systemone.METHOD)
    x_zero_shot: dict[str, float] | None = Field(default=None, description=systemone.ZERO_SHOT)
    # in a cascade only (pcd_core/cascade.py), as on /v1/systemone; left off outside one
    x_engine: str | None = Field(default=None, description=systemone.ENGINE, exclude_if=lambda v: v is None)
    x_escalation: dict[str, Any] | None = Field(
        default=None, description=systemone.ESCALATION, exclude_if=lambda v: v is None
    )


class PredicateAnswer(_HowRead):
    type: Literal["predicate"] = "predicate"
    name: str | None
    probability: float
    x_debiased: bool = _flag(DEBIASED)
    x_calibrated: bool = _flag(CALIBRATED)


class ChoiceProbability(WireModel):
    value: ChoiceValue
    probability: float


class DecisionChoiceAnswer(_HowRead):
    type: Literal["choice"] = "choice"
    name: str | None
    choice: ChoiceValue
    probabilities: list[ChoiceProbability]
    confidence: float
    x_debiased: bool = _flag(DEBIASED)
    x_calibrated: bool = _flag(CALIBRATED)
    x_order_spread: float | None = Field(default=None, description=systemone.ORDER_SPREAD)


class ScoreProbability(WireModel):
    value: int = Field(description="The level's index, from 0.")
    label: str
    probability: float


class DecisionScoreAnswer(_HowRead):
    type: Literal["score"] = "score"
    name: str | None
    score: float = Field(description="Expected level index, sum of i * p_i.")
    probabilities: list[ScoreProbability]
    confidence: float
    x_debiased: bool = _flag(DEBIASED)
    x_calibrated: bool = _flag(CALIBRATED)
    x_order_spread: float | None = Field(default=None, description=systemone.ORDER_SPREAD)


class RefusalAnswer(WireModel):
    """OpenAI's refusal (openai >= 3.57): the engine abstained, its probability being below the threshold a
    calibration fitted for a target risk (pcd_core/trust/selective.py); the reading it declined is ``x_answer``.
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


class InputTokensDetails(WireModel):
    cached_tokens: int = Field(description="Head tokens served from the engine's prefix cache.")
    cache_write_tokens: int = Field(0, description="Head tokens prefilled by this request and kept in the cache.")


class OutputTokensDetails(WireModel):
    reasoning_tokens: int = 0


class DecisionUsage(WireModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int

    @classmethod
    def of(cls, stats: Stats) -> DecisionUsage:
        """A decision's usage from its cost record (``pcd_core/cost.py``): no token is generated."""
        return cls(
            input_tokens=stats.input_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=stats.cached_tokens, cache_write_tokens=stats.cache_write_tokens
            ),
            output_tokens=stats.output_tokens,
            total_tokens=stats.input_tokens + stats.output_tokens,
        )


class DecisionResponse(WireModel):
    """The answer of ``POST /v1/decisions``; the ``x_`` fields here and on the answers are this engine's
    extensions.
    """

    model: str
    answers: list[DecisionAnswer]
    usage: DecisionUsage
    x_forward_passes: int
    x_queue_ms: float = Field(0.0, description="Milliseconds the request waited for the model.")


def _answer(question: PredicateQuestion | DecisionChoiceQuestion | DecisionScoreQuestion, answer: Any) -> Any:
    flags = {
        "x_debiased": answer.debiased,
        "x_calibrated": answer.calibrated,
        "x_method": answer.method,
        "x_zero_shot": answer.zero_shot,
        "x_engine": answer.engine,
        "x_escalation": answer.escalation,
    }
    if isinstance(question, PredicateQuestion) and isinstance(answer, systemone.NoulAnswer):
        return PredicateAnswer(name=question.name, probability=answer.noul, **flags)
    if isinstance(question, DecisionChoiceQuestion) and isinstance(answer, systemone.ChoiceAnswer):
        values = {option_name(option.value): option.value for option in question.choices}
        return DecisionChoiceAnswer(
            name=question.name,
            choice=values[answer.choice],
            probabilities=[ChoiceProbability(value=values[n], probability=p) for n, p in answer.probabilities.items()],
            confidence=answer.confidence,
            x_order_spread=answer.order_spread,
            **flags,
        )
    if isinstance(question, DecisionScoreQuestion) and isinstance(answer, systemone.ScoreAnswer):
        levels = [
            ScoreProbability(value=i, label=level.label, probability=answer.probabilities[str(i)])
            for i, level in enumerate(question.levels)
        ]
        return DecisionScoreAnswer(
            name=question.name,
            score=answer.score,
            probabilities=levels,
            confidence=answer.confidence,
            x_order_spread=answer.order_spread,
            **flags,
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
    return DecisionResponse(
        model=response.model,
        answers=answers,
        usage=DecisionUsage.of(response.stats),
        x_forward_passes=response.stats.forward_passes,
        x_queue_ms=response.stats.queue_ms,
    )
