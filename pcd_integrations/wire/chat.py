"""The OpenAI Chat Completions API (``POST /v1/chat/completions``) as pydantic models, one per protocol object.

The shapes are those the ``openai`` package (3.51) sends and reads: ``openai/types/chat/
completion_create_params.py`` for the request, ``chat_completion.py`` and ``chat_completion_chunk.py``
for the answers. Everything a client may send is read strictly; what the engine cannot do honestly is
refused with a message that says why, before any model work:

- content is a string or a list of ``text`` parts; image, audio and file parts are refused, naming the
  part (the engine reads text only);
- ``n`` above 1 is refused (decoding is greedy, so every choice would be the same reply); so is
  ``logprobs`` (no token log-probs are returned) and ``response_format: {"type": "json_object"}``,
  which names no schema for the engine to fill: send ``json_schema``;
- ``temperature`` and ``top_p`` are accepted and have no effect: the reply is greedy, as at
  temperature 0; a value that asks for sampling is named in ``x_pcd.warnings``.

The request also says what to run (`ChatCompletionRequest.tool_specs`, ``transcript``,
``chat_messages``); ``pcd_integrations/http/chat_completions.py`` runs it and answers with the reply
models of ``wire/chat_reply.py``. ``tests/test_chat_completions.py`` drives the route with the real
``openai``, LangChain, instructor and LlamaIndex clients.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pcd_core import Message, ToolChoice, ToolChoiceError, ToolSpec, normalise_tool_choice
from pcd_core.reading.chatting import transcript

#: The most tokens a generated reply has when the request sets no ``max_tokens``.
DEFAULT_MAX_TOKENS = 256
_NAME = r"^[A-Za-z0-9_-]{1,64}$"
_UNSUPPORTED = {"image_url": "images", "input_audio": "audio", "file": "files"}


class ChatObject(BaseModel):
    """The base of every Chat Completions model, the replies' included (``wire/chat_reply.py``)."""

    # Fields this server does not use (seed, user, metadata, store, ...) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")


def _tag_by(key: str, tags: dict[str, str], other: str | None = None) -> Callable[[Any], str | None]:
    """A discriminator that reads ``key`` and answers with a class name: union tags then never look
    like field names in an error's location (``messages[0].content[1]``, not ``messages[0].user...``).
    """

    def tag(value: Any) -> str | None:
        kind = value.get(key) if isinstance(value, dict) else getattr(value, key, None)
        return tags.get(kind, other) if isinstance(kind, str) else other

    return tag


# -- request: content parts ---------------------------------------------------------------------
class TextPart(ChatObject):
    type: Literal["text"]
    text: StrictStr


class UnsupportedPart(ChatObject):
    """Any part that is not text: refused, so that nothing is answered on less than was sent."""

    type: StrictStr

    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedPart:
        what = _UNSUPPORTED.get(self.type)
        if what is not None:
            raise ValueError(
                f"{self.type} parts ({what}) are not supported: pcd-engine reads text only; send the text "
                "(a caption, a transcript) as a text part"
            )
        raise ValueError(f"a content part of type {self.type!r} is not supported; send text parts")


Part = Annotated[
    Annotated[TextPart, Tag("TextPart")] | Annotated[UnsupportedPart, Tag("UnsupportedPart")],
    Discriminator(_tag_by("type", {"text": "TextPart"}, "UnsupportedPart")),
]


def _as_parts(value: Any) -> Any:
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _text(parts: list[TextPart] | list[Part] | None) -> str:
    return "\n\n".join(part.text for part in parts or () if isinstance(part, TextPart))


# -- request: messages --------------------------------------------------------------------------
class _Message(ChatObject):
    content: list[Part] = Field(min_length=1)

    @field_validator("content", mode="before")
    @classmethod
    def _content_parts(cls, value: Any) -> Any:
        return _as_parts(value)

    @property
    def text(self) -> str:
        return _text(self.content)


class SystemMessage(_Message):
    """A system or developer instruction; both are the system turn of the chat template."""

    role: Literal["system", "developer"]
    name: StrictStr | None = None


class UserMessage(_Message):
    role: Literal["user"]
    name: StrictStr | None = None


class FunctionCall(ChatObject):
    name: StrictStr
    arguments: StrictStr = Field(description="The arguments as a JSON text, as OpenAI writes them.")


class ToolCall(ChatObject):
    """A tool call: in an assistant message of the request, and in the reply."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall

    @classmethod
    def of(cls, call_id: str, name: str, arguments: dict[str, Any]) -> ToolCall:
        return cls(id=call_id, function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


class AssistantMessage(_Message):
    role: Literal["assistant"]
    content: list[Part] | None = None  # type: ignore[assignment]  # a turn that only called tools has none
    tool_calls: list[ToolCall] | None = None
    name: StrictStr | None = None

    @property
    def text(self) -> str:
        """The reply, then each tool call as ``name(arguments)``: the next turn reads what was done."""
        calls = [f"{call.function.name}({call.function.arguments})" for call in self.tool_calls or ()]
        return "\n".join(part for part in (_text(self.content), *calls) if part)


class ToolMessage(_Message):
    """A tool's result; it is what the next decision (another tool, or the answer) reads."""

    role: Literal["tool"]
    tool_call_id: StrictStr


ROLES = {
    "system": "SystemMessage",
    "developer": "SystemMessage",
    "user": "UserMessage",
    "assistant": "AssistantMessage",
    "tool": "ToolMessage",
}
ChatMessage = Annotated[
    Annotated[SystemMessage, Tag("SystemMessage")]
    | Annotated[UserMessage, Tag("UserMessage")]
    | Annotated[AssistantMessage, Tag("AssistantMessage")]
    | Annotated[ToolMessage, Tag("ToolMessage")],
    Discriminator(
        _tag_by("role", ROLES),
        custom_error_type="invalid_role",
        custom_error_message="a message needs a role of 'system', 'developer', 'user', 'assistant' or 'tool'",
    ),
]


# -- request: tools and formats ------------------------------------------------------------------
class FunctionDefinition(ChatObject):
    name: str = Field(pattern=_NAME)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolParam(ChatObject):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(ChatObject):
    name: StrictStr


class NamedToolChoice(ChatObject):
    type: Literal["function"]
    function: NamedFunction


class TextFormat(ChatObject):
    type: Literal["text"]


class JsonObjectFormat(ChatObject):
    """``{"type": "json_object"}``: any JSON object, which leaves the engine nothing to fill: refused."""

    type: Literal["json_object"]

    @model_validator(mode="after")
    def _refuse(self) -> JsonObjectFormat:
        raise ValueError(
            "response_format json_object names no schema, and pcd-engine fills a schema field by field; send "
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
        )


class JsonSchemaSpec(ChatObject):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(pattern=_NAME)
    description: StrictStr | None = None
    # aliased: ``schema`` is a BaseModel method name
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = Field(default=None, description="Accepted; every fill is strict by construction.")


class JsonSchemaFormat(ChatObject):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    Annotated[TextFormat, Tag("TextFormat")]
    | Annotated[JsonObjectFormat, Tag("JsonObjectFormat")]
    | Annotated[JsonSchemaFormat, Tag("JsonSchemaFormat")],
    Discriminator(
        _tag_by("type", {"text": "TextFormat", "json_object": "JsonObjectFormat", "json_schema": "JsonSchemaFormat"}),
        custom_error_type="invalid_response_format",
        custom_error_message="response_format needs a type of 'text', 'json_schema' or 'json_object'",
    ),
]


class StreamOptions(ChatObject):
    include_usage: StrictBool = False


class ChatCompletionRequest(ChatObject):
    """The body of ``POST /v1/chat/completions``; see the module docstring for what is refused."""

    model: StrictStr
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    n: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = Field(default=None, description="Accepted; one tool is called per turn.")

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(value)}")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError(f"n={value} is not supported: decoding is greedy, so every choice would be the same")
        return value

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("logprobs are not returned: decisions carry their probabilities in x_pcd instead")
        return value

    # the tools and the choice are read as they are validated (a ToolChoiceError is a ValueError), so
    # that a bad one is a 400 pointed at its field before any model work
    @field_validator("tools")
    @classmethod
    def _usable_tools(cls, value: list[ToolParam] | None) -> list[ToolParam] | None:
        _tool_specs(value)
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_names_a_tool(cls, value: Any, info: ValidationInfo) -> Any:
        _tool_choice(value, info.data.get("tools"))
        return value

    # -- what to run --------------------------------------------------------------------------
    def tool_specs(self) -> list[ToolSpec]:
        return _tool_specs(self.tools)

    def choice(self) -> ToolChoice:
        """``tool_choice`` in the core's form; ``none`` when there are no tools."""
        return _tool_choice(self.tool_choice, self.tools)

    def response_schema(self) -> dict[str, Any] | None:
        """The JSON Schema to fill, when ``response_format`` is ``json_schema``."""
        if isinstance(self.response_format, JsonSchemaFormat):
            return self.response_format.json_schema.schema_
        return None

    def chat_messages(self) -> list[Message]:
        """Role/content dicts for ``engine.generate``, rendered by the model's chat template."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in self.messages]

    def transcript(self) -> str:
        """The input text of a fill or a tool choice (``pcd_core.reading.chatting.transcript``)."""
        return transcript(self.chat_messages())

    def called_this_turn(self) -> set[str]:
        """Tools called since the latest user message, which ``auto`` does not offer again."""
        called: set[str] = set()
        for message in reversed(self.messages):
            if isinstance(message, UserMessage):
                break
            if isinstance(message, AssistantMessage):
                called.update(call.function.name for call in message.tool_calls or ())
        return called

    def max_new_tokens(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    def warnings(self) -> list[str]:
        """What the request asked for that greedy decoding does not do."""
        return [
            f"{name}={value} is ignored: pcd-engine decodes greedily (as temperature 0)"
            for name, value, neutral in (("temperature", self.temperature, 0), ("top_p", self.top_p, 1))
            if value is not None and value != neutral
        ]


def _tool_specs(tools: list[ToolParam] | None) -> list[ToolSpec]:
    specs = [ToolSpec(t.function.name, t.function.description, t.function.parameters or {}) for t in tools or ()]
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ToolChoiceError(f"tool names must be distinct, got {names}")
    return specs


def _tool_choice(tool_choice: Any, tools: list[ToolParam] | None) -> ToolChoice:
    raw = tool_choice.model_dump() if isinstance(tool_choice, NamedToolChoice) else tool_choice
    names = [spec.name for spec in _tool_specs(tools)]
    if not names:
        if raw not in (None, "auto", "none"):
            raise ToolChoiceError(f"tool_choice={raw!r} needs tools, and the request has none")
        return ToolChoice("none")
    return normalise_tool_choice(raw, names)


#: Every field name of the request models: the parts of a pydantic error location that are a path in
#: the body (the rest are the class-name union tags above and member names such as ``str``).
FIELD_NAMES = frozenset(
    name
    for model in (
        ChatCompletionRequest,
        TextPart,
        UnsupportedPart,
        SystemMessage,
        UserMessage,
        AssistantMessage,
        ToolMessage,
        ToolCall,
        FunctionCall,
        ToolParam,
        FunctionDefinition,
        NamedToolChoice,
        NamedFunction,
        JsonSchemaFormat,
        JsonSchemaSpec,
        StreamOptions,
    )
    for key, info in model.model_fields.items()
    for name in (key, info.alias or key)
)
