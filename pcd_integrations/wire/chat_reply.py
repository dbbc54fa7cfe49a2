"""The OpenAI Chat Completions answers as pydantic models: ``ChatCompletion``, the streamed
``ChatCompletionChunk``, their usage and the ``x_pcd`` extension.

The shapes are those the ``openai`` package (3.51) reads (``openai/types/chat/chat_completion.py``
and ``chat_completion_chunk.py``); the request side is ``wire/chat.py``. Usage and ``x_pcd`` are
rendered from the engine's one cost record (``pcd_core/cost.py``): every engine call behind a reply
adds its tokens and passes. ``tests/test_cost.py`` checks the sums, ``tests/test_chat_completions.py``
reads the replies through the real ``openai`` client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer

from pcd_core import Stats
from pcd_integrations.wire.chat import ChatObject, ToolCall

FinishReason = Literal["stop", "length", "tool_calls"]


class AssistantReply(ChatObject):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


class Choice(ChatObject):
    index: int = 0
    message: AssistantReply
    finish_reason: FinishReason
    logprobs: None = None


class PromptTokensDetails(ChatObject):
    cached_tokens: int = Field(default=0, description="Head tokens served from the engine's prefix cache.")


class CompletionTokensDetails(ChatObject):
    reasoning_tokens: int = 0


class CompletionUsage(ChatObject):
    prompt_tokens: int = Field(description="Every token read: the prompt, and the rows of each decision.")
    completion_tokens: int = Field(description="Tokens generated; a decided field or tool costs none.")
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails = Field(default_factory=CompletionTokensDetails)

    @classmethod
    def of(cls, costs: Sequence[Stats]) -> CompletionUsage:
        """One reply's usage from the ``Stats`` of each engine call behind it (a tool choice, then the
        fill of its arguments): their tokens add up.
        """
        prompt_tokens = sum(cost.input_tokens for cost in costs)
        completion_tokens = sum(cost.output_tokens for cost in costs)
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cost.cached_tokens for cost in costs)),
        )


class PcdExtension(ChatObject):
    """``x_pcd``: how the reply was made, and the decisions behind it."""

    method: Literal["generated", "filled", "tool_call"] = Field(
        description="generated: plain text; filled: a json_schema fill; tool_call: a PCD tool choice."
    )
    fields: dict[str, dict[str, Any]] | None = Field(
        default=None, description="Per field of the schema, or of the tool's arguments: FieldResult.to_dict()."
    )
    tool_choice: dict[str, Any] | None = Field(default=None, description="The tool choice: ToolDecision.to_dict().")
    forward_passes: int
    queue_ms: float = Field(0.0, description="Milliseconds the request waited for the model behind other requests.")
    warnings: list[str] = Field(default_factory=list)
    request_id: str | None = Field(
        default=None, description="The request's X-Request-Id (pcd serve): the id its log lines carry."
    )

    @classmethod
    def of(cls, costs: Sequence[Stats], **parts: Any) -> PcdExtension:
        """``x_pcd`` with the passes and waiting of every engine call behind the reply (``costs``)."""
        passes = sum(cost.forward_passes for cost in costs)
        return cls(forward_passes=passes, queue_ms=sum(cost.queue_ms for cost in costs), **parts)


class ChatCompletion(ChatObject):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage
    x_pcd: PcdExtension


class ToolCallDelta(ToolCall):
    index: int = 0


class Delta(ChatObject):
    """A chunk's increment; only what it carries is written (OpenAI sends ``{"content": "..."}``)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _only_what_is_carried(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChunkChoice(ChatObject):
    index: int = 0
    delta: Delta
    finish_reason: FinishReason | None = None
    logprobs: None = None


class ChatCompletionChunk(ChatObject):
    """One server-sent event of a streamed reply; the last one with choices carries ``x_pcd``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None
    x_pcd: PcdExtension | None = None
