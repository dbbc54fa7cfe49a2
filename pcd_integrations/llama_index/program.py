"""LlamaIndex's pydantic-program slot on the PCD engine: ``PCDProgram``, one `Engine.fill` per call.

The program formats its prompt into the engine's input text (``text.py``), fills
``output_cls`` and returns it; ``extract`` returns the whole `Extraction` with every field's
probability. Its stream forms yield the object wave by wave (``partial_objects``). ``PCDLLM``
(``llm.py``) runs one for ``structured_predict``, and ``pcd_integrations.llama_index``
re-exports it, the name users import. ``tests/test_llama_index.py`` and
``tests/test_llama_index_llm.py`` prove it on the embedded model.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Generator, Mapping
from typing import Any

from pcd_core import BackendUnavailableError

try:
    from llama_index.core.bridge.pydantic import BaseModel
    from llama_index.core.llms.llm import LLM
    from llama_index.core.program.utils import FlexibleModel, create_flexible_model
    from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
    from llama_index.core.types import BasePydanticProgram, Model
except ImportError as error:  # pragma: no cover - exercised by a subprocess test without the extra
    raise BackendUnavailableError("llama-index", "llama-index-core") from error

from pcd_core import Engine, Extraction, SchemaError, parse_schema
from pcd_core.loading.options import load_options
from pcd_integrations.llama_index.text import prompt_to_text
from pcd_integrations.serving.lazy_engine import LazyEngine

__all__ = ["PCDProgram", "partial_objects"]


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
        # a PCDLLM is both a LlamaIndex LLM and a LazyEngine; naming the class would import its module
        if llm is not None and not (isinstance(llm, LLM) and isinstance(llm, LazyEngine)):
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
