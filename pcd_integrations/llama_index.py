"""LlamaIndex on the PCD engine: a pydantic program and an LLM whose structured calls are engine calls.

`PCDProgram` is a `BasePydanticProgram`: it formats its prompt into the input text and asks
`Engine.fill` for the whole object, so every field is one of its allowed values by construction and
its per-field decisions stay reachable (`extract`, `last_decisions`). `PCDLLM` is a `CustomLLM` whose
`structured_predict` family runs the same program, so `llm.as_structured_llm(Schema)` works too.

PCD reads the model's distribution over closed values; it never samples text. So `PCDLLM.complete`,
`stream_complete` and the chat calls built on them raise `PlainCompletionError` (a
`FreeTextNotSupportedError`, so a `PcdError` and a `NotImplementedError`) that points to the structured
calls, as the LangChain chat model does, rather than return text the engine did not decide. For the same reason sampling options (`llm_kwargs`) have
nothing to act on and are ignored.

This module is a translation layer only: it turns LlamaIndex prompts into input text and `Extraction`
results into LlamaIndex outputs; prompts for the model, tokens and backends stay in `pcd_core`.
`tests/test_llama_index.py` proves it on the embedded model. `PCDSelector`, the router slot, lives in
`pcd_integrations/llama_index_selector.py` and is re-exported here.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Mapping
from typing import Any

from pcd_core import BackendUnavailableError

try:
    from llama_index.core.base.llms.types import (
        ChatMessage,
        CompletionResponse,
        CompletionResponseGen,
        LLMMetadata,
        MessageRole,
        TextBlock,
    )
    from llama_index.core.bridge.pydantic import BaseModel, Field, PrivateAttr
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.events.llm import (
        LLMStructuredPredictEndEvent,
        LLMStructuredPredictInProgressEvent,
        LLMStructuredPredictStartEvent,
    )
    from llama_index.core.llms import CustomLLM
    from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
    from llama_index.core.types import BasePydanticProgram, Model
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("llama-index", "llama-index-core") from error

from pcd_core import (
    Engine,
    Extraction,
    FieldResult,
    FreeTextNotSupportedError,
    PromptError,
    SchemaError,
    parse_schema,
)

from .llama_index_selector import PCDSelector

__all__ = ["PCDLLM", "PCDProgram", "PCDSelector", "PlainCompletionError", "prompt_to_text"]

dispatcher = get_dispatcher(__name__)


class PlainCompletionError(FreeTextNotSupportedError):
    """A completion or chat call without a schema: PCD decides closed fields, it writes no text."""

    def __init__(self) -> None:
        super().__init__(
            "PCDLLM decides closed fields and does not write free text. Ask for a schema whose fields "
            "are booleans or enums: llm.structured_predict(Schema, prompt, **args), "
            "llm.as_structured_llm(Schema), or PCDProgram.from_defaults(output_cls=Schema, ...)."
        )


def prompt_to_text(prompt: BasePromptTemplate, prompt_args: Mapping[str, Any], system_prompt: str | None = None) -> str:
    """Format a LlamaIndex prompt into the input text the engine reads.

    The engine writes its own instructions and value catalog around this text, so the prompt is the
    input, not the model's whole prompt. One message is passed as it is; several keep their roles as
    ``role: text`` paragraphs, so that a system instruction is still told apart from the document.
    Images and other non-text blocks raise `PromptError`: dropping them would decide on less than
    the caller sent.
    """
    messages = prompt.format_messages(**prompt_args)
    if system_prompt:
        messages = [ChatMessage(role=MessageRole.SYSTEM, content=system_prompt), *messages]
    for message in messages:
        for block in message.blocks:
            if not isinstance(block, TextBlock):
                raise PromptError(
                    f"a {message.role.value} message holds a {type(block).__name__}; the PCD engine "
                    "reads text only, so pass the text (for example a document's .text) instead"
                )
    texts = [(message.role, message.content) for message in messages if message.content]
    if len(texts) == 1:
        return texts[0][1]
    return "\n\n".join(f"{role.value}: {content}" for role, content in texts)


def _checked_output_cls(output_cls: Any) -> type[BaseModel]:
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

    ``program(**prompt_args)`` returns an ``output_cls`` instance; ``acall`` awaits
    `Engine.afill`, which runs in a worker thread, so an event loop (a Workflow step) keeps running.
    The decisions behind an answer come from ``extract``/``aextract``, which return the whole
    `Extraction` (per-field probability, candidate mass, confidence, stats, warnings); after a plain
    call ``last_decisions`` holds the same per-field results. That attribute is per program, so
    concurrent callers should use ``aextract`` instead. ``system_prompt``, if given, is sent as a
    system message ahead of the prompt (see `prompt_to_text`).
    """

    def __init__(
        self,
        output_cls: type[Model],
        prompt: BasePromptTemplate,
        engine: Engine,
        system_prompt: str | None = None,
    ) -> None:
        self._output_cls = _checked_output_cls(output_cls)
        self._prompt = prompt
        self._engine = engine
        self._system_prompt = system_prompt
        self._last_extraction: Extraction | None = None

    @classmethod
    def from_defaults(
        cls,
        output_cls: type[Model],
        prompt_template_str: str | None = None,
        prompt: BasePromptTemplate | None = None,
        engine: Engine | None = None,
        model: str | None = None,
        **load_kwargs: Any,
    ) -> PCDProgram[Model]:
        """Build a program from a template string or prompt, and an engine or a model to load.

        With neither ``engine`` nor ``model`` the embedded default model is loaded;
        ``load_kwargs`` (``backend``, ``device``, ...) go to `Engine.load`.
        """
        if (prompt is None) == (prompt_template_str is None):
            raise ValueError("pass exactly one of prompt= or prompt_template_str=")
        if engine is not None and (model is not None or load_kwargs):
            raise ValueError(
                f"pass either engine= or model=/load options, not both (model={model!r}, "
                f"options={sorted(load_kwargs)!r})"
            )
        checked_cls = _checked_output_cls(output_cls)
        if engine is None:
            engine = Engine.load(model, **load_kwargs) if model else Engine.load(**load_kwargs)
        return cls(checked_cls, prompt or PromptTemplate(prompt_template_str), engine)

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
        return self._engine

    @property
    def last_extraction(self) -> Extraction | None:
        """The full result of the latest call, or None before the first one."""
        return self._last_extraction

    @property
    def last_decisions(self) -> Mapping[str, FieldResult]:
        """Per-field decisions of the latest call in schema order; empty before the first call."""
        return {} if self._last_extraction is None else self._last_extraction.fields

    def extract(self, **prompt_args: Any) -> Extraction:
        """Fill the object and return every decision behind it, not just the value."""
        text = prompt_to_text(self._prompt, prompt_args, self._system_prompt)
        extraction = self._engine.fill(self._output_cls, text)
        self._last_extraction = extraction
        return extraction

    async def aextract(self, **prompt_args: Any) -> Extraction:
        """`extract` without blocking the event loop."""
        text = prompt_to_text(self._prompt, prompt_args, self._system_prompt)
        extraction = await self._engine.afill(self._output_cls, text)
        self._last_extraction = extraction
        return extraction

    def __call__(self, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Model:
        """Return the filled ``output_cls``; ``llm_kwargs`` is accepted for LlamaIndex and ignored."""
        return self.extract(**prompt_args).value

    async def acall(self, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Model:
        return (await self.aextract(**prompt_args)).value

    def stream_call(self, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any) -> Generator[Model, None, None]:
        """Yield the object once, complete.

        The engine decides a whole wave of fields in one batched pass and returns when the last wave
        is done, so there is no partial text to stream; the one item is already schema-valid.
        """
        yield self(**prompt_args)

    async def astream_call(
        self, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> AsyncGenerator[Model, None]:
        """The async form of `stream_call`; awaited first, as `LLM.astream_structured_predict` does."""

        async def gen() -> AsyncGenerator[Model, None]:
            yield await self.acall(**prompt_args)

        return gen()


class PCDLLM(CustomLLM):
    """A LlamaIndex LLM for structured calls only, backed by a shared `Engine`.

    ``structured_predict``, ``astructured_predict``, ``stream_structured_predict`` and
    ``astream_structured_predict`` run a `PCDProgram`, so ``as_structured_llm(Schema)`` returns
    engine-filled objects; ``system_prompt`` is passed to the engine as part of the input text.
    ``complete`` and ``stream_complete`` (and the chat calls made from them) raise
    `PlainCompletionError`: see the module docstring.
    """

    model_name: str = Field(description="The engine's model, as Engine.model_name reports it.")
    _engine: Engine = PrivateAttr()

    def __init__(self, engine: Engine, **kwargs: Any) -> None:
        super().__init__(model_name=engine.model_name, **kwargs)
        self._engine = engine

    @classmethod
    def from_model(cls, model: str | None = None, **load_kwargs: Any) -> PCDLLM:
        """Load an engine (the embedded default without ``model``) and wrap it."""
        engine = Engine.load(model, **load_kwargs) if model else Engine.load(**load_kwargs)
        return cls(engine)

    @classmethod
    def class_name(cls) -> str:
        return "pcd_llm"

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        # num_output is 0 because nothing is generated: the answers are values read in place, so
        # LlamaIndex's prompt helpers may give the whole context window to the input.
        return LLMMetadata(
            context_window=self._engine.context_length,
            num_output=0,
            is_chat_model=False,
            is_function_calling_model=False,
            model_name=self._engine.model_name,
        )

    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        raise PlainCompletionError()

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        raise PlainCompletionError()

    def _program(self, output_cls: type[Model], prompt: BasePromptTemplate) -> PCDProgram[Model]:
        return PCDProgram(output_cls, prompt, self._engine, system_prompt=self.system_prompt)

    # The four structured calls below emit the same instrumentation events as `LLM`'s own, so
    # LlamaIndex observers see PCD calls like any other structured prediction.

    def _started(self, output_cls: type[Model], prompt: PromptTemplate, prompt_args: dict[str, Any]) -> PCDProgram:
        """The program for one call, after announcing the call to LlamaIndex's observers."""
        program = self._program(output_cls, prompt)
        dispatcher.event(
            LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
        )
        return program

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

    def stream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> Generator[Model, None, None]:
        """Yield the complete object once (see `PCDProgram.stream_call`)."""
        program = self._started(output_cls, prompt, prompt_args)
        for result in program.stream_call(**prompt_args):
            dispatcher.event(LLMStructuredPredictInProgressEvent(output=result))
            yield result
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))

    async def astream_structured_predict(
        self,
        output_cls: type[Model],
        prompt: PromptTemplate,
        llm_kwargs: dict[str, Any] | None = None,
        **prompt_args: Any,
    ) -> AsyncGenerator[Model, None]:
        """The async form of `stream_structured_predict`; awaited first, as in `LLM`."""
        program = self._program(output_cls, prompt)

        async def gen() -> AsyncGenerator[Model, None]:
            dispatcher.event(
                LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args)
            )
            async for result in await program.astream_call(**prompt_args):
                dispatcher.event(LLMStructuredPredictInProgressEvent(output=result))
                yield result
            dispatcher.event(LLMStructuredPredictEndEvent(output=result))

        return gen()
