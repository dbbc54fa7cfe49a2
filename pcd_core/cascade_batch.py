"""How a cascade escalates a batch: each later stage asked once per distinct set of escalated names.

``Cascade.fill_many`` / ``decide_many`` (``pcd_core/cascade.py``) read every input with the first
engine's ``fill_many`` / ``decide_many``. ``escalate`` then walks the stages: at each one, every input
still in play says which fields or questions its stage's rule sends on (an ``Escalation``'s ``asked``),
the inputs that send the same names are grouped, and each group is one call of the stage's engine
(``AskMany``): ``fill_many`` of that sub-schema over the group's texts, or ``decide_many`` of that
question subset over its states. The inputs still unsure after that stage go on to the next in the
same way, so a stage is called once per distinct set of names, never once per input. A single input
(``Cascade.fill``/``decide``, and every append of a cascaded session) goes through the same walk as a
batch of one, so the per-input records and merges are the same code either way.

What stays as a stage answers alone:

- each input's answers, probabilities and escalation records are those of its own call: an
  ``Engine``'s ``*_many`` gives each input the answers of its solo call (``planning/batching.py``);
- a stage whose engine has no ``fill_many`` / ``decide_many`` is asked one input at a time
  (``each_alone``); a remote stage (``pcd_integrations/remote_decisions.py``) has both, and loops
  over its inputs itself, since a ``/v1/decisions`` request carries one input;
- a batched stage call that raises a ``PcdError`` is made again one input at a time, since a stage
  refuses a whole batch for one input it cannot take (an ``Engine`` checks every input before any
  pass): each input then gets the answers or the error of its own call, and an input whose call
  raised keeps its earlier answers, marked, and goes to no later stage. A stage that is down is thus
  asked once for the batch and then once per input, as the per-input walk would have asked it.

Cost: each input's ``StageCost`` for a batched call is the stats the stage's ``*_many`` gives that input,
not the call divided by its inputs. An ``Engine`` gives each input the batch's forward passes and wall
time (what the call that answered it cost, shared) and the input's own tokens, as the first engine's
``fill_many`` does for the first stage; so a stage's passes summed over a batch's inputs count the
shared passes once per input. A failed call records its own wall time.
``tests/test_cascade_batch.py`` checks all of this on the embedded model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

from pcd_core.cascade_asking import Ask, stage_keywords, sub_schema
from pcd_core.errors import PcdError
from pcd_core.request.schema import Schema

_T = TypeVar("_T")

#: a stage call's outcome for one input: its result, or the error the call raised, and the call's wall time
Outcome = tuple[Any, float]

#: ``ask_many(index, stage, names, members)``: the outcome of asking stage ``index`` the names ``names``
#: for each input in ``members`` (indices into the batch), in that order
AskMany = Callable[[int, Any, tuple[str, ...], Sequence[int]], list[Outcome]]


class Escalation(Protocol):
    """One input's escalation, as ``pcd_core/cascade.py`` keeps it: the names a stage is asked, and the
    merge of its answers or its failure into the input's answers.
    """

    def asked(self, index: int, stage: Any) -> tuple[str, ...]:
        """The names stage ``index``'s rule sends on (with what must go with them); empty: none."""
        ...

    def answered(self, index: int, stage: Any, later: Any) -> None: ...

    def failed(self, stage: Any, error: PcdError, total_ms: float) -> None: ...


def escalate(escalations: Sequence[Escalation], stages: Sequence[Any], ask_many: AskMany) -> None:
    """Walk ``stages`` for every input of ``escalations``, one ``ask_many`` per stage and distinct set of names."""
    live = list(range(len(escalations)))
    for index, stage in enumerate(stages, start=1):
        groups: dict[tuple[str, ...], list[int]] = {}
        for member in live:
            if names := escalations[member].asked(index, stage):
                groups.setdefault(names, []).append(member)
        answered: list[int] = []
        for names, members in groups.items():
            for member, (got, total_ms) in zip(members, ask_many(index, stage, names, members), strict=True):
                if isinstance(got, PcdError):
                    escalations[member].failed(stage, got, total_ms)  # and goes no further
                else:
                    escalations[member].answered(index, stage, got)
                    answered.append(member)
        if not answered:
            return
        live = sorted(answered)


def attempt(call: Callable[[], _T]) -> tuple[_T | PcdError, float]:
    """``call()``'s result, or the ``PcdError`` it raised, with its wall time in ms."""
    started = time.perf_counter()
    try:
        got: _T | PcdError = call()
    except PcdError as error:
        got = error
    return got, (time.perf_counter() - started) * 1000


def each_alone(asks: Sequence[Ask]) -> AskMany:
    """Ask a stage one input at a time, input ``i`` through ``asks[i]``."""

    def ask_many(index: int, stage: Any, names: tuple[str, ...], members: Sequence[int]) -> list[Outcome]:
        return [attempt(partial(asks[member], index, stage, names)) for member in members]

    return ask_many


def _together(
    method: str,
    inputs: Sequence[Any],
    asks: Sequence[Ask],
    call: Callable[[Callable[..., Any], tuple[str, ...], list[Any]], Any],
) -> AskMany:
    """Ask a stage a group's ``inputs`` in one call of its engine's ``method`` (through ``call``), or
    one at a time through ``asks`` where its engine has no such method.
    """
    alone = each_alone(asks)

    def ask_many(index: int, stage: Any, names: tuple[str, ...], members: Sequence[int]) -> list[Outcome]:
        batched = getattr(stage.engine, method, None)
        if not callable(batched):
            return alone(index, stage, names, members)
        got, total_ms = attempt(partial(call, batched, names, [inputs[member] for member in members]))
        if not isinstance(got, PcdError):
            return [(result, total_ms) for result in got]
        if len(members) == 1:
            return [(got, total_ms)]
        # a batch is refused whole for one input the stage cannot take (over its context or limits):
        # asked alone, each input gets the answers or the error of its own call
        return alone(index, stage, names, members)

    return ask_many


def fill_together(schema: Schema, texts: Sequence[str], keywords: Mapping[str, Any], asks: Sequence[Ask]) -> AskMany:
    """A stage's ``fill_many`` of the escalated sub-schema over a group's texts, with the request's ``task``."""

    def call(fill_many: Callable[..., Any], names: tuple[str, ...], group: list[Any]) -> Any:
        return fill_many(sub_schema(schema, set(names)), group, **stage_keywords(keywords))

    return _together("fill_many", texts, asks, call)


def decide_together(states: Sequence[Any], questions: Mapping[str, Any], asks: Sequence[Ask]) -> AskMany:
    """A stage's ``decide_many`` of the escalated questions over a group's states."""

    def call(decide_many: Callable[..., Any], names: tuple[str, ...], group: list[Any]) -> Any:
        return decide_many(group, {qid: questions[qid] for qid in names})

    return _together("decide_many", states, asks, call)
