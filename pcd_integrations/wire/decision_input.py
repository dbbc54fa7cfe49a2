"""The ``input`` of OpenAI Decisions (openai 3.57, ``openai/types/decision_create_params.py``) as
pydantic models, and what the engine reads of it.

``input`` is a string or a list of items: user, system and developer messages (a string or
``input_text`` / ``input_json`` parts), assistant messages (``output_text`` and ``refusal`` parts),
``function_call`` and ``custom_tool_call`` items and their outputs, each output after the call with
its ``call_id`` (``check_items``). Images are refused with a message that says so: the engine reads
text only. ``split_input`` turns the items into what ``Engine.decide`` reads: system and developer
messages are the caller's instructions, the user messages that end the input are the state, and
every other item is an earlier turn, rendered through the model's chat template with its own role (a
function call and its output are tool turns; ``pcd_core/request/conversation.py``). ``tests/test_questions.py``
covers the split, ``tests/test_decisions_api.py`` the route with the real ``openai`` client.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictStr, Tag, field_validator, model_validator

from pcd_core import Conversation, Role, Turn
from pcd_core.request.questions import Text


class WireModel(BaseModel):
    # Fields this server does not use (prompt_cache_options, safety_identifier, an assistant message's
    # phase, an input_text's prompt_cache_breakpoint, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")


class InputText(WireModel):
    type: Literal["input_text"]
    text: StrictStr


class InputJson(WireModel):
    type: Literal["input_json"]
    data: dict[str, Any] | list[dict[str, Any]]


class InputImage(WireModel):
    type: Literal["input_image"]

    @model_validator(mode="after")
    def _refuse(self) -> InputImage:
        raise ValueError("images are not supported: pcd-engine reads text only; send input_text parts")


Part = Annotated[InputText | InputJson | InputImage, Field(discriminator="type")]


def as_parts(value: Any) -> Any:
    """A plain string is one text part; lists are checked part by part."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


def as_text(parts: list[InputText | InputJson | InputImage]) -> Text:
    """One part is its own text or JSON; several are joined when all are text, else kept as a JSON array."""
    values = [part.text if isinstance(part, InputText) else part.data for part in parts]  # type: ignore[union-attr]
    if len(values) == 1:
        return values[0]
    texts = [value for value in values if isinstance(value, str)]
    if len(texts) == len(values):
        return "\n\n".join(texts)
    return values


class _Message(WireModel):
    """A message whose content is a string or input parts (text, JSON; images are refused)."""

    type: Literal["message"] = "message"
    content: list[Part] = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _content_parts(cls, value: Any) -> Any:
        return as_parts(value)


class InputMessage(_Message):
    """A user message: the state when it ends the input, an earlier user turn otherwise."""

    role: Literal["user"]

    def text(self) -> Text:
        return as_text(self.content)


class InstructionMessage(_Message):
    """A system or developer message: the caller's instructions for every question."""

    role: Literal["system", "developer"]

    def text(self) -> str:
        value = as_text(self.content)
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class OutputText(WireModel):
    type: Literal["output_text"]
    text: StrictStr


class Refusal(WireModel):
    type: Literal["refusal"]
    refusal: StrictStr


class AssistantMessage(WireModel):
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


class FunctionCall(WireModel):
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


class CustomToolCall(WireModel):
    type: Literal["custom_tool_call"]
    call_id: StrictStr
    name: StrictStr
    input: StrictStr

    def text(self) -> Text:
        return {"call": self.name, "input": self.input}


class _CallOutput(WireModel):
    """A tool's output, for the call with the same ``call_id`` earlier in the input."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: StrictStr
    output: list[Annotated[InputText | InputImage, Field(discriminator="type")]] = Field(min_length=1)

    @field_validator("output", mode="before")
    @classmethod
    def _output_parts(cls, value: Any) -> Any:
        return as_parts(value)

    def text(self) -> Text:
        return as_text(list(self.output))


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


def check_items(items: list[Any]) -> list[Any]:
    """``items`` when each output follows its call and there is more than instructions to read."""
    called: set[str] = set()
    for item in items:
        if isinstance(item, FunctionCall | CustomToolCall):
            called.add(item.call_id)
        elif isinstance(item, _CallOutput) and item.call_id not in called:
            raise ValueError(f"the {item.type} with call_id {item.call_id!r} has no earlier call with that id")
    if all(isinstance(item, InstructionMessage) for item in items):
        raise ValueError("the input has only instructions: add the user message or tool output to decide about")
    return items


def split_input(items: list[Any]) -> tuple[Text, Conversation]:
    """The state, and the conversation before it: the user messages that end the input are the state
    (their parts joined, as one message's are); an input that ends with another item (a tool's
    output, an assistant's reply) has that item as its state.
    """
    said = [item for item in items if not isinstance(item, InstructionMessage)]
    instructions = tuple(item.text() for item in items if isinstance(item, InstructionMessage))
    trailing_users = next((i for i, item in enumerate(reversed(said)) if not isinstance(item, InputMessage)), len(said))
    split = len(said) - max(trailing_users, 1)  # no user message at the end: the last item is the state
    earlier, last = said[:split], said[split:]
    parts = [part for message in last if isinstance(message, InputMessage) for part in message.content]
    state = as_text(parts) if parts else last[0].text()
    turns = tuple(Turn(_ROLE_OF[type(item)], item.text()) for item in earlier)
    return state, Conversation(turns=turns, instructions=instructions)


#: the input's models, whose field names are paths in a request body
INPUT_MODELS = (
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
)
