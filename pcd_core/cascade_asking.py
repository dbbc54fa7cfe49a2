"""How a cascade asks a later stage: which fields go with the escalated ones, the smaller schema they
make, and the stateless asks that a cascade's ``fill``/``decide`` (``pcd_core/cascade.py``) and a
session's stage without sessions (``pcd_core/cascade_session.py``) make.

An ``Ask`` is the stage call the escalation code takes as a parameter, so that a stateless request and
a session's stage share every other line of it. ``tests/test_cascade.py`` checks the smaller schema.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from pcd_core.request.schema import Schema

#: how a stage is asked: ``ask(index, stage, names)`` answers (at least) the fields or questions
#: ``names`` with the cascade's stage ``index`` (1 for the first later stage)
Ask = Callable[[int, Any, tuple[str, ...]], Any]


def dependants(schema: Schema, names: set[str]) -> set[str]:
    """``names`` with every closed field that depends on one of them, directly or not."""
    grown = set(names)
    changed = True
    while changed:
        changed = False
        for f in schema.fields:
            if f.name not in grown and f.member_of is None and set(f.depends_on) & grown:
                grown.add(f.name)
                changed = True
    return grown


def sub_schema(schema: Schema, names: set[str]) -> Schema:
    """The closed fields in ``names``, in schema order, depending only on each other: what the next engine is asked."""
    kept = tuple(
        replace(f, depends_on=tuple(d for d in f.depends_on if d in names)) for f in schema.fields if f.name in names
    )
    return Schema(kept, title=schema.title)


def stage_keywords(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords a later stage takes from a fill's: its ``task`` alone (the rest are the first engine's)."""
    return {"task": keywords["task"]} if keywords.get("task") else {}


def fill_statelessly(schema: Schema, text: str, keywords: Mapping[str, Any]) -> Ask:
    """Ask a stage the escalated fields as a smaller schema on ``text``, with the request's ``task``."""
    return lambda index, stage, names: stage.engine.fill(
        sub_schema(schema, set(names)), text, **stage_keywords(keywords)
    )


def decide_statelessly(state: Any, questions: dict[str, Any]) -> Ask:
    """Ask a stage the escalated questions alone on ``state``."""
    return lambda index, stage, names: stage.engine.decide(state, {qid: questions[qid] for qid in names})


def stage_schema(spec: Any, schema: Schema) -> Any:
    """What a later stage's session reads: the schema as given, or its fields that can escalate alone
    where it has open fields or a multi-label list (which stay with the first engine), so that no
    append of the stage writes text or reads labels nobody asked it for.
    """
    escalating = {f.name for f in schema.fields if f.member_of is None}
    if not schema.open_fields and len(escalating) == len(schema.fields):
        return spec
    return sub_schema(schema, escalating)
