"""LlamaIndex on the PCD engine: a function-calling LLM and a pydantic program, both engine calls.

`PCDLLM` is a `FunctionCallingLLM` built like LlamaIndex's other LLM classes: ``PCDLLM()`` or
``PCDLLM(model="smollm2-135m")`` loads the weights on first use (`LazyEngine`), ``PCDLLM(engine=engine)``
shares a loaded engine. What each call does with the model:

- ``chat``/``complete`` and their stream and async forms *generate* text with `Engine.generate` /
  `Engine.stream` (greedy, token by token); the token counts are in ``additional_kwargs`` and ``raw``.
- ``chat_with_tools`` (and so a `FunctionAgent`) *decides* which tool to call with the core tool
  choice (``pcd_core/tools.py``): one PCD choice question over the tool names and descriptions, plus
  an "answer directly" option unless a tool is required; its probabilities are in
  ``additional_kwargs["pcd_tool_choice"]``. The chosen tool's arguments are an `Engine.fill` of its
  argument schema (closed fields decided, open ones generated) and come back as `ToolSelection`s from
  ``get_tool_calls_from_response``.
- ``structured_predict`` and its async and stream forms run a `PCDProgram` (one `Engine.fill`),
  inside the same ``dispatcher.span`` and events as `LLM.structured_predict`.

This module is a translation layer only: it turns LlamaIndex messages and prompts into the engine's
messages and input text, and engine results into LlamaIndex responses; prompts for the model, tokens
and backends stay in `pcd_core`. `tests/test_llama_index.py` and `tests/test_llama_index_llm.py`
prove it on the embedded model. `PCDSelector`, the router slot, lives in
`pcd_integrations/llama_index_selector.py` and is re-exported here.

Why one module of ~640 lines: ``PCDLLM`` is one LlamaIndex class whose sync, async and stream forms
of chat, completion, tools and structured prediction must stay side by side to stay alike; the
selector already lives in its own module.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pcd_core import BackendUnavailableError

try:
    from llama_index.core.base.llms.types import (
        ChatMessage,
        ChatResponse,
        ChatResponseAsyncGen,
        ChatResponseGen,
        CompletionResponse,
        CompletionResponseAsyncGen,
        CompletionResponseGen,
        LLMMetadata,
        MessageRole,
        TextBlock,
    )
    from llama_index.core.bridge.pydantic import BaseModel, Field
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.events.llm import (
        LLMStructuredPredictEndEvent,
        LLMStructuredPredictInProgressEvent,
        LLMStructuredPredictStartEvent,
    )
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.function_calling import FunctionCallingLLM
    from llama_index.core.llms.llm import ToolSelection
    from llama_index.core.program.utils import FlexibleModel, create_flexible_model
    from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
    from llama_index.core.types import BasePydanticProgram, Model
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("llama-index", "llama-index-core") from error

from pcd_core import Engine, Extraction, PromptError, SchemaError, parse_schema
from pcd_core.chatting import transcript
from pcd_core.cost import Stats
from pcd_core.options import load_options
from pcd_core.result import Generation
from pcd_core.tools import (
    NO_TOOL,
    ToolChoice,
    ToolDecision,
    ToolSpec,
    choose_tool,
    normalise_tool_choice,
    tool_arguments,
)

from .lazy_engine import LazyEngine
from .llama_index_selector import PCDSelector
from .threads import iterate_in_thread

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

__all__ = ["ANSWER_DIRECTLY", "PCDLLM", "PCDProgram", "PCDSelector", "prompt_to_text"]

dispatcher = get_dispatcher(__name__)

ANSWER_DIRECTLY = NO_TOOL
"""The option of the tool choice that means "no tool: write the reply"."""


def _text_of(message: ChatMessage) -> str:
    """A message's text; non-text blocks raise `PromptError` (dropping them would answer on less)."""
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise PromptError(
                f"a {message.role.value} message holds a {type(block).__name__}; the PCD engine "
                "reads text only, so pass the text (for example a document's .text) instead"
            )
    return message.content or ""


def prompt_to_text(prompt: BasePromptTemplate, prompt_args: Mapping[str, Any], system_prompt: str | None = None) -> str:
    """Format a LlamaIndex prompt into the input text the engine reads.

    The engine writes its own instructions and value catalog around this text, so the prompt is the
    input, not the model's whole prompt. One message is passed as it is; several keep their roles as
    ``role: text`` paragraphs, so that a system instruction is still told apart from the document.
    Images and other non-text blocks raise `PromptError`.
    """
    messages = prompt.format_messages(**prompt_args)
    if system_prompt:
        messages = [ChatMessage(role=MessageRole.SYSTEM, content=system_prompt), *messages]
    return messages_to_text(messages)


def messages_to_text(messages: Sequence[ChatMessage]) -> str:
    """Messages as the input text of a fill or a decision: one alone as it is, else ``role: text``."""
    return transcript([{"role": message.role.value, "content": _engine_content(message)} for message in messages])


def _engine_content(message: ChatMessage) -> str:
    """The message's text; an assistant turn that only called tools is shown as its calls, so that
    the next turn reads what was done rather than an empty reply.
    """
    text = _text_of(message)
    calls = message.additional_kwargs.get("tool_calls") if message.role == MessageRole.ASSISTANT else None
    if not text and calls:
        return json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls])
    return text


def _usage(stats: Stats) -> dict[str, int]:
    """A reply's cost record (``pcd_core/cost.py``) in the names LlamaIndex's token counting reads
    from a response's additional_kwargs.
    """
    return {
        "prompt_tokens": stats.input_tokens,
        "completion_tokens": stats.output_tokens,
        "total_tokens": stats.input_tokens + stats.output_tokens,
    }


def _raw(generation: Generation) -> dict[str, Any]:
    stats = generation.stats
    return {
        "text": generation.text,
        "finish_reason": generation.finish_reason,
        "usage": _usage(stats),
        "cached_tokens": stats.cached_tokens,
        "forward_passes": stats.forward_passes,
        "queue_ms": stats.queue_ms,
        "method": "generated",
    }


def _tool_spec(tool: BaseTool) -> ToolSpec:
    metadata = tool.metadata
    return ToolSpec(metadata.get_name(), metadata.description, metadata.get_parameters_dict())


def _called_this_turn(messages: Sequence[ChatMessage]) -> set[str]:
    """The tools already called since the last user message (from our own tool-call turns)."""
    called: set[str] = set()
    for message in reversed(messages):
        if message.role == MessageRole.USER:
            break
        for call in message.additional_kwargs.get("tool_calls") or ():
            called.add(call["name"])
    return called


def _checked_output_cls(output_cls: type[Model]) -> type[Model]:
    """Reject what the engine cannot fill before any model call, with the field named."""
    if not (isinstance(output_cls, type) and issubclass(output_cls, BaseModel)):
        raise SchemaError(
            f"output_cls must be a pydantic BaseModel class, got {output_cls!r}; for a TypedDict or "
            "a JSON Schema dict call engine.fill(schema, text) directly"
        )
    parse_schema(output_cls)
    return output_cls


class PCDProgram(BasePydanticProgram[Model]):
    """A pydantic program whose every call is one `Engine.fill` over the formatted prompt.

    ``output_cls`` may mix closed fields (booleans, enums, small ints: decided, each with its
    probability) and open ones (strings, numbers, nested objects, lists: generated under a grammar).
    ``program(**prompt_args)`` returns an ``output_cls`` instance; ``acall`` awaits `Engine.afill`,
    which runs in a worker thread, so an event loop (a Workflow step) keeps running. The decisions
    behind an answer come from ``extract``/``aextract``, which return the whole `Extraction`; after
    a plain call ``last_decisions`` holds the same per-field results. That attribute is per program,
    so concurrent callers should use ``aextract`` instead. ``system_prompt``, if given, is sent as a
    system message ahead of the prompt (see `prompt_to_text`).
    """

    def __init__(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        engine: Engine | LazyEngine,
        system_prompt: str | None = None,
    ) -> None:
        self._output_cls = _checked_output_cls(output_cls)
        self._prompt = prompt
        # a PCDLLM is a LazyEngine: the program then loads the weights only when it first runs
        self._source = engine
        self._system_prompt = system_prompt
        self._last_extraction: Extraction | None = None

    @classmethod
    def from_defaults(
        cls,
        output_cls: type[Model],
        prompt_template_str: str | None = None,
        prompt: BasePromptTemplate | None = None,
        llm: Any = None,
        engine: Engine | None = None,
        model: str | None = None,
        verbose: bool = False,
        **load_kwargs: Any,
    ) -> PCDProgram[Model]:
        """Build a program like LlamaIndex's own: an output class, a template string or prompt, and
        ``llm=PCDLLM(...)``, ``engine=`` or ``model=`` (loaded now; ``load_kwargs`` go to `Engine.load`).

        With none of the three, the embedded default model is loaded. ``verbose`` is accepted for
        LlamaIndex's signature and has nothing to print.
        """
        if (prompt is None) == (prompt_template_str is None):
            raise ValueError("pass exactly one of prompt= or prompt_template_str=")
        given = [name for name, value in (("llm", llm), ("engine", engine), ("model", model)) if value is not None]
        if len(given) > 1 or (load_kwargs and (llm is not None or engine is not None)):
            raise ValueError(
                f"pass either llm=, engine= or model=/load options, not several (got {given!r}, "
                f"options={sorted(load_kwargs)!r})"
            )
        if llm is not None and not isinstance(llm, PCDLLM):
            raise ValueError(f"llm= takes a PCDLLM; got {type(llm).__name__}")
        checked_cls = _checked_output_cls(output_cls)
        source: Engine | LazyEngine
        if llm is not None:
            source = llm
        elif engine is not None:
            source = engine
        else:
            source = Engine.load(load_options(model or None, **load_kwargs))
        system_prompt = llm.system_prompt if llm is not None else None
        return cls(checked_cls, prompt or PromptTemplate(str(prompt_template_str)), source, system_prompt=system_prompt)

    @property
    def output_cls(self) -> type[Model]:
        return self._output_cls

    @property
    def prompt(self) -> BasePromptTemplate:
        return self._prompt

    @prompt.setter
    def prompt(self, prompt: BasePromptTemplate) -> None:
        self._prompt = prompt

    @property
    def engine(self) -> Engine:
        """The engine, loaded now if the program was built on a lazy `PCDLLM`."""
        return self._source if isinstance(self._source, Engine) else self._source.load_engine()

    @property
    def last_extraction(self) -> Extraction | None:
        """The full result of the latest call, or None before the first one."""
        return self._last_extraction

    @property
    def last_decisions(self) -> Mapping[str, Any]:
        """Per-field results of the latest call in schema order (a `FieldResult` per decided field,
        a ``GeneratedField`` per generated one); empty before the first call.
        """
        return {} if self._last_extraction is None else self._last_extraction.fields

    def extract(self, **prompt_args: Any) -> Extraction:
        """Fill the object and return every decision behind it, not just the value."""
        text = prompt_to_text(self._prompt, prompt_args, self._system_prompt)
        extraction = self.engine.fill(self._output_cls, text)
        self._last_extraction = extraction
        return extraction

    async def aextract(self, **prompt_args: Any) -> Extraction:
        """`extract` without blocking the event loop (the first load runs in a thread too)."""
        text = prompt_to_text(self._prompt, prompt_args, self._system_prompt)
        engine = self._source if isinstance(self._source, Engine) else await self._source.aload_engine()
        extraction = await engine.afill(self._output_cls, text)
        self._last_extraction = extraction
        return extraction

    def __call__(self, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Model:
        """Return the filled ``output_cls``; ``llm_kwargs`` is accepted for LlamaIndex and ignored
        (the engine decides and generates greedily, so sampling options have nothing to act on).
        """
        return self.extract(**prompt_args).value

    async def acall(self, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Model:
        return (await self.aextract(**prompt_args)).value

    def stream_call(
        self, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> Generator[Model | FlexibleModel, None, None]:
        """Yield partial objects wave by wave, then the complete, validated ``output_cls``.

        The partials are ``FlexibleModel``s (LlamaIndex's partial form, every field optional): first
        the fields decided in the first wave, then each later wave's, then the object with its
        generated fields. `Engine.fill` returns once, after its last step, so the partials are
        yielded when the call is done, in the order the engine produced them, not while it runs.
        """
        yield from partial_objects(self._output_cls, self.extract(**prompt_args))

    async def astream_call(
        self, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> AsyncGenerator[Model | FlexibleModel, None]:
        """The async form of `stream_call`; awaited first, as `LLM.astream_structured_predict` does."""

        async def gen() -> AsyncGenerator[Model | FlexibleModel, None]:
            for item in partial_objects(self._output_cls, await self.aextract(**prompt_args)):
                yield item

        return gen()


def partial_objects(output_cls: type[Model], extraction: Extraction) -> list[Model | FlexibleModel]:
    """The object as it stood after each decided wave, then complete.

    Decided fields carry the wave that decided them; generated fields all come after the last
    decided wave. One wave and nothing generated gives the complete object alone.
    """
    decided_waves = sorted({r.wave for r in extraction.fields.values() if r.method != "generated"})
    partial_cls = create_flexible_model(output_cls)
    dumped = extraction.value.model_dump()
    partials: list[Model | FlexibleModel] = []
    for wave in decided_waves:
        names = [n for n, r in extraction.fields.items() if r.method != "generated" and r.wave <= wave]
        if len(names) < len(extraction.fields):
            partials.append(partial_cls(**{name: dumped[name] for name in names}))
    return [*partials, extraction.value]


class PCDLLM(FunctionCallingLLM, LazyEngine):
    """A LlamaIndex function-calling LLM on the PCD engine; see the module docstring for what is
    generated and what is decided.

    ``PCDLLM()`` / ``PCDLLM(model=..., backend=...)`` load the weights on first use;
    ``PCDLLM(engine=engine)`` (or ``PCDLLM(engine)``) shares a loaded engine. ``max_new_tokens`` caps
    a generated reply; a call's ``max_tokens=``/``stop=`` override it per call. ``system_prompt``
    is sent as a system message ahead of the chat, and as part of the input of structured calls.
    """

    max_new_tokens: int = Field(default=256, gt=0, description="The most tokens a generated reply may have.")

    def __init__(self, engine: Engine | None = None, /, **kwargs: Any) -> None:
        if engine is not None:
            kwargs["engine"] = engine
        super().__init__(**kwargs)

    @classmethod
    def from_model(cls, model: str | None = None, **load_kwargs: Any) -> PCDLLM:
        """Load an engine now (the embedded default without ``model``) and wrap it."""
        engine = Engine.load(load_options(model or None, **load_kwargs))
        return cls(engine=engine)

    @classmethod
    def class_name(cls) -> str:
        return "pcd_llm"

    @property
    def model_name(self) -> str:
        return self.model

    @property
    def metadata(self) -> LLMMetadata:
        # the context window is the model's own, read from the engine once it is loaded; before that
        # LlamaIndex's default stands in rather than loading weights to answer a property
        context = self.engine.context_length if self.engine is not None else LLMMetadata().context_window
        return LLMMetadata(
            context_window=context,
            num_output=self.max_new_tokens,
            is_chat_model=True,
            is_function_calling_model=True,
            model_name=self.model,
        )

    # -- plain generation ---------------------------------------------------------------------
    def _chat_messages(self, messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
        """LlamaIndex messages as the engine's role/content dicts (the chat template renders them)."""
        converted = [{"role": m.role.value, "content": _engine_content(m)} for m in messages]
        if self.system_prompt and not (converted and converted[0]["role"] == "system"):
            converted.insert(0, {"role": "system", "content": self.system_prompt})
        return converted

    def _completion_messages(self, prompt: str) -> list[dict[str, str]]:
        return self._chat_messages([ChatMessage(role=MessageRole.USER, content=prompt)])

    def _options(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        stop = kwargs.get("stop") or ()
        return {
            "max_new_tokens": int(kwargs.get("max_tokens") or kwargs.get("max_new_tokens") or self.max_new_tokens),
            "stop": [stop] if isinstance(stop, str) else list(stop),
        }

    def _generate(self, messages: list[dict[str, str]], kwargs: Mapping[str, Any]) -> Generation:
        return self.load_engine().generate(messages, **self._options(kwargs))

    def _stream(self, messages: list[dict[str, str]], kwargs: Mapping[str, Any]) -> Iterator[tuple[str, Generation]]:
        """(delta, generation so far) pairs; the last pair has an empty delta and the final counts."""
        generation = Generation()
        for delta in self.load_engine().stream(messages, **self._options(kwargs), result=generation):
            yield delta, generation
        yield "", generation

    def _chat_response(self, generation: Generation, delta: str | None = None, **extra: Any) -> ChatResponse:
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=generation.text),
            delta=delta,
            raw=_raw(generation),
            additional_kwargs={**_usage(generation.stats), **extra},
        )

    def _completion(self, generation: Generation, delta: str | None = None) -> CompletionResponse:
        return CompletionResponse(
            text=generation.text, delta=delta, raw=_raw(generation), additional_kwargs=_usage(generation.stats)
        )

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        if kwargs.get("tools") is not None:
            return self._tool_turn(messages, kwargs)
        return self._chat_response(self._generate(self._chat_messages(messages), kwargs))

    def _stream_chat(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> Generator[ChatResponse, None, None]:
        if kwargs.get("tools") is not None:
            decision = self._choose_tool(messages, kwargs)
            if decision.tool is not None:
                yield self._tool_call_response(messages, decision)
                return
            extra = {"pcd_tool_choice": decision.to_dict()}
        else:
            extra = {}
        for delta, generation in self._stream(self._chat_messages(messages), kwargs):
            yield self._chat_response(generation, delta, **extra)

    def _stream_complete(self, prompt: str, kwargs: dict[str, Any]) -> Generator[CompletionResponse, None, None]:
        for delta, generation in self._stream(self._completion_messages(prompt), kwargs):
            yield self._completion(generation, delta)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        await self.aload_engine()
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        await self.aload_engine()
        return iterate_in_thread(self._stream_chat(messages, kwargs))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._completion(self._generate(self._completion_messages(prompt), kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        await self.aload_engine()
        generation = await asyncio.to_thread(self._generate, self._completion_messages(prompt), kwargs)
        return self._completion(generation)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return self._stream_complete(prompt, kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        await self.aload_engine()
        return iterate_in_thread(self._stream_complete(prompt, kwargs))

    # -- tool calls ---------------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """The chat call's arguments: the messages, and the tools for `_tool_turn` to choose from.

        One tool call per turn: the choice is one PCD choice, so ``allow_parallel_tool_calls`` has
        no second pick to allow.
        """
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg))
        elif user_msg is not None:
            messages.append(user_msg)
        return {
            "messages": messages,
            "tools": list(tools),
            "tool_required": tool_required,
            "tool_choice": tool_choice,
            **kwargs,
        }

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls") or []
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected a tool call, got a reply: {response.message.content!r}")
        return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"]) for c in calls]

    def _choose_tool(self, messages: Sequence[ChatMessage], kwargs: Mapping[str, Any]) -> ToolDecision:
        """Which tool to call, or none: the core tool choice (``pcd_core/tools.py``).

        ``tool_choice`` takes every LlamaIndex and OpenAI form; ``tool_required=True`` means
        ``"required"`` (no "answer directly" option) when the call names no tool. Without tools the
        reply is written.
        """
        specs = [_tool_spec(tool) for tool in kwargs["tools"]]
        choice = kwargs.get("tool_choice")
        if kwargs.get("tool_required") and choice in (None, "auto"):
            choice = "required"
        if not specs:
            choice = ToolChoice("none")
        normalised = normalise_tool_choice(choice, [spec.name for spec in specs])
        return choose_tool(
            self.load_engine(), messages_to_text(messages), specs, normalised, _called_this_turn(messages)
        )

    def _tool_call_response(self, messages: Sequence[ChatMessage], decision: ToolDecision) -> ChatResponse:
        """The assistant turn that calls the chosen tool, its arguments filled by the engine."""
        tool = decision.tool
        assert tool is not None  # only a chosen tool is called
        extraction = tool_arguments(self.load_engine(), messages_to_text(messages), tool)
        arguments = dict(extraction.value) if extraction is not None else {}
        fields = {key: r.to_dict() for key, r in extraction.fields.items()} if extraction is not None else {}
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "name": tool.name, "arguments": arguments}
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content="", additional_kwargs={"tool_calls": [call]}),
            raw={"tool_calls": [call]},
            additional_kwargs={"pcd_tool_choice": decision.to_dict(), "pcd_arguments": fields},
        )

    def _tool_turn(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        decision = self._choose_tool(messages, kwargs)
        if decision.tool is not None:
            return self._tool_call_response(messages, decision)
        generation = self._generate(self._chat_messages(messages), kwargs)
        return self._chat_response(generation, pcd_tool_choice=decision.to_dict())

    # -- structured calls ---------------------------------------------------------------------
    # The same span and events as `LLM`'s own structured calls, so LlamaIndex observers see PCD
    # calls like any other structured prediction.

    def _program(self, output_cls: type[Model], prompt: BasePromptTemplate) -> PCDProgram[Model]:
        return PCDProgram(output_cls, prompt, self, system_prompt=self.system_prompt)

    def _started(self, output_cls: type[Model], prompt: PromptTemplate, prompt_args: dict[str, Any]) -> PCDProgram:
        """The program for one call, after announcing the call to LlamaIndex's observers."""
        program = self._program(output_cls, prompt)
        dispatcher.event(
            LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
        )
        return program

    @dispatcher.span
    def structured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        program = self._started(output_cls, prompt, prompt_args)
        result = program(**prompt_args)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    async def astructured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Model:
        program = self._started(output_cls, prompt, prompt_args)
        result = await program.acall(**prompt_args)
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    def stream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Generator[Model | FlexibleModel, None, None]:
        """Yield partial objects wave by wave, the last complete (see `PCDProgram.stream_call`)."""
        program = self._started(output_cls, prompt, prompt_args)
        result: Any = None
        for result in program.stream_call(**prompt_args):
            dispatcher.event(LLMStructuredPredictInProgressEvent(output=result))
            yield result
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))

    @dispatcher.span
    async def astream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> AsyncGenerator[Model | FlexibleModel, None]:
        """The async form of `stream_structured_predict`; awaited first, as in `LLM`."""
        program = self._program(output_cls, prompt)

        async def gen() -> AsyncGenerator[Model | FlexibleModel, None]:
            dispatcher.event(
                LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
            )
            result: Any = None
            async for result in await program.astream_call(**prompt_args):
                dispatcher.event(LLMStructuredPredictInProgressEvent(output=result))
                yield result
            dispatcher.event(LLMStructuredPredictEndEvent(output=result))

        return gen()
