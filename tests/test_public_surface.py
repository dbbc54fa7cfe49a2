"""``pcd_core.__all__`` is what the front doors use: they import the engine's names from ``pcd_core``, and
reach inside only into the modules listed here, each for a stated reason."""

from __future__ import annotations

import ast
from pathlib import Path

import pcd_core

ROOT = Path(__file__).resolve().parents[1]
FRONT_DOORS = ("pcd_integrations", "mcp_server")

#: the modules a front door may import from directly, and why it must
INTERNAL = {
    "pcd_core.bench": "pcd bench parses and prints what the benchmark computes",
    "pcd_core.evaluation": "pcd eval and pcd calibrate print what the evaluation computes",
    "pcd_core.loading": "the commands and servers resolve a model name, list the registry and check a shape "
    "before anything loads, so that a typo fails in a second",
    "pcd_core.request": "the wire models check a body with the engine's own limits and name the x_ flags "
    "the protocols carry",
    "pcd_core.concurrency.model_lock": "the servers run engine calls on worker threads with the engine's cancellation",
    "pcd_core.hooks": "the metrics and traces listen to every forward pass",
    "pcd_core.reading.chatting": "the chat route renders its transcript as the engine reads it",
    "pcd_core.result": "the servers warn on low candidate mass with the engine's own bound",
    "pcd_core.trust": "the trust options and the served flags use the calibration's constants",
}

#: the public names, pinned: a change here is a change of the API users import
PINNED = [
    "Answer",
    "BACKENDS",
    "BackendError",
    "BackendName",
    "BackendUnavailableError",
    "Calibration",
    "Cancellation",
    "Cancelled",
    "Cascade",
    "ChoiceAnswer",
    "ChoiceQuestion",
    "Conversation",
    "DEFAULT_LIMITS",
    "DEFAULT_MODEL",
    "DecideRequest",
    "DecideResponse",
    "DecodeOptions",
    "Engine",
    "EscalationRule",
    "Extraction",
    "Field",
    "FieldResult",
    "FreeTextNotSupportedError",
    "GeneratedField",
    "Generation",
    "GenerationError",
    "HiddenStatesUnavailableError",
    "Label",
    "LimitError",
    "Limits",
    "LoadOptions",
    "MembershipResult",
    "Message",
    "ModelNotFoundError",
    "NO_TOOL",
    "NoulAnswer",
    "NoulQuestion",
    "OfflineError",
    "OptionError",
    "PcdError",
    "PromptError",
    "Question",
    "ReplyTooLongError",
    "RequestError",
    "Role",
    "Schema",
    "SchemaError",
    "ScoreAnswer",
    "ScoreQuestion",
    "Session",
    "SessionInterface",
    "SessionTurn",
    "Stage",
    "Stats",
    "TextError",
    "TokenizationError",
    "ToolChoice",
    "ToolChoiceError",
    "ToolDecision",
    "ToolSpec",
    "Turn",
    "UpstreamError",
    "Usage",
    "__version__",
    "choose_tool",
    "normalise_tool_choice",
    "parse_schema",
    "recommendation",
    "tool_arguments",
]


def _imports() -> list[tuple[str, str, str]]:
    """Every ``from pcd_core... import name`` in the front doors: (file, module, name)."""
    found = []
    for door in FRONT_DOORS:
        for path in (ROOT / door).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pcd_core":
                    found += [(str(path.relative_to(ROOT)), node.module, alias.name) for alias in node.names]
    return found


def test_every_public_name_resolves_and_is_listed_once():
    assert sorted(pcd_core.__all__) == PINNED and len(PINNED) == len(set(PINNED))
    for name in pcd_core.__all__:
        assert getattr(pcd_core, name) is not None, name


def test_the_front_doors_take_public_names_from_pcd_core():
    public = set(pcd_core.__all__)
    reaching = [
        (file, module, name)
        for file, module, name in _imports()
        if module != "pcd_core" and name in public and not module.startswith(("pcd_core.bench", "pcd_core.evaluation"))
    ]
    assert not reaching, f"import these from pcd_core: {reaching}"


def test_the_front_doors_reach_inside_only_where_a_reason_is_given():
    inside = {
        (file, module, name)
        for file, module, name in _imports()
        if module != "pcd_core" and not any(module == m or module.startswith(m + ".") for m in INTERNAL)
    }
    assert not inside, sorted(inside)


def test_every_internal_reason_is_still_used():
    modules = {module for _, module, _ in _imports()}
    for prefix in INTERNAL:
        assert any(m == prefix or m.startswith(prefix + ".") for m in modules), prefix
