"""The OpenAI Decisions API (``POST /v1/decisions``) as pydantic models over the System One questions.

The shapes are those of the ``openai`` package's ``client.decisions.create`` (``openai/types/
decision_create_params.py`` and ``decision.py``, version 3.57): ``input`` is a string or a list of
items: user, system and developer messages (a string or ``input_text`` / ``input_json`` parts),
assistant messages (``output_text`` and ``refusal`` parts), ``function_call`` and
``custom_tool_call`` items and their outputs, each output after the call with its ``call_id``;
``questions`` is a list of 1 to 400 ``predicate``, ``choice`` (2 to 255 distinct
``{value, description}``, a value a string or a boolean) and ``score`` (2 to 10 ``{label,
description}`` levels), each with an optional ``name``; ``prompt_cache_key`` asks the engine to keep
the earlier turns in its head cache. Images are refused with a message that says so: the engine reads
text only.

The input becomes what ``Engine.decide`` reads (``DecisionRequest.state_and_context``): system and
developer messages are the caller's instructions, the user messages that end the input are the
state, and every other item is an earlier turn rendered through the model's chat template with its
own role (a function call and its output are tool turns; ``pcd_core/conversation.py``).

Each question becomes a `pcd_core.questions` model when it is validated, so the System One rules and
messages apply here unchanged, and both routes make the same ``engine.decide`` call. Answers come back
in question order with their names; a choice's values keep their JSON type (``true`` stays a boolean).
Each answer says, as on ``/v1/systemone``, whether it was debiased and calibrated (``x_debiased``,
``x_calibrated``); a calibration covers a question by its id here, ``questions[i]``.
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
    Discriminator,
    Field,
    PrivateAttr,
    StrictBool,
    StrictStr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from .. import questions as systemone
from ..conversation import Conversation, Role, Turn
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
MAX_QUESTIONS = 400
ChoiceValue = StrictStr | StrictBool


class _Model(BaseModel):
    # Fields this server does not use (prompt_cache_options, safety_identifier, an assistant message's
    # phase, an input_text's prompt_cache_breakpoint, ...) are accepted and ignored.
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


class _Message(_Model):
    """A message whose content is a string or input parts (text, JSON; images are refused)."""

    type: Literal["message"] = "message"
    content: list[Part] = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _content_parts(cls, value: Any) -> Any:
        return _as_parts(value)


class InputMessage(_Message):
    """A user message: the state when it ends the input, an earlier user turn otherwise."""

    role: Literal["user"]

    def text(self) -> Text:
        return _as_text(self.content)


class InstructionMessage(_Message):
    """A system or developer message: the caller's instructions for every question."""

    role: Literal["system", "developer"]

    def text(self) -> str:
        value = _as_text(self.content)
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class OutputText(_Model):
    type: Literal["output_text"]
    text: StrictStr


class Refusal(_Model):
    type: Literal["refusal"]
    refusal: StrictStr


class AssistantMessage(_Model):
    """An assistant turn: output text and refusals, in order (a refusal is shown as what it said)."""

    type: Literal["message"] = "message"
    role: Literal["assistant"]
    content: list[Annotated[OutputText | Refusal, Field(discriminator="type")]] = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _content_parts(cls, value: Any) -> Any:
        return [{"type": "output_text", "text": value}] if isinstance(value, str) else value

    def text(self) -> Text:
        return "\n\n".join(p.text if isinstance(p, OutputText) else f"(refused) {p.refusal}" for p in self.content)


class FunctionCall(_Model):
    """A call the assistant made; shown to the model as a tool turn ``{"call": name, "arguments": ...}``."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr

    def text(self) -> Text:
        try:  # arguments are a JSON string: shown as the JSON they hold, or as written when they are not JSON
            arguments: Any = json.loads(self.arguments)
        except ValueError:
            arguments = self.arguments
        return {"call": self.name, "arguments": arguments}


class CustomToolCall(_Model):
    type: Literal["custom_tool_call"]
    call_id: StrictStr
    name: StrictStr
    input: StrictStr

    def text(self) -> Text:
        return {"call": self.name, "input": self.input}


class _CallOutput(_Model):
    """A tool's output, for the call with the same ``call_id`` earlier in the input."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: StrictStr
    output: list[Annotated[InputText | InputImage, Field(discriminator="type")]] = Field(min_length=1)

    @field_validator("output", mode="before")
    @classmethod
    def _output_parts(cls, value: Any) -> Any:
        return _as_parts(value)

    def text(self) -> Text:
        return _as_text(list(self.output))


class FunctionCallOutput(_CallOutput):
    type: Literal["function_call_output"]


class CustomToolCallOutput(_CallOutput):
    type: Literal["custom_tool_call_output"]


_ITEM_TAGS = {
    "user": "user_message",
    "system": "instruction_message",
    "developer": "instruction_message",
    "assistant": "assistant_message",
}


def _item_tag(value: Any) -> str | None:
    """Which item model reads ``value``: messages by their role, the rest by their type."""
    if isinstance(value, BaseModel):
        value = {"role": getattr(value, "role", None), "type": getattr(value, "type", None)}
    if not isinstance(value, dict):
        return None
    if "role" in value or value.get("type") in (None, "message"):
        return _ITEM_TAGS.get(value.get("role", "user"))
    kind = value.get("type")
    return f"{kind}_item" if kind in _CALL_TYPES else None


_CALL_TYPES = {"function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output"}
InputItem = Annotated[
    Annotated[InputMessage, Tag("user_message")]
    | Annotated[InstructionMessage, Tag("instruction_message")]
    | Annotated[AssistantMessage, Tag("assistant_message")]
    | Annotated[FunctionCall, Tag("function_call_item")]
    | Annotated[FunctionCallOutput, Tag("function_call_output_item")]
    | Annotated[CustomToolCall, Tag("custom_tool_call_item")]
    | Annotated[CustomToolCallOutput, Tag("custom_tool_call_output_item")],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_item",
        custom_error_message="an input item is a user, system, developer or assistant message, a "
        "function_call, a function_call_output, a custom_tool_call or a custom_tool_call_output",
    ),
]
_ROLE_OF: dict[type[Any], Role] = {
    InputMessage: "user",
    AssistantMessage: "assistant",
    FunctionCall: "tool",
    FunctionCallOutput: "tool",
    CustomToolCall: "tool",
    CustomToolCallOutput: "tool",
}


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
        called: set[str] = set()
        for item in items:
            if isinstance(item, FunctionCall | CustomToolCall):
                called.add(item.call_id)
            elif isinstance(item, _CallOutput) and item.call_id not in called:
                raise ValueError(f"the {item.type} with call_id {item.call_id!r} has no earlier call with that id")
        if all(isinstance(item, InstructionMessage) for item in items):
            raise ValueError("the input has only instructions: add the user message or tool output to decide about")
        return items

    def state_and_context(self) -> tuple[Text, Conversation]:
        """The state, and the conversation before it (``pcd_core/conversation.py``)."""
        items = [item for item in self.input if not isinstance(item, InstructionMessage)]
        instructions = tuple(item.text() for item in self.input if isinstance(item, InstructionMessage))
        trailing_users = next(
            (i for i, item in enumerate(reversed(items)) if not isinstance(item, InputMessage)), len(items)
        )
        split = len(items) - max(trailing_users, 1)  # no user message at the end: the last item is the state
        earlier, last = items[:split], items[split:]
        parts = [part for message in last if isinstance(message, InputMessage) for part in message.content]
        state = _as_text(parts) if parts else last[0].text()
        turns = tuple(Turn(_ROLE_OF[type(item)], item.text()) for item in earlier)
        return state, Conversation(turns=turns, instructions=instructions)

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
        InstructionMessage,
        AssistantMessage,
        OutputText,
        Refusal,
        FunctionCall,
        FunctionCallOutput,
        CustomToolCall,
        CustomToolCallOutput,
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


DecisionAnswer = Annotated[PredicateAnswer | DecisionChoiceAnswer | DecisionScoreAnswer, Field(discriminator="type")]


class InputTokensDetails(_Model):
    cached_tokens: int = Field(description="Head tokens served from the engine's prefix cache.")
    cache_write_tokens: int = Field(0, description="Head tokens prefilled by this request and kept in the cache.")


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


def decision_response(request: DecisionRequest, response: DecideResponse) -> DecisionResponse:
    """The OpenAI answer to ``request`` from the engine's System One ``response``."""
    answers = [_answer(q, response.answers[question_id(i)]) for i, q in enumerate(request.questions)]
    usage = response.usage
    return DecisionResponse(
        model=response.model,
        answers=answers,
        usage=DecisionUsage(
            input_tokens=usage.input_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=usage.cached_tokens,
                cache_write_tokens=response.stats.cache_write_tokens if response.stats is not None else 0,
            ),
            total_tokens=usage.input_tokens + usage.output_tokens,
        ),
        x_forward_passes=usage.forward_passes,
        x_queue_ms=response.stats.queue_ms if response.stats is not None else 0.0,
    )
