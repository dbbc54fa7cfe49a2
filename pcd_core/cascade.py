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
engine (``StageCost``), and ``stats`` sums them; one input's records and merges are
``pcd_core/cascade_escalation.py``'s.

A ``Cascade`` has the engine's interface (``fill``, ``decide``, their ``_many``, whose later stages are
asked once per distinct set of escalated names for the whole batch (``pcd_core/cascade_batch.py``),
the async twins, and ``session``, whose every append is cascaded: ``pcd_core/cascade_session.py``), and
every other attribute (``model_name``, ``tokenizer``, ``generate``, ...) is the first engine's, so a
door that takes an ``Engine`` takes a cascade unchanged. A multi-label list and the open (generated)
fields stay with the first engine. ``tests/test_cascade.py`` checks it on the embedded model cascading
to itself under another calibration.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Protocol

from pcd_core.cascade_asking import (
    Ask,
    decide_statelessly,
    fill_statelessly,
    stage_keywords,
    stage_schema,
)
from pcd_core.cascade_batch import decide_together, each_alone, escalate, fill_together
from pcd_core.cascade_escalation import (
    CascadeDecideResponse,
    CascadeExtraction,
    DecideEscalation,
    FillEscalation,
    Reading,
)
from pcd_core.cascade_session import CascadedSession, SessionPlan, opens_sessions
from pcd_core.concurrency.model_lock import in_thread
from pcd_core.errors import OptionError
from pcd_core.request.questions import DecideResponse
from pcd_core.request.schema import Schema, parse_schema
from pcd_core.result import Extraction
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
        """``fill`` of each text, read in one batch by the first engine and by each later stage (once
        per distinct sub-schema it is asked, ``cascade_batch.py``, which says how the cost is shared).
        """
        started = time.perf_counter()
        results = self.first.fill_many(schema, texts, **keywords)
        parsed = parse_schema(schema)
        escalations = [FillEscalation(self.first_name, parsed, r) for r in results]
        asks = [fill_statelessly(parsed, t, keywords) for t in texts]
        escalate(escalations, self.stages, fill_together(parsed, texts, keywords, asks))
        return [e.finish(started) for e in escalations]

    async def afill(self, schema: Any, text: str, **keywords: Any) -> CascadeExtraction:
        return await in_thread(self.fill, schema, text, **keywords)

    async def afill_many(self, schema: Any, texts: list[str], **keywords: Any) -> list[CascadeExtraction]:
        return await in_thread(self.fill_many, schema, texts, **keywords)

    def _escalate_fill(self, schema: Schema, result: Extraction, ask: Ask, started: float) -> CascadeExtraction:
        """``result`` (the first engine's) with the fields each stage's rule sends on answered by ``ask``."""
        escalation = FillEscalation(self.first_name, schema, result)
        escalate([escalation], self.stages, each_alone([ask]))
        return escalation.finish(started)

    # -- decide -------------------------------------------------------------------------------
    def decide(self, state: Any, questions: dict[str, Any], **keywords: Any) -> CascadeDecideResponse:
        started = time.perf_counter()
        response = self.first.decide(state, questions, **keywords)
        return self._escalate_decide(response, decide_statelessly(state, questions), started)

    def decide_many(self, states: Sequence[Any], questions: dict[str, Any], **keywords: Any) -> list[Any]:
        """``decide`` of each state, read in one batch by the first engine and by each later stage (once
        per distinct question subset it is asked, ``cascade_batch.py``).
        """
        started = time.perf_counter()
        responses = self.first.decide_many(states, questions, **keywords)
        escalations = [DecideEscalation(self.first_name, r) for r in responses]
        asks = [decide_statelessly(s, questions) for s in states]
        escalate(escalations, self.stages, decide_together(states, questions, asks))
        return [e.finish(started) for e in escalations]

    async def adecide(self, state: Any, questions: dict[str, Any], **keywords: Any) -> CascadeDecideResponse:
        return await in_thread(self.decide, state, questions, **keywords)

    async def adecide_many(self, states: Sequence[Any], questions: dict[str, Any], **keywords: Any) -> list[Any]:
        return await in_thread(self.decide_many, states, questions, **keywords)

    def _escalate_decide(self, response: DecideResponse, ask: Ask, started: float) -> CascadeDecideResponse:
        """``response`` (the first engine's) with the questions each stage's rule sends on answered by ``ask``."""
        escalation = DecideEscalation(self.first_name, response)
        escalate([escalation], self.stages, each_alone([ask]))
        return escalation.finish(started)
