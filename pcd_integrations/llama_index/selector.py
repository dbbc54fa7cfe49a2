"""LlamaIndex's selector slot on the PCD engine: ``PCDSelector(BaseSelector)``.

``RouterQueryEngine`` and ``RouterRetriever`` ask a selector which of their tools (``ToolMetadata``:
a name and a description) should answer a query. LlamaIndex's own selectors have an LLM write the
answer as text and parse it; ``PCDSelector`` reads it as a decision instead, so the pick is always one
of the candidates and comes with its probability:

- single selection: one PCD choice whose options are the candidates (named by their tool names,
  described by their descriptions), over the query as the state;
- multi selection: one noul per candidate ("is this option relevant to the query?"), all in the same
  engine call, so they share one reading of the query and one packed pass. Every candidate at
  P(yes) >= 0.5 is selected, most probable first, at most ``max_outputs``; when none reaches 0.5 the
  most probable one is selected alone, since a router needs one to run.

Each selection's ``reason`` carries the probabilities. ``tests/test_llama_index_selector.py`` checks
them against ``engine.decide`` and routes a real ``RouterQueryEngine`` with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pcd_core import BackendUnavailableError, ChoiceAnswer, DecideResponse, Engine, NoulAnswer, PromptError
from pcd_core.loading.options import load_options

try:
    from llama_index.core.base.base_selector import BaseSelector, SelectorResult, SingleSelection
    from llama_index.core.prompts.mixin import PromptDictType
    from llama_index.core.schema import QueryBundle
    from llama_index.core.tools.types import ToolMetadata
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise BackendUnavailableError("llama-index", "llama-index-core") from error

__all__ = ["MULTI_INSTRUCTIONS", "SINGLE_INSTRUCTIONS", "PCDSelector"]

SINGLE_INSTRUCTIONS = "The state is a query. Which option is best suited to answer it?"
MULTI_INSTRUCTIONS = "The state is a query. Is the option {name!r} ({description}) relevant to answering it?"
_SELECTED = 0.5


def option_names(choices: Sequence[ToolMetadata]) -> list[str]:
    """The tool names when every candidate has its own, else ``option 1``, ``option 2``, ..."""
    names = [(choice.name or "").strip() for choice in choices]
    if all(names) and len(set(names)) == len(names):
        return names
    return [f"option {index + 1}" for index in range(len(choices))]


def _one_line(text: str) -> str:
    # an option is one line of the question's row: a multi-line description would end it early
    return " ".join(text.split())


class PCDSelector(BaseSelector):
    """A selector whose pick is a PCD decision; see the module docstring for single and multi.

    Build it with ``PCDSelector.from_defaults(engine=engine)`` or ``from_defaults(llm=PCDLLM(engine))``;
    ``multi=True`` or ``max_outputs=N`` asks the multi-selection form, whose ``instructions`` are a
    template with ``{name}`` and ``{description}`` (``MULTI_INSTRUCTIONS``). ``questions(choices)`` returns
    the questions a call asks, for inspection and for ``engine.decide`` directly.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        multi: bool = False,
        max_outputs: int | None = None,
        instructions: str | None = None,
    ) -> None:
        if max_outputs is not None and max_outputs < 1:
            raise ValueError(f"max_outputs={max_outputs!r}; a selector returns at least one choice")
        self._engine = engine
        self._multi = multi or max_outputs is not None
        self._max_outputs = max_outputs
        self._instructions = instructions or (MULTI_INSTRUCTIONS if self._multi else SINGLE_INSTRUCTIONS)
        if self._multi and "{name" not in self._instructions and "{description" not in self._instructions:
            # without the option in it, every candidate's noul would be the same question
            raise ValueError(
                f"multi-selection instructions are a template with {{name}} and/or {{description}}; "
                f"got {self._instructions!r}"
            )

    @classmethod
    def from_defaults(
        cls,
        engine: Engine | None = None,
        llm: Any = None,
        *,
        multi: bool = False,
        max_outputs: int | None = None,
        instructions: str | None = None,
        model: str | None = None,
        **load_kwargs: Any,
    ) -> PCDSelector:
        """A selector on ``engine``, on ``llm``'s engine (a ``PCDLLM``), or on ``model`` loaded now.

        With none of them the embedded default model is loaded; ``load_kwargs`` go to `Engine.load`.
        """
        if llm is not None:
            if engine is not None or not isinstance(getattr(llm, "engine", None), Engine):
                raise ValueError(f"llm= takes a PCDLLM (and no engine=); got {type(llm).__name__}")
            engine = llm.engine
        if engine is None:
            engine = Engine.load(load_options(model or None, **load_kwargs))
        return cls(engine, multi=multi, max_outputs=max_outputs, instructions=instructions)

    @property
    def engine(self) -> Engine:
        return self._engine

    def _get_prompts(self) -> dict[str, Any]:
        # no LlamaIndex prompt template: the engine writes its own instructions around the questions
        return {}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        pass

    def questions(self, choices: Sequence[ToolMetadata]) -> dict[str, dict[str, Any]]:
        """The PCD questions for ``choices``: one choice, or one noul per candidate keyed by its name."""
        names = option_names(choices)
        descriptions = [_one_line(choice.description) for choice in choices]
        if not self._multi:
            return {
                "selection": {
                    "type": "choice",
                    "instructions": self._instructions,
                    "criteria": dict(zip(names, descriptions)),
                }
            }
        return {
            name: {"type": "noul", "instructions": self._instructions.format(name=name, description=description)}
            for name, description in zip(names, descriptions)
        }

    def _request(self, choices: Sequence[ToolMetadata], query: QueryBundle) -> tuple[str, dict[str, Any]]:
        if not choices:
            raise ValueError("PCDSelector needs at least one choice")
        if query.image_path:
            raise PromptError(f"the query has an image ({query.image_path!r}); PCDSelector reads text only")
        return query.query_str, self.questions(choices)

    def _result(self, choices: Sequence[ToolMetadata], response: DecideResponse) -> SelectorResult:
        names = option_names(choices)
        if not self._multi:
            [answer] = [a for a in response.answers.values() if isinstance(a, ChoiceAnswer)]
            distribution = ", ".join(f"{name} {p:.4f}" for name, p in answer.probabilities.items())
            reason = f"PCD choice {answer.choice!r}; probabilities: {distribution}"
            return SelectorResult(selections=[SingleSelection(index=names.index(answer.choice), reason=reason)])
        nouls = {name: answer.noul for name, answer in response.answers.items() if isinstance(answer, NoulAnswer)}
        ranked = sorted(range(len(names)), key=lambda index: -nouls[names[index]])
        picked = [index for index in ranked if nouls[names[index]] >= _SELECTED][: self._max_outputs] or ranked[:1]
        selections = [
            SingleSelection(index=index, reason=f"PCD noul for {names[index]!r}: P(relevant) {nouls[names[index]]:.4f}")
            for index in picked
        ]
        return SelectorResult(selections=selections)

    def _select(self, choices: Sequence[ToolMetadata], query: QueryBundle) -> SelectorResult:
        if len(choices) == 1:
            return SelectorResult(selections=[SingleSelection(index=0, reason="the only candidate")])
        return self._result(choices, self._engine.decide(*self._request(choices, query)))

    async def _aselect(self, choices: Sequence[ToolMetadata], query: QueryBundle) -> SelectorResult:
        if len(choices) == 1:
            return SelectorResult(selections=[SingleSelection(index=0, reason="the only candidate")])
        return self._result(choices, await self._engine.adecide(*self._request(choices, query)))
