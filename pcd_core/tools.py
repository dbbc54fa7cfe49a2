"""The PCD tool choice: which tool to call next is a decision, its arguments a fill.

Every transport that offers tool calling (LangChain's ``bind_tools``, LlamaIndex's
``FunctionCallingLLM``, the OpenAI-compatible ``POST /v1/chat/completions``) turns its own tool and
``tool_choice`` forms into `ToolSpec` and `ToolChoice`, renders its conversation to text, and calls
`choose_tool` then `tool_arguments`; nothing here knows a framework. The rules they all share:

- which tool is one ``choice`` question (``engine.decide``) over the tool names, each described by
  its description, plus `NO_TOOL` ("answer directly") unless a tool is required;
- under ``auto``, a tool already called since the latest user message is not offered again: a small
  model keeps choosing tools, and this is what lets an agent loop end (each tool runs at most once
  per user turn, then the reply is written);
- with one option left there is nothing to decide: it is taken, marked ``forced``, at no model cost;
- the arguments are ``engine.fill`` of the tool's parameter schema: closed fields decided, open ones
  generated under their grammar, so they always match the schema. A tool without parameters is
  called with none, without a model call.

One tool call per turn: a choice picks one option. ``tests/test_tools.py`` checks the rules on the
embedded model; the adapters' tests and ``tests/test_chat_completions.py`` check them end to end.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pcd_core.cost import Stats
from pcd_core.errors import RequestError
from pcd_core.request.questions import ChoiceAnswer
from pcd_core.result import Extraction

if TYPE_CHECKING:
    from pcd_core.engine import Engine

#: The option that means "call no tool, answer the user directly".
NO_TOOL = "answer_directly"
_NO_TOOL_DESCRIPTION = "reply to the user in words, without calling a tool"
TOOL_QUESTION = (
    "Which tool should the assistant call next to serve the user's last request? "
    f"Choose {NO_TOOL} when no tool is needed or the tool results already answer it."
)

Mode = Literal["auto", "required", "none", "named"]


class ToolChoiceError(RequestError):
    """A ``tool_choice`` or a tool list that cannot be honoured: an unknown name, a reserved name."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the engine sees it: a name to choose, a description to choose by, a schema to fill.

    The description is kept on one line (frameworks put a signature on a line of its own), so that
    the option reads as one criterion.
    """

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ToolChoiceError("a tool needs a non-empty name")
        if self.name == NO_TOOL:
            raise ToolChoiceError(f"a tool may not be named {NO_TOOL!r}: that option means 'call no tool'")
        if self.description is not None:
            object.__setattr__(self, "description", " ".join(self.description.split()) or None)


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice`` in one form: ``auto``, ``required`` (any tool, but one), ``none``, or a named tool."""

    mode: Mode = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if (self.mode == "named") != (self.name is not None):
            raise ToolChoiceError("a named tool_choice needs a name, and only a named one has one")


def normalise_tool_choice(tool_choice: Any, names: Collection[str]) -> ToolChoice:
    """Every form LangChain, LlamaIndex and OpenAI use: None/``"auto"``, ``"any"``/``"required"``/True,
    ``"none"``, a tool name, ``{"type": "function", "function": {"name": ...}}`` or ``{"name": ...}``.
    """
    if isinstance(tool_choice, ToolChoice):
        chosen = tool_choice
    elif tool_choice is None or tool_choice == "auto":
        chosen = ToolChoice("auto")
    elif tool_choice is True or tool_choice in ("any", "required"):
        chosen = ToolChoice("required")
    elif tool_choice == "none":
        chosen = ToolChoice("none")
    elif isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        if not isinstance(name, str) or not name:
            raise ToolChoiceError(f"tool_choice={dict(tool_choice)!r} names no tool")
        chosen = ToolChoice("named", name)
    elif isinstance(tool_choice, str):
        chosen = ToolChoice("named", tool_choice)
    else:
        raise ToolChoiceError(f"tool_choice={tool_choice!r} is not 'auto', 'required', 'none' or a tool name")
    if chosen.name is not None and chosen.name not in names:
        raise ToolChoiceError(
            f"tool_choice={chosen.name!r} is not 'auto', 'any', 'required', 'none' or one of {sorted(names)}"
        )
    return chosen


@dataclass(frozen=True)
class ToolDecision:
    """What `choose_tool` chose, and how: the tool (None: answer directly) and the PCD choice behind it.

    ``answer`` is None when nothing was asked (a named tool, ``none``, or one option left); ``stats``
    (what the decision cost, ``pcd_core/cost.py``) is then zero.
    """

    tool: ToolSpec | None
    offered: tuple[str, ...]
    called_this_turn: tuple[str, ...]
    answer: ChoiceAnswer | None = None
    stats: Stats = field(default_factory=Stats)
    warnings: tuple[str, ...] = ()  # the decision's own (a low candidate mass, a bypassed head)

    @property
    def choice(self) -> str:
        return self.tool.name if self.tool is not None else NO_TOOL

    @property
    def forced(self) -> bool:
        return self.answer is None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, for response metadata: the choice, the options, and the distribution if one was read."""
        record: dict[str, Any] = {
            "choice": self.choice,
            "forced": self.forced,
            "offered": list(self.offered),
            "called_this_turn": list(self.called_this_turn),
        }
        if self.answer is not None:
            record |= {
                "probabilities": dict(self.answer.probabilities),
                "confidence": self.answer.confidence,
                "candidate_mass": self.answer.candidate_mass,
                "input_tokens": self.stats.input_tokens,
            }
        return record


def _offered(tools: Sequence[ToolSpec], choice: ToolChoice, called: Collection[str]) -> list[str]:
    if choice.mode == "none":
        return [NO_TOOL]
    if choice.mode == "named":
        assert choice.name is not None
        return [choice.name]
    if choice.mode == "required":
        return [tool.name for tool in tools]
    return [*(tool.name for tool in tools if tool.name not in called), NO_TOOL]


def choose_tool(
    engine: Engine, text: str, tools: Sequence[ToolSpec], choice: ToolChoice, called: Collection[str] = ()
) -> ToolDecision:
    """The tool to call for the conversation ``text`` (rendered by the caller), by the module's rules.

    ``called`` names the tools already called since the latest user message.
    """
    by_name = {tool.name: tool for tool in tools}
    if len(by_name) != len(tools):
        repeated = sorted({tool.name for tool in tools if sum(t.name == tool.name for t in tools) > 1})
        raise ToolChoiceError(f"tool names must be distinct; repeated: {repeated}")
    if not tools and choice.mode == "required":
        raise ToolChoiceError("tool_choice='required' needs at least one tool")
    if choice.name is not None and choice.name not in by_name:
        raise ToolChoiceError(f"tool_choice names {choice.name!r}, which is not among the tools {sorted(by_name)}")
    offered = _offered(tools, choice, called)
    spent = tuple(sorted(set(called) & set(by_name)))
    if len(offered) == 1:  # nothing to decide between
        return ToolDecision(by_name.get(offered[0]), tuple(offered), spent)
    criteria = {name: by_name[name].description if name in by_name else _NO_TOOL_DESCRIPTION for name in offered}
    question = {"type": "choice", "instructions": TOOL_QUESTION, "criteria": criteria}
    response = engine.decide(text, {"tool": question})
    answer = response.answers["tool"]
    assert isinstance(answer, ChoiceAnswer)  # a choice question gets a choice answer
    return ToolDecision(
        by_name.get(answer.choice), tuple(offered), spent, answer, response.stats, tuple(response.warnings)
    )


def tool_arguments(engine: Engine, text: str, tool: ToolSpec) -> Extraction | None:
    """The arguments of a call to ``tool``: a fill of its parameter schema; None when it takes none."""
    if not tool.parameters.get("properties"):
        return None
    task = f"Write the arguments of a call to the tool {tool.name}" + (
        f": {tool.description}" if tool.description else "."
    )
    return engine.fill(dict(tool.parameters), text, task=task)
