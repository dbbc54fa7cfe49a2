"""What a decision reads besides its state: the conversation before it and the caller's instructions.

A ``Conversation`` is what ``Engine.decide(..., context=...)`` takes: ``instructions`` (a system or
developer message's text) join the engine's own instructions in the system turn, as the caller's
words about every question; ``turns`` are the earlier turns, each rendered through the model's chat
template with its own role (``question_rows.render_decide_prompt``), its text fenced like the state, so a
turn cannot speak as the prompt any more than the state can. The state is still the text the
questions are about; the turns are what came before it.

Roles are those every chat template this project loads renders: ``user``, ``assistant`` and ``tool``
(a function call and its output are tool turns). ``check_conversation`` bounds and checks the text
as ``limits.check_decide`` does the state's. ``tests/test_conversation.py`` covers the rendering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pcd_core.errors import PromptError
from pcd_core.request.limits import Limits, check_json, check_text, check_text_bytes
from pcd_core.request.questions import Text, is_blank

Role = Literal["user", "assistant", "tool"]
ROLES: tuple[Role, ...] = ("user", "assistant", "tool")


@dataclass(frozen=True)
class Turn:
    """One earlier turn: who said it and what (text, or JSON shown on one line)."""

    role: Role
    text: Text

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise PromptError(f"a turn's role is one of {', '.join(ROLES)}, not {self.role!r}")
        if is_blank(self.text):
            raise PromptError(f"a {self.role} turn must not be empty")


@dataclass(frozen=True)
class Conversation:
    """Earlier ``turns`` and the caller's ``instructions``, in their order; both may be empty."""

    turns: tuple[Turn, ...] = ()
    instructions: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.turns or self.instructions)

    def key(self) -> Any:
        """A hashable form, for caches keyed by what the prompt holds."""
        return (tuple((turn.role, repr(turn.text)) for turn in self.turns), self.instructions)


def check_conversation(limits: Limits, conversation: Conversation, state: Text) -> None:
    """Every text of the conversation readable (no lone surrogates, finite JSON, bounded depth, no
    blank instructions), and its bytes with the state's within ``limits.max_text_bytes``.
    """
    n_bytes = check_json(limits, state, ("state",))
    for index, text in enumerate(conversation.instructions):
        if is_blank(text):
            raise PromptError("an instruction message must not be empty")
        check_text(text, ("context", "instructions", index))
        n_bytes += len(text.encode("utf-8"))
    for index, turn in enumerate(conversation.turns):
        n_bytes += check_json(limits, turn.text, ("context", "turns", index))
    check_text_bytes(limits, n_bytes, "the bytes of the state and the conversation before it")
