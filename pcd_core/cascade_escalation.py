"""One input's escalation through a cascade's stages: what a stage is asked, and its answers merged in.

``pcd_core/cascade.py`` says what a cascade does; this module keeps what it records for one input, the
same for a single call, a batch (``pcd_core/cascade_batch.py`` walks many) and a session's append:
the ``Reading`` an ``EscalationRule`` looks at, the cost per engine (``StageCost``), the escalation
record of each field or question (why it went on, to whom, whether the later answer replaced the
earlier one, both readings), and the results that carry them (``CascadeExtraction``,
``CascadeDecideResponse``). A stage that failed leaves each name it was asked with its earlier answer
and a record that says why. ``tests/test_cascade.py`` and ``tests/test_cascade_batch.py`` check it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pydantic import BaseModel, Field

from pcd_core.cascade_asking import dependants
from pcd_core.cost import Stats
from pcd_core.errors import PcdError
from pcd_core.request.questions import Answer, DecideResponse, NoulAnswer
from pcd_core.request.schema import Schema
from pcd_core.result import Extraction, FieldResult

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reading:
    """What a rule looks at in one answer, from a fill's field or a decide's answer alike."""

    value: Any
    probability: float
    probabilities: Mapping[str, float]
    candidate_mass: float
    abstained: bool
    set_size: int

    @classmethod
    def of_field(cls, result: FieldResult) -> Reading:
        size = len(result.answer_set) if result.answer_set is not None else 1
        return cls(
            result.value,
            result.probability,
            dict(result.probabilities),
            result.candidate_mass,
            result.abstained,
            size,
        )

    @classmethod
    def of_answer(cls, answer: Answer) -> Reading:
        size = len(answer.answer_set) if answer.answer_set is not None else 1
        if isinstance(answer, NoulAnswer):
            probabilities = {"true": answer.noul, "false": 1.0 - answer.noul}
            value: Any = answer.noul >= 0.5
        else:
            probabilities = dict(answer.probabilities)
            value = answer.choice if hasattr(answer, "choice") else answer.score
        top = max(probabilities.values())
        return cls(value, top, probabilities, answer.candidate_mass, answer.abstained, size)

    def to_dict(self, engine: str) -> dict[str, Any]:
        return {
            "engine": engine,
            "value": self.value,
            "probability": self.probability,
            "probabilities": dict(self.probabilities),
            "candidate_mass": self.candidate_mass,
        }


class StageCost(BaseModel):
    """What one engine of a cascade spent on one request."""

    engine: str
    asked: int = Field(description="Fields or questions this engine was asked.")
    forward_passes: int = 0
    input_tokens: int = 0
    total_ms: float = 0.0
    error: str | None = None  # why this stage's answers were not used


@dataclass
class CascadeExtraction(Extraction):
    """A fill's ``Extraction`` whose fields say who answered, with the cost per engine."""

    stages: list[StageCost] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "cascade": [s.model_dump() for s in self.stages]}


class CascadeDecideResponse(DecideResponse):
    """A decide's answers, each saying who answered, with the cost per engine (``x_cascade`` on the wire)."""

    stages: list[StageCost] = Field(default_factory=list, exclude=True)

    def to_wire(self) -> dict[str, Any]:
        wire = super().to_wire()
        wire["x_cascade"] = [s.model_dump() for s in self.stages]
        return wire


def summed(costs: Sequence[Stats], total_ms: float) -> Stats:
    """The stats of several engines' calls as one record: counts and times added, ``total_ms`` the wall time;
    the words (row layout, head cache, backend, dtype) are the first engine's.
    """
    first = costs[0] if costs else Stats()
    numbers = {
        f.name: sum(getattr(s, f.name) for s in costs)
        for f in fields(Stats)
        if f.name != "total_ms" and isinstance(getattr(first, f.name), int | float)
    }
    return replace(first, **numbers, total_ms=total_ms)


def _cost(name: str, asked: int, stats: Stats, error: str | None = None) -> StageCost:
    spent = {key: getattr(stats, key) for key in ("forward_passes", "input_tokens", "total_ms")}
    return StageCost(engine=name, asked=asked, error=error, **spent)


class _Escalation:
    """One input's answers on their way through the stages (``cascade_batch.escalate`` walks them): who
    answered each name, the cost per engine, the warnings and escalation records. A fill's and a
    decide's differ only in how an answer is read and copied, and what a stage is asked with it.
    """

    def __init__(
        self, first_name: str, answers: dict[str, Any], stats: Stats, warnings: Sequence[str], asked: int
    ) -> None:
        self.first_name, self.now = first_name, answers
        self.answered_by = dict.fromkeys(answers, 0)  # the stage that answered each name; 0 the first
        self.costs, self.warnings, self.all_stats = [_cost(first_name, asked, stats)], list(warnings), [stats]
        self.reasons: dict[str, tuple[str, ...]] = {}  # why each name goes to the stage asked now

    def _reading(self, answer: Any) -> Reading:
        raise NotImplementedError

    def _copy(self, answer: Any, **changes: Any) -> Any:
        raise NotImplementedError

    def _sent_on(self, index: int, stage: Any, escalates: Callable[[Any], bool]) -> dict[str, tuple[str, ...]]:
        """The names stage ``index``'s rule sends on among those the stage before answered, with why."""
        return {
            name: why
            for name, answer in self.now.items()
            if escalates(answer)
            and self.answered_by[name] == index - 1
            and (why := stage.rule.reasons(name, self._reading(answer)))
        }

    def failed(self, stage: Any, error: PcdError, total_ms: float) -> None:
        """A stage that raised: logged, named in the warnings, its time its cost; every name asked keeps
        its earlier answer, marked.
        """
        failure = f"{type(error).__name__}: {error}"
        logger.warning("cascade stage %s failed; keeping earlier answers: %s", stage.label, failure)
        self.warnings.append(f"stage {stage.label!r} was not used: {failure}")
        self.costs.append(_cost(stage.label, len(self.reasons), Stats(total_ms=total_ms), failure))
        for name in self.reasons:
            self._keep(name, stage, failure)

    def _keep(self, name: str, stage: Any, why: str) -> None:
        earlier = self.now[name]
        record = _record(self.reasons[name], stage.label, False, self._reading(earlier), None, why)
        self.now[name] = self._copy(earlier, escalation=_chain(earlier, record))

    def _take(self, index: int, stage: Any, name: str, newer: Any) -> None:
        earlier = self.now[name]
        record = _record(
            self.reasons[name],
            stage.label,
            True,
            self._reading(earlier),
            self._reading(newer),
            None,
            earlier.engine or self.first_name,
        )
        self.now[name] = self._copy(newer, engine=stage.label, escalation=_chain(earlier, record))
        self.answered_by[name] = index

    def _spent(self, stage: Any, later: Any) -> None:
        self.costs.append(_cost(stage.label, len(self.reasons), later.stats))
        self.all_stats.append(later.stats)

    def _stats(self, started: float) -> Stats:
        return summed(self.all_stats, (time.perf_counter() - started) * 1000)


class FillEscalation(_Escalation):
    """A fill's fields: a field that ``depends_on`` an escalated one goes with it, as a sub-schema."""

    def __init__(self, first_name: str, schema: Schema, result: Extraction) -> None:
        fields_now = {
            name: replace(found, engine=first_name) if isinstance(found, FieldResult) else found
            for name, found in result.fields.items()
        }
        super().__init__(first_name, fields_now, result.stats, result.warnings, len(schema.fields))
        self.schema, self.result = schema, result

    def _reading(self, answer: Any) -> Reading:
        return Reading.of_field(answer)

    def _copy(self, answer: Any, **changes: Any) -> Any:
        return replace(answer, **changes)

    def asked(self, index: int, stage: Any) -> tuple[str, ...]:
        self.reasons = self._sent_on(index, stage, lambda found: isinstance(found, FieldResult))
        asked = dependants(self.schema, set(self.reasons))
        for name in asked - set(self.reasons):
            self.reasons[name] = (f"depends on {sorted(set(self.schema.field(name).depends_on) & asked)[0]!r}",)
        return tuple(f.name for f in self.schema.fields if f.name in asked)

    def answered(self, index: int, stage: Any, later: Extraction) -> None:
        self._spent(stage, later)
        for name in self.reasons:
            if isinstance(newer := later.fields.get(name), FieldResult):
                self._take(index, stage, name, newer)

    def finish(self, started: float) -> CascadeExtraction:
        value = _rebuilt(self.schema, self.result, self.now)
        return CascadeExtraction(value, self.now, self._stats(started), self.warnings, stages=self.costs)


class DecideEscalation(_Escalation):
    """A decide's answers: the escalated questions alone go on."""

    def __init__(self, first_name: str, response: DecideResponse) -> None:
        answers = {qid: a.model_copy(update={"engine": first_name}) for qid, a in response.answers.items()}
        super().__init__(first_name, answers, response.stats, response.warnings, len(answers))
        self.model = response.model

    def _reading(self, answer: Any) -> Reading:
        return Reading.of_answer(answer)

    def _copy(self, answer: Any, **changes: Any) -> Any:
        return answer.model_copy(update=changes)

    def asked(self, index: int, stage: Any) -> tuple[str, ...]:
        self.reasons = self._sent_on(index, stage, lambda answer: True)
        return tuple(self.reasons)  # in the questions' order, as the answers come

    def answered(self, index: int, stage: Any, later: DecideResponse) -> None:
        self._spent(stage, later)
        self.warnings += [f"{stage.label}: {w}" for w in later.warnings]
        for qid in self.reasons:
            newer = later.answers.get(qid)
            if newer is None or type(newer) is not type(self.now[qid]):
                self._keep(qid, stage, "refused")  # a remote refused this question: the earlier answer stays
            else:
                self._take(index, stage, qid, newer)

    def finish(self, started: float) -> CascadeDecideResponse:
        stats = self._stats(started)
        return CascadeDecideResponse(
            model=self.model, answers=self.now, stats=stats, warnings=self.warnings, stages=self.costs
        )


def _record(
    reasons: Sequence[str],
    to: str,
    escalated: bool,
    earlier: Reading,
    later: Reading | None,
    error: str | None,
    earlier_engine: str = "",
) -> dict[str, Any]:
    """One stage's escalation of one field: why, to whom, whether its answer replaced the earlier one,
    and both readings (the later one None where the stage failed).
    """
    readings = [earlier.to_dict(earlier_engine)] + ([later.to_dict(to)] if later is not None else [])
    return {"reasons": list(reasons), "to": to, "escalated": escalated, "error": error, "readings": readings}


def _chain(earlier: Any, record: dict[str, Any]) -> dict[str, Any]:
    """The escalation record, after the earlier stages' (a field escalated twice keeps both)."""
    before = getattr(earlier, "escalation", None)
    return {**record, "before": before} if before else record


def _rebuilt(schema: Schema, first: Extraction, fields_now: dict[str, Any]) -> Any:
    """The value again, with the escalated fields' new answers, as the first engine built it (a
    multi-label list is never escalated, so its value stands).
    """
    values = {name: found.value for name, found in fields_now.items()}
    if isinstance(first.value, dict) or schema.model_class is None:
        return dict(values)
    return schema.rebuild(values)
