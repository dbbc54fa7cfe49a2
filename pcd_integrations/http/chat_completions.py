"""What ``POST /v1/chat/completions`` runs: a tool choice, a schema fill, or generated text.

`reply_steps` turns one `ChatCompletionRequest` into engine calls, in this order:

1. with ``tools`` (and ``tool_choice`` other than ``none``), the core tool choice
   (``pcd_core/tools.py``) over the transcript; a chosen tool is the reply, its arguments a fill of
   its parameter schema, ``finish_reason: "tool_calls"``;
2. with ``response_format`` ``json_schema``, ``engine.fill`` of the schema: closed fields decided,
   open ones generated under the schema's grammar; the content is the JSON object;
3. otherwise ``engine.stream``: greedy text, token by token, with ``max_tokens`` and ``stop``.

Either way the steps are text deltas (only generation has more than one) and then a `Reply` with the
whole answer, its cost and its ``x_pcd``, so that the route answers with one body or with a stream
from the same calls. ``max_tokens`` and ``stop`` bound generated text; a fill's fields are bounded
by their schema and the engine's per-field caps instead. The module is blocking: the route runs
each step in a worker thread. ``tests/test_chat_completions.py`` covers it through the route.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pcd_core import (
    Engine,
    Extraction,
    Generation,
    ReplyTooLongError,
    RequestError,
    Stats,
    ToolDecision,
    choose_tool,
    tool_arguments,
)
from pcd_integrations.wire.chat import ChatCompletionRequest, ToolCall
from pcd_integrations.wire.chat_reply import (
    AssistantReply,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChunkChoice,
    CompletionUsage,
    Delta,
    FinishReason,
    PcdExtension,
    ToolCallDelta,
)

__all__ = ["Reply", "chunks", "completion", "reply_steps"]


@dataclass
class Reply:
    """One request's answer, before it is shaped as a body or as chunks."""

    content: str | None
    finish_reason: FinishReason
    usage: CompletionUsage
    pcd: PcdExtension
    tool_call: ToolCall | None = None
    streamed: bool = False  # the content went out as deltas already


def _fields(extraction: Extraction) -> dict[str, dict[str, object]]:
    return {name: result.to_dict() for name, result in extraction.fields.items()}


def _tool_reply(engine: Engine, text: str, decision: ToolDecision, costs: list[Stats], warnings: list[str]) -> Reply:
    tool = decision.tool
    assert tool is not None  # only a chosen tool is called
    extraction = tool_arguments(engine, text, tool)
    if extraction is not None:
        costs.append(extraction.stats)
        warnings += extraction.warnings
    arguments = dict(extraction.values) if extraction is not None else {}
    call = ToolCall.of(f"call_{uuid.uuid4().hex[:24]}", tool.name, arguments)
    pcd = PcdExtension.of(
        costs,
        method="tool_call",
        tool_choice=decision.to_dict(),
        fields=_fields(extraction) if extraction is not None else {},
        warnings=warnings,
    )
    return Reply(content=None, finish_reason="tool_calls", usage=CompletionUsage.of(costs), pcd=pcd, tool_call=call)


def reply_steps(engine: Engine, request: ChatCompletionRequest) -> Iterator[str | Reply]:
    """Text deltas as they are generated, then the `Reply`; see the module docstring for the order."""
    costs: list[Stats] = []  # each engine call's cost record; the wire's usage and x_pcd add them up
    warnings = request.warnings()
    choice, decision = request.choice(), None
    if choice.mode != "none":
        decision = choose_tool(engine, request.transcript(), request.tool_specs(), choice, request.called_this_turn())
        costs.append(decision.stats)  # all zero when nothing was asked
        warnings += decision.warnings
        if decision.tool is not None:
            yield _tool_reply(engine, request.transcript(), decision, costs, warnings)
            return
    recorded = decision.to_dict() if decision is not None and not decision.forced else None
    schema = request.response_schema()
    if schema is not None:
        extraction = engine.fill(schema, request.transcript())
        costs.append(extraction.stats)
        content = json.dumps(extraction.values, ensure_ascii=False)
        pcd = PcdExtension.of(
            costs,
            method="filled",
            fields=_fields(extraction),
            tool_choice=recorded,
            warnings=[*warnings, *extraction.warnings],
        )
        yield Reply(content=content, finish_reason="stop", usage=CompletionUsage.of(costs), pcd=pcd)
        return
    generation = Generation()
    try:
        yield from engine.stream(
            request.chat_messages(),
            max_new_tokens=request.max_new_tokens(),
            stop=request.stop_strings(),
            result=generation,
        )
    except ReplyTooLongError as error:
        raise _over_context(request, error) from error
    costs.append(generation.stats)
    pcd = PcdExtension.of(costs, method="generated", tool_choice=recorded, warnings=warnings)
    yield Reply(
        content=generation.text,
        finish_reason=generation.finish_reason,
        usage=CompletionUsage.of(costs),
        pcd=pcd,
        streamed=True,
    )


def _over_context(request: ChatCompletionRequest, error: ReplyTooLongError) -> RequestError:
    """The engine's "reply cap over the context" in this protocol's words: the parameter the request
    set (``max_completion_tokens`` or ``max_tokens``) and the most it may be; without either, or when
    the messages alone fill the context, the messages are what must change.
    """
    param = next((name for name in ("max_completion_tokens", "max_tokens") if getattr(request, name)), None)
    tokens = f"the messages take {error.prompt_tokens} tokens of the model's context of {error.context_length}"
    if param is None or error.room_tokens == 0:
        message = (
            f"{tokens}, which leaves no room for a reply of up to {error.max_new_tokens} tokens; shorten the "
            f"messages{' or set max_tokens to at most ' + str(error.room_tokens) if error.room_tokens else ''}"
        )
        param = "messages"
    else:
        message = f"{param}={error.max_new_tokens} is over the room left: {tokens}; set {param} to at most {error.room_tokens}"
    return RequestError(message, errors=({"loc": (param,), "msg": message, "type": "context_length_exceeded"},))


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def completion(steps: Iterator[str | Reply], model: str) -> ChatCompletion:
    """The non-streamed body: every step run, the last one is the reply."""
    *_, reply = steps
    assert isinstance(reply, Reply)  # reply_steps always ends with its Reply
    message = AssistantReply(content=reply.content, tool_calls=[reply.tool_call] if reply.tool_call else None)
    return ChatCompletion(
        id=_completion_id(),
        created=int(time.time()),
        model=model,
        choices=[Choice(message=message, finish_reason=reply.finish_reason)],
        usage=reply.usage,
        x_pcd=reply.pcd,
    )


def chunks(steps: Iterator[str | Reply], model: str, include_usage: bool) -> Iterator[ChatCompletionChunk]:
    """The streamed reply in OpenAI's order: the role, the content deltas (a fill's JSON or a tool
    call as one chunk), a last chunk with the finish reason and ``x_pcd``, then the usage if asked.
    """
    completion_id, created = _completion_id(), int(time.time())

    def event(choices: list[ChunkChoice], **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=completion_id, created=created, model=model, choices=choices, **extra)

    def chunk(delta: Delta) -> ChatCompletionChunk:
        return event([ChunkChoice(delta=delta)])

    yield chunk(Delta(role="assistant", content=""))
    for step in steps:
        if isinstance(step, str):
            yield chunk(Delta(content=step))
            continue
        if step.tool_call is not None:
            yield chunk(Delta(tool_calls=[ToolCallDelta(index=0, **step.tool_call.model_dump())]))
        elif step.content and not step.streamed:
            yield chunk(Delta(content=step.content))
        last = ChunkChoice(delta=Delta(), finish_reason=step.finish_reason)
        yield event([last], x_pcd=step.pcd)
        if include_usage:
            yield event([], usage=step.usage)
