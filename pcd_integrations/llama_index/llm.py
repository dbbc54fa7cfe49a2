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
prove it on the embedded model. `PCDProgram` lives in `pcd_integrations/llama_index/program.py`,
`PCDSelector`, the router slot, in `pcd_integrations/llama_index/selector.py`, and the package
(`pcd_integrations/llama_index/__init__.py`) re-exports both; prompts and messages become the engine's
input in `pcd_integrations/llama_index/text.py`. ``PCDLLM`` keeps its sync, async and stream forms of chat,
completion, tools and structured prediction side by side, so that they stay alike.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pcd_core import BackendUnavailableError
from pcd_core.concurrency.model_lock import in_thread

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
    )
    from llama_index.core.bridge.pydantic import Field
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.events.llm import (
        LLMStructuredPredictEndEvent,
        LLMStructuredPredictInProgressEvent,
        LLMStructuredPredictStartEvent,
    )
    from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
    from llama_index.core.llms.function_calling import FunctionCallingLLM
    from llama_index.core.llms.llm import ToolSelection
    from llama_index.core.program.utils import FlexibleModel
    from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
    from llama_index.core.types import Model
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("llama-index", "llama-index-core") from error

from pcd_core import (
    NO_TOOL,
    Engine,
    Generation,
    Stats,
    ToolChoice,
    ToolDecision,
    ToolSpec,
    choose_tool,
    normalise_tool_choice,
    tool_arguments,
)
from pcd_core.loading.options import load_options
from pcd_integrations.llama_index.program import PCDProgram
from pcd_integrations.llama_index.text import engine_content, messages_to_text
from pcd_integrations.serving.lazy_engine import LazyEngine
from pcd_integrations.serving.threads import iterate_in_thread

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

__all__ = ["ANSWER_DIRECTLY", "PCDLLM"]

dispatcher = get_dispatcher(__name__)

ANSWER_DIRECTLY = NO_TOOL
"""The option of the tool choice that means "no tool: write the reply"."""


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
        converted = [{"role": m.role.value, "content": engine_content(m)} for m in messages]
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
        return await in_thread(self._chat, messages, kwargs)

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
        generation = await in_thread(self._generate, self._completion_messages(prompt), kwargs)
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
