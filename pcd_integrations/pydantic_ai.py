"""pydantic-ai adapter: ``PCDModel``, a pydantic-ai ``Model`` whose structured output is a PCD fill.

``Agent(PCDModel(engine), output_type=Ticket)`` returns the ``Ticket`` that ``engine.fill(Ticket, prompt,
task=instructions)`` returns: pydantic-ai hands the output type to a model as the JSON Schema of an
output tool (its default ``'tool'`` mode, which this model's profile keeps), and that schema is filled,
closed fields decided among their allowed values and open ones generated under their grammar, so the
call always validates. Each field's decision (probability, candidate mass, the alternatives) and the
call's cost (``pcd_core/cost.py``) are in the response's ``provider_details``; pydantic-ai keeps them
on the ``ModelResponse`` in the run's messages.

Function tools are chosen as ``ChatPCD`` chooses them (``pcd_core/tools.py``, the shared rules): which
tool is one PCD choice over the tool names and descriptions plus "produce the final output", a tool
already called since the latest user prompt is not offered again, and the arguments are a fill of the
tool's parameter schema. Without an output type (``str`` output) the reply is greedy generation,
streamed token by token under ``run_stream``; a fill or a tool call streams as one part, since it is
read, not written, in a few passes.

The adapter translates and nothing more: messages become the engine's input text (a lone user prompt
is the input itself; a conversation keeps its roles), instructions and system prompts its ``task``.
It never builds a prompt or touches token ids. Proof: ``tests/test_pydantic_ai.py`` on the embedded
model, beside pydantic-ai's own ``SystemOneModel`` against ``pcd serve`` on loopback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pcd_core import (
    NO_TOOL,
    BackendUnavailableError,
    Engine,
    Extraction,
    Generation,
    LoadOptions,
    PcdError,
    PromptError,
    SchemaError,
    ToolChoice,
    ToolDecision,
    ToolSpec,
    choose_tool,
    tool_arguments,
)
from pcd_core.concurrency.model_lock import in_thread

try:
    from pydantic_ai.exceptions import UserError
    from pydantic_ai.messages import (
        ModelMessage,
        ModelRequest,
        ModelResponse,
        ModelResponsePart,
        ModelResponseStreamEvent,
        RetryPromptPart,
        SystemPromptPart,
        TextPart,
        ToolCallPart,
        ToolReturnPart,
        UserPromptPart,
    )
    from pydantic_ai.models import Model, ModelRequestParameters, StreamedResponse
    from pydantic_ai.profiles import ModelProfile
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.tools import ToolDefinition
    from pydantic_ai.usage import RequestUsage
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("pydantic-ai", "pydantic-ai-slim") from error

from pcd_integrations.serving.threads import iterate_in_thread

__all__ = ["NO_TOOL", "PCDModel", "PCDStreamedResponse", "render_conversation"]

logger = logging.getLogger(__name__)

#: The most tokens a generated (``str`` output) reply has when ``max_tokens`` is not set.
DEFAULT_MAX_TOKENS = 256

_ROLE_NAMES = {"user": "User", "assistant": "Assistant", "tool": "Tool"}


def _user_text(part: UserPromptPart) -> str:
    if isinstance(part.content, str):
        return part.content
    texts = [item for item in part.content if isinstance(item, str)]
    if len(texts) != len(part.content):
        kinds = sorted({type(item).__name__ for item in part.content if not isinstance(item, str)})
        raise PromptError(
            f"the user prompt holds {', '.join(kinds)} content; PCDModel reads text only, so pass the text "
            "(for example a transcript or a caption) instead"
        )
    return "\n".join(texts)


def _turns(messages: Sequence[ModelMessage], output_tools: frozenset[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """The system texts and the conversation turns as (role, text); output-tool calls and their
    "final result processed" returns are the framework's bookkeeping, not conversation.
    """
    system: list[str] = []
    turns: list[tuple[str, str]] = []
    for message in messages:
        if isinstance(message, ModelRequest):
            for part in message.parts:
                if isinstance(part, SystemPromptPart):
                    system.append(part.content)
                elif isinstance(part, UserPromptPart):
                    turns.append(("user", _user_text(part)))
                elif isinstance(part, ToolReturnPart) and part.tool_name not in output_tools:
                    turns.append(("tool", f"{part.tool_name}: {part.model_response_str()}"))
                elif isinstance(part, RetryPromptPart):
                    turns.append(("user", part.model_response()))
        elif isinstance(message, ModelResponse):
            for response_part in message.parts:
                if isinstance(response_part, TextPart) and response_part.content:
                    turns.append(("assistant", response_part.content))
                elif isinstance(response_part, ToolCallPart) and response_part.tool_name not in output_tools:
                    turns.append(("assistant", f"{response_part.tool_name}({response_part.args_as_json_str()})"))
    return system, turns


def render_conversation(turns: Sequence[tuple[str, str]]) -> str:
    """The input text of ``fill`` and of the tool choice: a lone user turn is the input itself; a
    conversation keeps its roles ("User: ...", "Assistant: ...", "Tool: ..."), as ``ChatPCD`` does.
    """
    if len(turns) == 1 and turns[0][0] == "user":
        return turns[0][1]
    return "\n".join(f"{_ROLE_NAMES[role]}: {text}" for role, text in turns)


def _called_this_turn(messages: Sequence[ModelMessage]) -> set[str]:
    """Tools already called since the latest user prompt."""
    called: set[str] = set()
    for message in reversed(messages):
        if isinstance(message, ModelRequest) and any(isinstance(p, UserPromptPart) for p in message.parts):
            break
        if isinstance(message, ModelResponse):
            called.update(part.tool_name for part in message.parts if isinstance(part, ToolCallPart))
    return called


def _instructions(messages: Sequence[ModelMessage], parameters: ModelRequestParameters, system: list[str]) -> str:
    """The ``task`` of every fill: system prompts, then the agent's instructions."""
    if parameters.instruction_parts is not None:
        instructions = [part.content for part in parameters.instruction_parts]
    else:  # a direct ``model.request()`` call: the latest request's own instructions
        latest = next((m for m in reversed(messages) if isinstance(m, ModelRequest)), None)
        instructions = [latest.instructions] if latest is not None and latest.instructions else []
    return "\n\n".join(text for text in (*system, *instructions) if text)


def _spec(tool: ToolDefinition) -> ToolSpec:
    return ToolSpec(tool.name, tool.description, tool.parameters_json_schema)


def _tool_choice(setting: Any, names: Sequence[str], output_names: Sequence[str]) -> tuple[ToolChoice, list[str]]:
    """pydantic-ai's ``tool_choice`` setting as the engine's, and the function tools it leaves offered."""
    if setting is None or setting == "auto":
        return ToolChoice("auto"), list(names)
    if setting == "none":
        return ToolChoice("none"), []
    if setting == "required":
        return ToolChoice("required"), list(names)
    if isinstance(setting, list) and all(isinstance(name, str) for name in setting):
        offered = [name for name in names if name in setting]
        finish = any(name in output_names for name in setting)
        if len(offered) == 1 and not finish:
            return ToolChoice("named", offered[0]), offered
        return ToolChoice("auto" if finish else "required"), offered
    raise UserError(
        f"PCDModel takes tool_choice None, 'auto', 'none', 'required' or a list of tool names, not {setting!r}"
    )


def _usage(extraction_or_stats: Any) -> RequestUsage:
    stats = getattr(extraction_or_stats, "stats", extraction_or_stats)
    return RequestUsage(
        input_tokens=stats.input_tokens, output_tokens=stats.output_tokens, cache_read_tokens=stats.cached_tokens
    )


@dataclass(frozen=True)
class _Generated:
    """The end of a generated reply: its text came before as deltas; this carries the whole response."""

    response: ModelResponse


def _filled_details(extraction: Extraction) -> dict[str, Any]:
    """Per field, JSON-able: a decided field's value, probability, candidate mass and alternatives,
    a generated field's text statistics; then what the call cost and any warning.
    """
    return {
        "fields": {name: result.to_dict() for name, result in extraction.fields.items()},
        "cost": extraction.stats.to_dict(),
        "warnings": list(extraction.warnings),
    }


@dataclass(init=False)
class PCDModel(Model):
    """A pydantic-ai model on a ``pcd_core.Engine``: output types filled, tools chosen by PCD, text generated.

    Pass an engine to share one already loaded, or use ``PCDModel.from_model("smollm2-135m")``.
    Sampling settings (``temperature``, ``top_p``, ``seed``...) do not exist: decoding is decided or
    greedy; pydantic-ai warns when one is set. ``max_tokens`` and ``stop_sequences`` apply to
    generated (``str``) replies.
    """

    engine: Engine = field(repr=False)
    unsupported_settings = frozenset(
        {"temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "logit_bias"}
    )

    def __init__(self, engine: Engine, *, settings: ModelSettings | None = None) -> None:
        if not isinstance(engine, Engine):
            raise TypeError(f"PCDModel needs a pcd_core.Engine, not {engine!r}; or use PCDModel.from_model(name)")
        self.engine = engine
        profile = ModelProfile(
            supports_tools=True,
            supports_json_schema_output=True,
            supports_json_object_output=False,
            supports_text_output=True,
            supports_image_input=False,
            default_structured_output_mode="tool",
        )
        super().__init__(settings=settings, profile=profile)

    @classmethod
    def from_model(cls, model: str | LoadOptions = "smollm2-135m", **load: Any) -> PCDModel:
        """Load a model (an alias, a Hugging Face id or a local path, as ``Engine.load`` takes it)."""
        return cls(Engine.load(model, **load))

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def system(self) -> str:
        return "pcd"

    # -- one reply ----------------------------------------------------------------------------
    def _plan(self, messages: list[ModelMessage], parameters: ModelRequestParameters) -> tuple[str, str]:
        """The engine's input text and ``task`` for this request."""
        output_names = frozenset(tool.name for tool in parameters.output_tools)
        system, turns = _turns(messages, output_names)
        if not turns:
            raise UserError("PCDModel needs a user prompt to answer")
        return render_conversation(turns), _instructions(messages, parameters, system)

    def _tool_call(self, text: str, decision: ToolDecision) -> ModelResponse:
        tool = decision.tool
        assert tool is not None  # only a chosen tool is called
        extraction = tool_arguments(self.engine, text, tool)
        details: dict[str, Any] = {"tool_choice": decision.to_dict()}
        if extraction is not None:
            details["arguments"] = _filled_details(extraction)
        args = extraction.values if extraction is not None else {}
        usage = _usage(extraction if extraction is not None else decision.stats)
        return self._response([ToolCallPart(tool.name, args)], usage, details, "tool_call")

    def _fill(self, schema: dict[str, Any], text: str, task: str, what: str) -> Extraction:
        try:
            return self.engine.fill(schema, text, task=task)
        except SchemaError as error:
            raise UserError(f"PCDModel cannot fill {what}: {error}") from error

    def _output(self, text: str, task: str, parameters: ModelRequestParameters, pick: ToolDecision | None) -> Any:
        """The final output: the output tool's schema filled (``'tool'`` mode, the default), or the
        output object's (``'native'``/``'prompted'``) as JSON text.
        """
        tools = parameters.output_tools
        if tools:
            tool = tools[0]
            if len(tools) > 1:  # a union of output types: which one is a decision, as for function tools
                pick = choose_tool(self.engine, text, [_spec(t) for t in tools], ToolChoice("required"))
                assert pick.tool is not None  # a required choice always picks a tool
                tool = next(t for t in tools if t.name == pick.tool.name)
            extraction = self._fill(tool.parameters_json_schema, text, task, f"the output type {tool.name!r}")
            details = _filled_details(extraction)
            if pick is not None:
                details["tool_choice"] = pick.to_dict()
            return self._response(
                [ToolCallPart(tool.name, extraction.values)], _usage(extraction), details, "tool_call"
            )
        output = parameters.output_object
        assert output is not None  # the caller checked that a structured output was asked for
        extraction = self._fill(output.json_schema, text, task, f"the output type {output.name or 'object'!r}")
        content = json.dumps(extraction.values, ensure_ascii=False)
        return self._response([TextPart(content)], _usage(extraction), _filled_details(extraction), "stop")

    def _response(
        self, parts: list[ModelResponsePart], usage: RequestUsage, details: dict[str, Any], finish: Any
    ) -> ModelResponse:
        return ModelResponse(
            parts=parts,
            usage=usage,
            model_name=self.model_name,
            provider_name="pcd",
            provider_details=details,
            finish_reason=finish,
        )

    def _decided(
        self, messages: list[ModelMessage], settings: ModelSettings, parameters: ModelRequestParameters
    ) -> ModelResponse | None:
        """A tool call or a filled output; None when the reply is generated text."""
        text, task = self._plan(messages, parameters)
        functions = parameters.declared_function_tools
        output_names = [tool.name for tool in parameters.output_tools]
        choice, offered = _tool_choice(settings.get("tool_choice"), [t.name for t in functions], output_names)
        pick: ToolDecision | None = None
        if offered and choice.mode != "none":
            specs = [_spec(tool) for tool in functions if tool.name in offered]
            try:
                pick = choose_tool(self.engine, text, specs, choice, _called_this_turn(messages))
            except PcdError as error:
                raise UserError(f"PCDModel cannot choose among the tools {offered}: {error}") from error
            if pick.tool is not None:
                return self._tool_call(text, pick)
            if pick.forced:  # nothing was read: only "answer" was left
                pick = None
        structured = parameters.output_tools or (
            parameters.output_mode in ("native", "prompted") and parameters.output_object is not None
        )
        if structured:
            return self._output(text, task, parameters, pick)
        if not parameters.allow_text_output:
            raise UserError("PCDModel has no output tool, output object or text output to answer with")
        return None

    def _chat(self, messages: list[ModelMessage], parameters: ModelRequestParameters) -> list[dict[str, str]]:
        output_names = frozenset(tool.name for tool in parameters.output_tools)
        system, turns = _turns(messages, output_names)
        task = _instructions(messages, parameters, system)
        chat = [{"role": "system", "content": task}] if task else []
        # the engine's chat template knows user, assistant and system turns; a tool result is read as user text
        chat += [{"role": "assistant" if r == "assistant" else "user", "content": t} for r, t in turns]
        return chat

    def _generated(
        self, messages: list[ModelMessage], settings: ModelSettings, parameters: ModelRequestParameters
    ) -> Iterator[str | ModelResponse | _Generated]:
        """A decided reply as one ``ModelResponse``, or a generated one as text deltas and then the
        whole response (its usage and finish reason), so that streaming and not streaming share one path.
        """
        decided = self._decided(messages, settings, parameters)
        if decided is not None:
            yield decided
            return
        result = Generation()
        deltas = self.engine.stream(
            self._chat(messages, parameters),
            max_new_tokens=settings.get("max_tokens") or DEFAULT_MAX_TOKENS,
            stop=settings.get("stop_sequences") or (),
            result=result,
        )
        yield from deltas
        finish = "stop" if result.finish_reason == "stop" else "length"
        yield _Generated(self._response([TextPart(result.text)], _usage(result.stats), {"generated": True}, finish))

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        settings, parameters = self.prepare_request(model_settings, model_request_parameters)
        steps = self._generated(messages, settings or {}, parameters)
        response: ModelResponse | None = None
        async for step in iterate_in_thread(steps):
            if not isinstance(step, str):
                response = step.response if isinstance(step, _Generated) else step
        assert response is not None  # every path ends with the whole response
        return response

    @asynccontextmanager
    async def request_stream(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
        run_context: Any = None,
    ) -> AsyncIterator[StreamedResponse]:
        settings, parameters = self.prepare_request(model_settings, model_request_parameters)
        steps = self._generated(messages, settings or {}, parameters)
        # the first step (the whole decision, or the first token) runs before the stream is handed
        # over, so that a bad request fails here as the non-streamed call does
        first = await in_thread(next, steps)
        yield PCDStreamedResponse(
            model_request_parameters=parameters, _model_name=self.model_name, _first=first, _rest=steps
        )


@dataclass
class PCDStreamedResponse(StreamedResponse):
    """Text deltas as the engine generates them, or a decided reply's parts at once."""

    _model_name: str
    _first: str | ModelResponse | _Generated
    _rest: Iterator[str | ModelResponse | _Generated]
    _timestamp: datetime = field(default_factory=lambda: datetime.now().astimezone())

    async def _get_event_iterator(self) -> AsyncIterator[ModelResponseStreamEvent]:
        for event in self._events(self._first):
            yield event
        async for step in iterate_in_thread(self._rest):
            for event in self._events(step):
                yield event

    def _events(self, step: str | ModelResponse | _Generated) -> Iterator[ModelResponseStreamEvent]:
        if isinstance(step, str):
            if step:
                yield from self._parts_manager.handle_text_delta(vendor_part_id="content", content=step)
            return
        response = step.response if isinstance(step, _Generated) else step
        self._usage = response.usage
        self.provider_details = response.provider_details
        self.finish_reason = response.finish_reason
        if isinstance(step, _Generated):
            return  # its text came as deltas
        for index, part in enumerate(response.parts):
            yield self._parts_manager.handle_part(vendor_part_id=index, part=part)

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def provider_name(self) -> str:
        return "pcd"

    @property
    def provider_url(self) -> None:
        return None

    @property
    def timestamp(self) -> datetime:
        return self._timestamp
