"""LangChain adapter: a chat model whose structured output is decided, and the decision-model slot.

``ChatPCD`` keeps a LangChain user's code unchanged (``prompt | llm.with_structured_output(Ticket)``):
the rendered messages become the engine's input text and ``engine.fill`` decides every field among its
allowed values, so the parsed object always matches the schema. ``PCDDecisionModel`` (defined in
``pcd_integrations/langchain_decisions.py``, re-exported here) is LangChain's ``BaseDecisionModel`` on
``engine.decide``. Neither builds prompts or touches token ids.

Invariant: nothing here pretends to write text. A call without a schema raises ``PlainChatError``.
Proof: ``tests/test_langchain.py`` on the embedded model, and LangChain's standard suites in
``tests/test_langchain_standard.py``, whose xfail list is the public list of gaps.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal, get_args

from pcd_core import BackendUnavailableError, Engine, Extraction, FreeTextNotSupportedError, PromptError

try:
    from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
    from langchain_core.language_models import BaseChatModel, LanguageModelInput
    from langchain_core.language_models.base import LangSmithParams
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, get_buffer_string
    from langchain_core.messages.ai import UsageMetadata
    from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("langchain", "langchain-core") from error

from .langchain_decisions import PCDDecisionModel
from .lazy_engine import LazyEngine

__all__ = ["ChatPCD", "PCDDecisionModel", "PlainChatError"]

# Every value LangChain passes as ``method``; for PCD they all mean "decide each field among its
# allowed values", which is stricter than any of them.
StructuredOutputMethod = Literal["json_schema", "function_calling", "json_mode"]
_METHODS = get_args(StructuredOutputMethod)


class PlainChatError(FreeTextNotSupportedError):
    """A chat call without a schema: PCD decides closed fields and does not write free text."""

    def __init__(self) -> None:
        super().__init__(
            "ChatPCD decides closed fields and does not write free text. Call "
            "llm.with_structured_output(Schema) with a pydantic class, TypedDict or JSON Schema whose "
            "fields are booleans or enums, or use PCDDecisionModel for yes/no, choice and score questions."
        )


def render_messages(messages: Sequence[BaseMessage]) -> str:
    """The engine's input text. A lone message is the input itself; a conversation keeps its roles
    ("Human: ...", "AI: ...") so that decisions can tell who said what.
    """
    for index, message in enumerate(messages):
        if isinstance(message.content, list):
            for block in message.content:
                if isinstance(block, Mapping) and block.get("type") != "text":
                    raise PromptError(
                        f"message {index} holds a {block.get('type')!r} block; ChatPCD reads text "
                        "only, so pass the text (for example a transcript or a caption) instead"
                    )
    if len(messages) == 1:
        return messages[0].text
    return get_buffer_string(messages)


def decision_metadata(extraction: Extraction) -> dict[str, dict[str, Any]]:
    """Per-field decisions, JSON-able, so that a chain can gate on confidence without parsing text."""
    return {
        name: {
            "value": field.value,
            "probability": field.probability,
            "probabilities": dict(field.probabilities),
            "candidate_mass": field.candidate_mass,
            "confidence": field.confidence,
        }
        for name, field in extraction.fields.items()
    }


class ChatPCD(LazyEngine, BaseChatModel):
    """A LangChain chat model whose only output is a decided, schema-valid object.

    ``llm.with_structured_output(Schema)`` takes a pydantic class (returns an instance), a TypedDict or
    a JSON Schema (returns a dict) whose fields are closed: booleans, enums, literals. A free-text or
    unbounded field raises ``pcd_core.SchemaError`` naming the field when the chain runs. Every
    ``method`` and ``strict`` value LangChain passes is accepted; output is always schema-valid.

    Plain chat (``invoke``/``stream`` without a schema) raises ``PlainChatError``: the engine reads the
    model's distribution over allowed values and never samples text. For the same reason sampling
    parameters other chat models take (``temperature``, ``max_tokens``, ``stop``) are ignored.

    Weights load on first use; pass ``engine=`` to share a loaded ``pcd_core.Engine``. The raw message
    carries the decisions in ``response_metadata["pcd"]`` (value, probability, probabilities,
    candidate mass and confidence per field) and the engine's soft warnings in
    ``response_metadata["pcd_warnings"]``. ``usage_metadata`` has ``output_tokens=0``: nothing is
    generated.
    """

    @property
    def _llm_type(self) -> str:
        return "pcd"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "backend": self.backend}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="pcd",
            ls_model_name=kwargs.get("model") or self.model,
            ls_model_type="chat",
        )
        if stop:
            params["ls_stop"] = stop
        return params

    def with_structured_output(
        self,
        schema: dict[str, Any] | type,
        *,
        method: StructuredOutputMethod | None = None,
        strict: bool | None = None,
        include_raw: bool = False,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | Any]:
        """Decide ``schema`` from the rendered messages; see the class docstring for what it accepts.

        ``method`` and ``strict`` are accepted for compatibility and change nothing: every method is
        served by the same decisions, which are always strict. ``include_raw=True`` returns
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
        if isinstance(schema, type) and hasattr(schema, "model_validate"):
            parser = PydanticOutputParser(pydantic_object=schema)
        else:
            parser = JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")

    def _schema_for_call(self, kwargs: dict[str, Any]) -> Any:
        requested = kwargs.get("model")
        if requested is not None and requested != self.model:
            raise ValueError(
                f"ChatPCD does not switch models per call (asked for {requested!r}, "
                f"loaded {self.model!r}); create ChatPCD(model={requested!r}) instead"
            )
        schema = kwargs.get("response_schema")
        if schema is None:
            raise PlainChatError()
        return schema

    def _message(self, extraction: Extraction, engine: Engine) -> AIMessageChunk:
        # The JSON of the decided labels; the parsers rebuild the caller's type from it.
        content = json.dumps(extraction.values, ensure_ascii=False)
        stats = extraction.stats
        input_tokens = stats.input_tokens
        return AIMessageChunk(
            content=content,
            response_metadata={
                "model_name": engine.model_name,
                "forward_passes": stats.forward_passes,
                "pcd": decision_metadata(extraction),
                "pcd_warnings": list(extraction.warnings),
            },
            usage_metadata=UsageMetadata(
                input_tokens=input_tokens,
                output_tokens=0,
                total_tokens=input_tokens,
                input_token_details={"cache_read": stats.cached_tokens},
            ),
            chunk_position="last",
        )

    def _fill(self, messages: list[BaseMessage], kwargs: dict[str, Any]) -> AIMessageChunk:
        schema = self._schema_for_call(kwargs)
        engine = self.load_engine()
        return self._message(engine.fill(schema, render_messages(messages)), engine)

    async def _afill(self, messages: list[BaseMessage], kwargs: dict[str, Any]) -> AIMessageChunk:
        schema = self._schema_for_call(kwargs)
        engine = await self.aload_engine()
        return self._message(await engine.afill(schema, render_messages(messages)), engine)

    @staticmethod
    def _result(chunk: AIMessageChunk) -> ChatResult:
        message = AIMessage(
            content=chunk.content,
            response_metadata=chunk.response_metadata,
            usage_metadata=chunk.usage_metadata,
        )
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._result(self._fill(messages, kwargs))

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._result(await self._afill(messages, kwargs))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # All fields are decided together, so the object arrives as one final chunk.
        chunk = ChatGenerationChunk(message=self._fill(messages, kwargs))
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
        chunk = ChatGenerationChunk(message=await self._afill(messages, kwargs))
        if run_manager is not None:
            await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
        yield chunk
