"""LangChain adapter: a full chat model whose closed choices are decided and whose open text is generated.

``ChatPCD`` keeps a LangChain user's code unchanged. Plain chat (``invoke``/``stream``) is greedy
generation through ``engine.generate``/``engine.stream``, marked ``{"generated": True}``.
``with_structured_output(Schema)`` is one ``engine.fill``: closed fields are decided among their
allowed values, open ones (strings, numbers, lists, nested objects) generated in parallel under their
JSON Schema grammar, so the parsed object always matches the schema. ``bind_tools`` makes which tool
to call a PCD choice (``engine.decide``) over the tool names and descriptions, and its arguments a
``fill`` of the tool's argument schema. ``PCDDecisionModel`` (``pcd_integrations/langchain/decisions.py``,
re-exported by the package) is LangChain's ``BaseDecisionModel`` on ``engine.decide``. Nothing here builds a
prompt template or touches token ids: messages become role/content dicts (chat) or the engine's input
text (fill and decide).

Proof: ``tests/test_langchain.py`` and ``tests/test_langchain_agent.py`` on the embedded model, and
LangChain's standard suites in ``tests/test_langchain_standard.py``, whose xfail list is the public
list of gaps.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal, get_args

from pcd_core import (
    NO_TOOL,
    BackendUnavailableError,
    Engine,
    Extraction,
    Generation,
    PromptError,
    Stats,
    ToolDecision,
    ToolSpec,
    choose_tool,
    normalise_tool_choice,
    tool_arguments,
)
from pcd_core.concurrency.model_lock import in_thread

try:
    from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
    from langchain_core.language_models import BaseChatModel, LanguageModelInput, ModelProfile
    from langchain_core.language_models.base import LangSmithParams
    from langchain_core.messages import (
        AIMessage,
        AIMessageChunk,
        BaseMessage,
        HumanMessage,
        get_buffer_string,
    )
    from langchain_core.messages.tool import ToolCall, tool_call_chunk
    from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
    from langchain_core.tools import BaseTool
    from langchain_core.utils.function_calling import convert_to_openai_tool
    from langchain_core.utils.pydantic import is_basemodel_subclass
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("langchain", "langchain-core") from error

from pcd_integrations.langchain.decisions import usage_metadata
from pcd_integrations.serving.lazy_engine import LazyEngine
from pcd_integrations.serving.threads import iterate_in_thread

__all__ = ["NO_TOOL", "ChatPCD", "render_chat_messages", "render_messages"]

# Every value LangChain passes as ``method``; for PCD they all mean "fill the schema": closed fields
# decided, open ones generated under the schema's grammar, which is stricter than any of them.
StructuredOutputMethod = Literal["json_schema", "function_calling", "json_mode"]
_METHODS = get_args(StructuredOutputMethod)

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool"}


def _text_of(index: int, message: BaseMessage) -> str:
    """The message's text; a block that is not text is refused, except an AI message's own tool
    calls (they are in ``message.tool_calls``, read separately).
    """
    if isinstance(message.content, list):
        for block in message.content:
            kind = block.get("type") if isinstance(block, Mapping) else "text"
            if kind == "text" or (isinstance(message, AIMessage) and kind in ("tool_use", "tool_call")):
                continue
            raise PromptError(
                f"message {index} holds a {kind!r} block; ChatPCD reads text only, so pass the text "
                "(for example a transcript or a caption) instead"
            )
    return message.text


def _tool_calls_text(message: BaseMessage) -> str:
    calls = message.tool_calls if isinstance(message, AIMessage) else []
    return "\n".join(f"{call['name']}({json.dumps(call['args'], ensure_ascii=False)})" for call in calls)


def render_messages(messages: Sequence[BaseMessage]) -> str:
    """The input text of ``fill`` and of the tool choice. A lone message is the input itself; a
    conversation keeps its roles ("Human: ...", "AI: ...", "Tool: ...") so that decisions can tell
    who said what, including the latest tool results.
    """
    texts = [_text_of(index, message) for index, message in enumerate(messages)]
    if len(messages) == 1:
        return texts[0]
    return get_buffer_string(messages)


def render_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """Role/content dicts for ``engine.generate``; the model's chat template renders them. An AI turn
    that called tools keeps the calls as text, so that the following tool results have a question.
    """
    rendered = []
    for index, message in enumerate(messages):
        text = _text_of(index, message)
        calls = _tool_calls_text(message)
        content = "\n".join(part for part in (text, calls) if part)
        rendered.append({"role": _ROLES.get(message.type, "user"), "content": content})
    return rendered


def _field_metadata(extraction: Extraction) -> dict[str, dict[str, Any]]:
    """Per field, JSON-able: decided fields their probabilities and candidate mass, generated fields
    their text and log-prob stats, so that a chain can gate on confidence without parsing text.
    """
    return {name: result.to_dict() for name, result in extraction.fields.items()}


def _parameters(schema: Any) -> Any:
    """What ``engine.fill`` takes for a LangChain schema: a pydantic v2 class as it is (the engine
    reads its defaults and validators), every other form (TypedDict, JSON Schema, OpenAI tool or
    function dict, pydantic v1, a tool) normalised by LangChain to the JSON Schema of its parameters.
    """
    if isinstance(schema, type) and hasattr(schema, "model_validate"):
        return schema
    if _is_untitled(schema):
        return dict(schema)  # an untitled JSON Schema, which LangChain's converter refuses
    return convert_to_openai_tool(schema)["function"]["parameters"]


def _is_untitled(schema: Any) -> bool:
    return isinstance(schema, Mapping) and "properties" in schema and "title" not in schema and "name" not in schema


def _response_format_schema(response_format: Any) -> Any:
    """The JSON Schema of an OpenAI-style ``response_format``, which ``create_agent`` binds when the
    profile says structured output is supported; None for none or for ``{"type": "json_object"}``.
    """
    if isinstance(response_format, Mapping) and response_format.get("type") == "json_schema":
        return (response_format.get("json_schema") or {}).get("schema")
    return None


def _tool_spec(tool: Mapping[str, Any]) -> ToolSpec:
    """An OpenAI-shaped tool (what ``convert_to_openai_tool`` makes) as the engine's tool."""
    function = tool["function"]
    return ToolSpec(function["name"], function.get("description"), function.get("parameters") or {})


def _called_this_turn(messages: Sequence[BaseMessage]) -> set[str]:
    """Tools already called since the latest human message."""
    called: set[str] = set()
    for message in reversed(messages):
        if isinstance(message, HumanMessage):
            break
        if isinstance(message, AIMessage):
            called.update(call["name"] for call in message.tool_calls)
    return called


class ChatPCD(LazyEngine, BaseChatModel):
    """A LangChain chat model: text generated, structured output filled, tool calls chosen by PCD.

    - Plain chat: greedy generation (deterministic), streamed token by token; ``stop`` and
      ``max_tokens`` apply. The message says ``response_metadata["pcd"] == {"generated": True}``.
    - ``with_structured_output(Schema)``: pydantic (returns an instance), TypedDict, JSON Schema,
      OpenAI tool or function dict (return a dict). Closed fields are decided, open ones generated;
      every ``method`` and ``strict`` value is accepted, output is always schema-valid. The raw
      message carries every field in ``response_metadata["pcd"]``.
    - ``bind_tools(tools, tool_choice=...)``: the core tool choice (``pcd_core/tools.py``): which
      tool is a PCD choice over the tool names and descriptions (plus ``NO_TOOL`` under ``"auto"``),
      its probabilities in ``response_metadata["pcd"]["tool_choice"]``; the arguments are a fill of
      the tool's argument schema. One tool call per turn. Under ``"auto"``, a tool already called
      since the latest human message is not offered again, so that an agent loop ends.

    Weights load on first use; pass ``engine=`` to share a loaded ``pcd_core.Engine``. Sampling
    parameters (``temperature``) do not exist: decoding is greedy or decided.
    """

    max_tokens: int = 256
    """The most tokens plain chat generates in one reply."""
    stop: list[str] | None = None
    """Stop strings for plain chat; a call's ``stop`` replaces them."""

    @property
    def _llm_type(self) -> str:
        return "pcd"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "backend": self.backend, "max_tokens": self.max_tokens}

    def _resolve_model_profile(self) -> ModelProfile | None:
        # What create_agent reads to pick its structured-output strategy; text in, text out.
        return ModelProfile(
            text_inputs=True,
            image_inputs=False,
            audio_inputs=False,
            pdf_inputs=False,
            video_inputs=False,
            text_outputs=True,
            tool_calling=True,
            tool_choice=True,
            structured_output=True,
            open_weights=True,
        )

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="pcd",
            ls_model_name=kwargs.get("model") or self.model,
            ls_model_type="chat",
            ls_max_tokens=kwargs.get("max_tokens") or self.max_tokens,
        )
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # -- binding ------------------------------------------------------------------------------
    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: StructuredOutputMethod | None = None,
        strict: bool | None = None,
        include_raw: bool = False,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Fill ``schema`` from the rendered messages; see the class docstring for what it accepts.

        ``method`` and ``strict`` are accepted for compatibility and change nothing: every method is
        served by the same fill, which is always strict. ``include_raw=True`` returns
        ``{"raw": AIMessage, "parsed": ..., "parsing_error": None}``.
        """
        if kwargs:
            raise ValueError(f"Received unsupported arguments {kwargs}")
        if method is not None and method not in _METHODS:
            raise ValueError(f"method={method!r} is not one of {_METHODS}")
        llm = self.bind(
            response_schema=schema,
            ls_structured_output_format={
                "kwargs": {"method": method or "json_schema", "strict": strict},
                "schema": schema,
            },
        )
        parser: Runnable[Any, Any]
        if isinstance(schema, type) and is_basemodel_subclass(schema):
            parser = PydanticOutputParser(pydantic_object=schema)
        else:
            parser = JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools in OpenAI's shape; see the class docstring for how a call is chosen and filled."""
        formatted = [convert_to_openai_tool(tool) for tool in tools]
        names = [_tool_spec(tool).name for tool in formatted]  # a reserved or empty name is refused here
        return self.bind(tools=formatted, tool_choice=normalise_tool_choice(tool_choice, names), **kwargs)

    # -- one call -----------------------------------------------------------------------------
    def _check_model(self, kwargs: dict[str, Any]) -> None:
        requested = kwargs.get("model")
        if requested is not None and requested != self.model:
            raise ValueError(
                f"ChatPCD does not switch models per call (asked for {requested!r}, "
                f"loaded {self.model!r}); create ChatPCD(model={requested!r}) instead"
            )

    def _filled(self, extraction: Extraction, engine: Engine, content: str, pcd: dict[str, Any]) -> AIMessageChunk:
        stats = extraction.stats
        return AIMessageChunk(
            content=content,
            response_metadata={
                "model_name": engine.model_name,
                "finish_reason": "stop",
                "forward_passes": stats.forward_passes,
                "queue_ms": stats.queue_ms,
                "pcd": pcd,
                "pcd_warnings": list(extraction.warnings),
            },
            usage_metadata=usage_metadata(stats),
            chunk_position="last",
        )

    def _structured(self, engine: Engine, messages: list[BaseMessage], schema: Any) -> AIMessageChunk:
        extraction = engine.fill(_parameters(schema), render_messages(messages))
        content = json.dumps(extraction.values, ensure_ascii=False)
        return self._filled(extraction, engine, content, _field_metadata(extraction))

    def _tool_call(self, engine: Engine, messages: list[BaseMessage], decision: ToolDecision) -> AIMessageChunk:
        """One call of the chosen tool: its arguments are a fill of its parameters' schema."""
        tool = decision.tool
        assert tool is not None  # only a chosen tool is called
        extraction = tool_arguments(engine, render_messages(messages), tool)
        if extraction is not None:
            args = extraction.values
            chunk = self._filled(extraction, engine, "", {"arguments": _field_metadata(extraction)})
        else:  # nothing to fill
            args = {}
            chunk = AIMessageChunk(content="", usage_metadata=usage_metadata(Stats()), chunk_position="last")
            chunk.response_metadata = {"model_name": engine.model_name, "pcd": {"arguments": {}}}
        chunk.response_metadata["finish_reason"] = "tool_calls"
        chunk.response_metadata["pcd"]["tool_choice"] = decision.to_dict()
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        chunk.tool_call_chunks = [
            tool_call_chunk(name=tool.name, args=json.dumps(args, ensure_ascii=False), id=call_id, index=0)
        ]
        chunk.tool_calls = [ToolCall(name=tool.name, args=args, id=call_id, type="tool_call")]
        return chunk

    def _chat_stream(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any], pcd: dict[str, Any]
    ) -> Iterator[AIMessageChunk]:
        """Plain chat, one chunk per text delta and a last one with the usage and finish reason."""
        engine = self.load_engine()
        result = Generation()
        deltas = engine.stream(
            render_chat_messages(messages),
            max_new_tokens=kwargs.get("max_tokens") or self.max_tokens,
            stop=stop or self.stop or (),
            result=result,
        )
        for delta in deltas:
            yield AIMessageChunk(content=delta)
        yield AIMessageChunk(
            content="",
            response_metadata={
                "model_name": engine.model_name,
                "finish_reason": result.finish_reason,
                "forward_passes": result.stats.forward_passes,
                "queue_ms": result.stats.queue_ms,
                "pcd": {"generated": True, **pcd},
            },
            usage_metadata=usage_metadata(result.stats),
            chunk_position="last",
        )

    def _chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[AIMessageChunk]:
        """The reply's chunks: a tool call, a fill of the schema (``with_structured_output`` or an
        OpenAI-style ``response_format``), or generated text; a tool choice that led to no call is
        kept in the metadata (``pcd_tool_choice`` next to a fill's fields).
        """
        self._check_model(kwargs)
        schema = kwargs.get("response_schema")
        if schema is None:
            schema = _response_format_schema(kwargs.get("response_format"))
        specs = [_tool_spec(tool) for tool in kwargs.get("tools") or []]
        choice = normalise_tool_choice(kwargs.get("tool_choice"), [spec.name for spec in specs])
        pcd: dict[str, Any] = {}
        if specs and choice.mode != "none":
            engine = self.load_engine()
            decision = choose_tool(engine, render_messages(messages), specs, choice, _called_this_turn(messages))
            if decision.tool is not None:
                yield self._tool_call(engine, messages, decision)
                return
            if not decision.forced:  # a choice that was read, and chose to answer
                pcd = {"tool_choice": decision.to_dict()}
        if schema is not None:  # the answer is the schema, filled
            chunk = self._structured(self.load_engine(), messages, schema)
            chunk.response_metadata.update({f"pcd_{key}": value for key, value in pcd.items()})
            yield chunk
            return
        yield from self._chat_stream(messages, stop, kwargs, pcd)

    @staticmethod
    def _result(chunks: Iterator[AIMessageChunk]) -> ChatResult:
        whole: AIMessageChunk | None = None
        for chunk in chunks:
            whole = chunk if whole is None else whole + chunk
        assert whole is not None  # every path yields at least its last chunk
        message = AIMessage(
            content=whole.content,
            response_metadata=whole.response_metadata,
            usage_metadata=whole.usage_metadata,
            tool_calls=whole.tool_calls,
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._result(self._chunks(messages, stop, kwargs))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await in_thread(self._result, self._chunks(messages, stop, kwargs))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for message in self._chunks(messages, stop, kwargs):
            chunk = ChatGenerationChunk(message=message)
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for message in iterate_in_thread(self._chunks(messages, stop, kwargs)):
            chunk = ChatGenerationChunk(message=message)
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
