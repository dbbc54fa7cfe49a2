"""The session routes' wire (``/v1/sessions``): create, append a turn, read, and trigger events.

A session is opened with a schema (each turn's result is a fill: the ``Extraction`` record) or a
question set (each turn's result is a decide: the System One response), the keywords of that call,
and triggers; the HTTP routes (``pcd_integrations/http/sessions.py``) and the LangChain runnable
(``append_record``) build these shapes from here. ``tests/test_http_sessions.py`` drives them with a real ``httpx`` client.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pcd_core import DecideResponse, Extraction


def append_record(result: Extraction | DecideResponse) -> dict[str, Any]:
    """An append's JSON body, as the HTTP route and the LangChain runnable return it: the fill's
    record or the System One body, with the triggers that fired (an empty list when none did).
    """
    body = result.to_dict() if isinstance(result, Extraction) else result.to_wire()
    body["triggers"] = [fired.to_dict() for fired in result.triggers]
    return body


class TriggerSpec(BaseModel):
    """``Session.when``'s arguments (``pcd_core/request/triggers.py``)."""

    model_config = ConfigDict(extra="forbid")

    field: str = Field(description="A schema key or a question id.")
    changed: bool = False
    above: float | None = None
    below: float | None = None
    abstained: bool | None = None
    label: str | None = None
    hysteresis: float = 0.05
    name: str = ""


class SessionCreate(BaseModel):
    """``POST /v1/sessions``: a ``schema`` or ``questions``, never both."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | None = Field(default=None, alias="schema", description="A closed JSON Schema.")
    questions: dict[str, Any] | None = Field(default=None, description="System One questions, by id.")
    task: str = ""
    keep_last_tokens: int | None = Field(default=None, ge=1)
    triggers: list[TriggerSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_kind(self) -> SessionCreate:
        if (self.json_schema is None) == (self.questions is None):
            raise ValueError("give a schema or questions, not both and not neither")
        if self.questions is not None and self.task:
            raise ValueError("task is a schema's sentence; a question set says it in its questions")
        return self


class TurnRequest(BaseModel):
    """``POST /v1/sessions/{id}/turns``: one turn."""

    model_config = ConfigDict(extra="forbid")

    role: str = "user"
    text: str


class SessionCreated(BaseModel):
    id: str
    object: Literal["session"] = "session"
    kind: Literal["fill", "decide"]
    expires_in_s: float


class SessionTurnBody(BaseModel):
    role: str
    text: str


class SessionBody(BaseModel):
    """``GET /v1/sessions/{id}``: the turns it holds and the last result (None before any turn)."""

    id: str
    object: Literal["session"] = "session"
    kind: Literal["fill", "decide"]
    turns: list[SessionTurnBody]
    result: dict[str, Any] | None
