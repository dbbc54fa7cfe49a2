"""``Cascade``: a first engine answers every field, and only the fields it is unsure of go on to the next.

A small local model answers most fields of most inputs well, and its calibration says which ones it
does not (an abstention, a low probability, a low candidate mass, an answer set of more than one).
A ``Cascade`` keeps the first engine's answer where its ``EscalationRule`` does not hold, and asks the
next ``Stage``'s engine the rest, on the same input, as a smaller schema (or question set); a field
that ``depends_on`` an escalated one is asked there too, since its answer was read after the doubtful
one. A stage's answers can go on to a further stage by that stage's rule, so more than two stages work
the same way.

Every answered field says which engine answered it (``engine``) and carries ``escalation``: the reasons
its rule held, whether the later answer replaced the earlier one, and both readings. A stage that fails
(a ``PcdError``: a remote that times out, refuses or answers 5xx, pcd_integrations/remote_decisions.py,
or an input over a smaller context) leaves the earlier answers, marked as not escalated and why: a
cascade never loses a field to a later engine. The cost record gives passes, tokens and time per
engine (``StageCost``), and ``stats`` sums them.

A ``Cascade`` has the engine's interface (``fill``, ``decide``, their ``_many`` and async twins, and
``session``, whose every append is cascaded: ``pcd_core/cascade_session.py``), and
every other attribute (``model_name``, ``tokenizer``, ``generate``, ...) is the first engine's, so a
door that takes an ``Engine`` takes a cascade unchanged. A multi-label list and the open (generated)
fields stay with the first engine. ``tests/test_cascade.py`` checks it on the embedded model cascading
to itself under another calibration.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import partial
from typing import Any, Protocol

from pydantic import BaseModel, Field

from pcd_core.cascade_asking import (
    Ask,
    decide_statelessly,
    dependants,
    fill_statelessly,
    stage_keywords,
    stage_schema,
)
from pcd_core.cascade_session import CascadedSession, SessionPlan, opens_sessions
from pcd_core.concurrency.model_lock import in_thread
from pcd_core.cost import Stats
from pcd_core.errors import OptionError, PcdError
from pcd_core.request.questions import Answer, DecideResponse, NoulAnswer
from pcd_core.request.schema import Schema, parse_schema
from pcd_core.result import Extraction, FieldResult
from pcd_core.sessions.session import is_question_set
from pcd_core.trust.calibration import Calibration

logger = logging.getLogger(__name__)


class DecisionEngine(Protocol):
    """What a stage's engine must do: an ``Engine``, a ``Cascade``, or a remote (``RemoteDecisions``)."""

    model_name: str

    def fill(self, schema: Any, text: str, **keywords: Any) -> Extraction: ...

    def decide(self, state: Any, questions: dict[str, Any], **keywords: Any) -> DecideResponse: ...


@dataclass(frozen=True)
class EscalationRule:
    """When a field goes on to the next engine: any condition that holds sends it. Per-field rules
    (``per_field``) replace this one for the fields they name.
    """

    abstained: bool = True  # the earlier answer abstained (its calibration's or head's threshold)
    probability_below: float | None = None  # its top probability is below this
    mass_below: float | None = None  # its candidate mass is below this
    set_larger_than_one: bool = False  # its answer set (a calibration's --coverage) holds more than one label
    per_field: Mapping[str, EscalationRule] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, bound in (("probability_below", self.probability_below), ("mass_below", self.mass_below)):
            if bound is not None and not 0 <= bound <= 1:
                raise OptionError(f"an escalation rule's {name} lies in [0, 1], not {bound!r}")

    @classmethod
    def fitted(cls, calibration: Calibration | None, **conditions: Any) -> EscalationRule:
        """The rule ``conditions`` give, with the threshold ``pcd calibrate --cascade`` fitted for each
        field it names (``Calibration.escalation``) as that field's ``probability_below``: the first
        engine must be loaded with the same calibration, whose probabilities the thresholds were
        fitted on. A threshold above 1 (escalate every example) is applied as 1.
        """
        base = cls(**conditions)
        if calibration is None or calibration.escalation is None:
            return base
        per_field = {
            name: replace(base, probability_below=min(below, 1.0))
            for name, below in calibration.escalation.below.items()
        }
        return replace(base, per_field=per_field)

    def for_field(self, name: str) -> EscalationRule:
        return self.per_field.get(name, self)

    def reasons(self, name: str, reading: Reading) -> tuple[str, ...]:
        """Why ``name``'s reading goes on; empty when it stays."""
        rule = self.for_field(name)
        found = []
        if rule.abstained and reading.abstained:
            found.append("abstained")
        if rule.probability_below is not None and reading.probability < rule.probability_below:
            found.append(f"probability {reading.probability:.3f} < {rule.probability_below}")
        if rule.mass_below is not None and reading.candidate_mass < rule.mass_below:
            found.append(f"candidate mass {reading.candidate_mass:.3f} < {rule.mass_below}")
        if rule.set_larger_than_one and reading.set_size > 1:
            found.append(f"answer set of {reading.set_size}")
        return tuple(found)


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


@dataclass(frozen=True)
class Stage:
    """A later engine and the rule that sends a field to it; ``name`` says who answered (default: the
    engine's ``model_name``).
    """

    engine: Any
    rule: EscalationRule = EscalationRule()
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or str(getattr(self.engine, "model_name", type(self.engine).__name__))


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


def _stage_failed(
    label: str, error: PcdError, started: float, asked: int, warnings: list[str], costs: list[StageCost]
) -> str:
    """A stage that raised: logged, named in the warnings, its time recorded as its cost; the reason."""
    failure = f"{type(error).__name__}: {error}"
    logger.warning("cascade stage %s failed; keeping earlier answers: %s", label, failure)
    warnings.append(f"stage {label!r} was not used: {failure}")
    costs.append(_cost(label, asked, Stats(total_ms=(time.perf_counter() - started) * 1000), failure))
    return failure


def _cost(name: str, asked: int, stats: Stats, error: str | None = None) -> StageCost:
    return StageCost(
        engine=name,
        asked=asked,
        forward_passes=stats.forward_passes,
        input_tokens=stats.input_tokens,
        total_ms=stats.total_ms,
        error=error,
    )


class Cascade:
    """A first engine and later stages: the module docstring says what it does."""

    def __init__(self, first: Any, stages: Sequence[Stage | Any], *, name: str = "") -> None:
        if not stages:
            raise OptionError("a cascade needs at least one later stage")
        self.first = first
        self.stages = tuple(s if isinstance(s, Stage) else Stage(s) for s in stages)
        self.first_name = name or str(getattr(first, "model_name", "first"))

    def __getattr__(self, name: str) -> Any:
        # the first engine's attributes (model_name, tokenizer, generate, ...): a door sees an Engine
        if name in ("first", "stages", "first_name"):
            raise AttributeError(name)
        return getattr(self.first, name)

    @property
    def opens_sessions(self) -> bool:
        """Whether this cascade can follow a conversation in a session: when its first engine can."""
        return opens_sessions(self.first)

    def session(
        self, schema_or_questions: Any, *, keep_last_tokens: int | None = None, **keywords: Any
    ) -> CascadedSession:
        """``Engine.session`` cascaded: the first engine's session answers each append, and the fields
        the stages' rules send on are answered by them (``cascade_session.py`` says how, and its cost).
        """
        if not opens_sessions(self.first):
            raise OptionError(f"the cascade's first engine {self.first_name!r} has no sessions; open them on an Engine")
        first = self.first.session(schema_or_questions, keep_last_tokens=keep_last_tokens, **keywords)
        if is_question_set(schema_or_questions):
            ask = partial(decide_statelessly, questions=schema_or_questions)
            plan = SessionPlan(self._escalate_decide, ask, schema_or_questions, {}, keep_last_tokens)
        else:
            schema = parse_schema(schema_or_questions)
            ask = partial(fill_statelessly, schema, keywords=keywords)
            spec = stage_schema(schema_or_questions, schema)
            plan = SessionPlan(
                partial(self._escalate_fill, schema), ask, spec, stage_keywords(keywords), keep_last_tokens
            )
        return CascadedSession(first, self.stages, plan)

    # -- fill ---------------------------------------------------------------------------------
    def fill(self, schema: Any, text: str, **keywords: Any) -> CascadeExtraction:
        started = time.perf_counter()
        result = self.first.fill(schema, text, **keywords)
        parsed = parse_schema(schema)
        return self._escalate_fill(parsed, result, fill_statelessly(parsed, text, keywords), started)

    def fill_many(self, schema: Any, texts: list[str], **keywords: Any) -> list[CascadeExtraction]:
        started = time.perf_counter()
        results = self.first.fill_many(schema, texts, **keywords)
        parsed = parse_schema(schema)
        return [
            self._escalate_fill(parsed, r, fill_statelessly(parsed, t, keywords), started)
            for t, r in zip(texts, results)
        ]

    async def afill(self, schema: Any, text: str, **keywords: Any) -> CascadeExtraction:
        return await in_thread(self.fill, schema, text, **keywords)

    async def afill_many(self, schema: Any, texts: list[str], **keywords: Any) -> list[CascadeExtraction]:
        return await in_thread(self.fill_many, schema, texts, **keywords)

    def _escalate_fill(self, schema: Schema, result: Extraction, ask: Ask, started: float) -> CascadeExtraction:
        """``result`` (the first engine's) with the fields each stage's rule sends on answered by ``ask``."""
        fields_now = dict(result.fields)
        for name, found in fields_now.items():
            if isinstance(found, FieldResult):
                fields_now[name] = replace(found, engine=self.first_name)
        answered_by = {name: 0 for name in fields_now}  # the stage that answered each field; 0 the first
        costs, warnings = [_cost(self.first_name, len(schema.fields), result.stats)], list(result.warnings)
        all_stats = [result.stats]
        for index, stage in enumerate(self.stages, start=1):
            reasons = {
                name: why
                for name, found in fields_now.items()
                if isinstance(found, FieldResult)
                and answered_by[name] == index - 1
                and (why := stage.rule.reasons(name, Reading.of_field(found)))
            }
            if not reasons:
                break
            asked = dependants(schema, set(reasons))
            for name in asked - set(reasons):
                reasons[name] = (f"depends on {sorted(set(schema.field(name).depends_on) & asked)[0]!r}",)
            clock = time.perf_counter()
            try:
                later = ask(index, stage, tuple(f.name for f in schema.fields if f.name in asked))
            except PcdError as error:
                failure = _stage_failed(stage.label, error, clock, len(asked), warnings, costs)
                for name in asked:
                    earlier = fields_now[name]
                    record = _record(reasons[name], stage.label, False, Reading.of_field(earlier), None, failure)
                    fields_now[name] = replace(earlier, escalation=_chain(earlier, record))
                break
            costs.append(_cost(stage.label, len(asked), later.stats))
            all_stats.append(later.stats)
            for name in asked:
                earlier, newer = fields_now[name], later.fields.get(name)
                if not isinstance(newer, FieldResult):
                    continue
                record = _record(
                    reasons[name],
                    stage.label,
                    True,
                    Reading.of_field(earlier),
                    Reading.of_field(newer),
                    None,
                    earlier.engine or self.first_name,
                )
                fields_now[name] = replace(newer, engine=stage.label, escalation=_chain(earlier, record))
                answered_by[name] = index
        value = _rebuilt(schema, result, fields_now)
        stats = summed(all_stats, (time.perf_counter() - started) * 1000)
        return CascadeExtraction(value, fields_now, stats, warnings, stages=costs)

    # -- decide -------------------------------------------------------------------------------
    def decide(self, state: Any, questions: dict[str, Any], **keywords: Any) -> CascadeDecideResponse:
        started = time.perf_counter()
        response = self.first.decide(state, questions, **keywords)
        return self._escalate_decide(response, decide_statelessly(state, questions), started)

    def decide_many(self, states: Sequence[Any], questions: dict[str, Any], **keywords: Any) -> list[Any]:
        started = time.perf_counter()
        responses = self.first.decide_many(states, questions, **keywords)
        return [self._escalate_decide(r, decide_statelessly(s, questions), started) for s, r in zip(states, responses)]

    async def adecide(self, state: Any, questions: dict[str, Any], **keywords: Any) -> CascadeDecideResponse:
        return await in_thread(self.decide, state, questions, **keywords)

    async def adecide_many(self, states: Sequence[Any], questions: dict[str, Any], **keywords: Any) -> list[Any]:
        return await in_thread(self.decide_many, states, questions, **keywords)

    def _escalate_decide(self, response: DecideResponse, ask: Ask, started: float) -> CascadeDecideResponse:
        """``response`` (the first engine's) with the questions each stage's rule sends on answered by ``ask``."""
        answers = {qid: a.model_copy(update={"engine": self.first_name}) for qid, a in response.answers.items()}
        answered_by = {qid: 0 for qid in answers}
        costs = [_cost(self.first_name, len(answers), response.stats)]
        all_stats, warnings = [response.stats], list(response.warnings)
        for index, stage in enumerate(self.stages, start=1):
            reasons = {
                qid: why
                for qid, answer in answers.items()
                if answered_by[qid] == index - 1 and (why := stage.rule.reasons(qid, Reading.of_answer(answer)))
            }
            if not reasons:
                break
            sub = tuple(reasons)  # in the questions' order, as the answers come
            clock = time.perf_counter()
            try:
                later = ask(index, stage, sub)
            except PcdError as error:
                failure = _stage_failed(stage.label, error, clock, len(sub), warnings, costs)
                for qid in sub:
                    earlier = answers[qid]
                    record = _record(reasons[qid], stage.label, False, Reading.of_answer(earlier), None, failure)
                    answers[qid] = earlier.model_copy(update={"escalation": _chain(earlier, record)})
                break
            costs.append(_cost(stage.label, len(sub), later.stats))
            all_stats.append(later.stats)
            warnings += [f"{stage.label}: {w}" for w in later.warnings]
            for qid in sub:
                earlier, newer = answers[qid], later.answers.get(qid)
                if newer is None or type(newer) is not type(earlier):
                    # a remote refused this question: the earlier answer stays, marked
                    record = _record(reasons[qid], stage.label, False, Reading.of_answer(earlier), None, "refused")
                    answers[qid] = earlier.model_copy(update={"escalation": _chain(earlier, record)})
                    continue
                record = _record(
                    reasons[qid],
                    stage.label,
                    True,
                    Reading.of_answer(earlier),
                    Reading.of_answer(newer),
                    None,
                    earlier.engine or self.first_name,
                )
                answers[qid] = newer.model_copy(update={"engine": stage.label, "escalation": _chain(earlier, record)})
                answered_by[qid] = index
        stats = summed(all_stats, (time.perf_counter() - started) * 1000)
        return CascadeDecideResponse(
            model=response.model, answers=answers, stats=stats, warnings=warnings, stages=costs
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
