"""How a session's append is planned and read: a fill session's and a decide session's halves.

``session.py`` keeps the conversation, its KV and its triggers; this module says what differs between
a schema's session and a question set's: the plan of a fresh ``fill``/``decide`` of the conversation
(with the session's nonce), the text of the prompt up to the conversation's end (whose KV the session
keeps), and the read after that KV, through ``read_path.read_request`` as every request is read. It
also turns a result into a trigger's ``Observation``, and checks a schema or question set against the
engine's ``Limits`` when the session opens (``check``: the same checks every append's plan makes, on
no text, so a set that no turn could be read with fails at once). ``tests/test_session.py`` checks
both halves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pcd_core.backends.base import Prefix
from pcd_core.concurrency.session_memory import SessionMemory
from pcd_core.errors import OptionError
from pcd_core.planning.batching import Prepared
from pcd_core.planning.deciding import DecideKeywords, DecidePlan
from pcd_core.planning.filling import FillKeywords, FillPlan, read_waves
from pcd_core.planning.planner import Planner
from pcd_core.prompting.prompt import fence_open, normalise_input
from pcd_core.prompting.question_rows import as_data_line
from pcd_core.reading.loaded_model import LoadedModel
from pcd_core.reading.read_path import read_request
from pcd_core.reading.rounds import RoundStats
from pcd_core.request.limits import check_decide, check_fill
from pcd_core.request.questions import ChoiceAnswer, DecideResponse, NoulAnswer
from pcd_core.request.triggers import Observation, Trigger, observe
from pcd_core.result import Extraction, FieldResult

Result = Extraction | DecideResponse


class SessionHost(Protocol):
    """What a session needs of its engine (``Engine`` is one): the model side and the planner."""

    model: LoadedModel
    planner: Planner
    model_name: str
    sessions: SessionMemory

    def content_free_priors(self, schema: Any, task: str = "") -> dict[str, tuple[float, ...]]: ...

    def question_priors(
        self, questions: dict[str, Any], order_samples: int | None = None
    ) -> dict[str, tuple[float, ...]]: ...


class Reader(Protocol):
    """What differs between a fill session and a decide session: the plan and how it is read."""

    def prepare(self, host: SessionHost, text: str, nonce: str) -> Prepared[Any]: ...

    def kept_text(self, host: SessionHost, text: str, nonce: str) -> str: ...

    def head_ids(self, plan: Any) -> tuple[int, ...]: ...

    def names(self, host: SessionHost) -> tuple[str, ...]: ...

    def check(self, host: SessionHost) -> None: ...

    def read(
        self, host: SessionHost, prepared: Prepared[Any], lookup_ids: tuple[int, ...], base: Prefix, pause: Any
    ) -> tuple[RoundStats, Callable[[Any], Result], Prefix]: ...

    def observe(self, result: Any, trigger: Trigger) -> Observation: ...


@dataclass(frozen=True)
class FillReader:
    """A schema's session: each append is ``fill(schema, conversation, **keywords)``."""

    schema: Any
    keywords: FillKeywords

    def prepare(self, host: SessionHost, text: str, nonce: str) -> Prepared[FillPlan]:
        keywords: FillKeywords = {**self.keywords, "fence_nonce": nonce}
        return host.planner.fill(self.schema, text, keywords, host.content_free_priors)

    def kept_text(self, host: SessionHost, text: str, nonce: str) -> str:
        compiled = host.planner.compile(self.schema, self.keywords.get("task", ""))
        return compiled.prompt.head + fence_open("INPUT", nonce) + normalise_input(text)

    def head_ids(self, plan: FillPlan) -> tuple[int, ...]:
        return plan.compiled.head_ids

    def names(self, host: SessionHost) -> tuple[str, ...]:
        return tuple(host.planner.compile(self.schema, self.keywords.get("task", "")).schema.keys)

    def check(self, host: SessionHost) -> None:
        compiled = host.planner.compile(self.schema, self.keywords.get("task", ""))
        check_fill(host.planner.limits, compiled.schema, "")

    def read(
        self, host: SessionHost, prepared: Prepared[FillPlan], lookup_ids: tuple[int, ...], base: Prefix, pause: Any
    ) -> tuple[RoundStats, Callable[[Any], Result], Prefix]:
        plan, adjust, meter = prepared
        rounds = RoundStats()
        speculation = plan.speculation(host.model.backend)
        decoded, warnings = read_request(
            host.model,
            lookup_ids,
            plan.whole,
            plan.first_tasks(speculation),
            meter,
            rounds,
            True,
            pause,
            plan.reads_hidden(adjust),
            lookup=lambda ids, use: (base, True, False),  # the session's kept KV is the head
        )
        filled = read_waves(host.model, plan, decoded, adjust, meter, rounds, pause, speculation=speculation)
        filled.warnings[:0] = warnings
        return rounds, lambda stats: plan.assemble(filled, stats), decoded.prefix

    def observe(self, result: Any, trigger: Trigger) -> Observation:
        if trigger.field not in result.fields:
            raise OptionError(f"the schema has no key {trigger.field!r}; its keys are {', '.join(result.fields)}")
        field = result.fields[trigger.field]
        if isinstance(field, FieldResult):
            return observe(field.value, field.probabilities, trigger.label, field.abstained)
        return observe(field.value, None, None)


@dataclass(frozen=True)
class DecideReader:
    """A question set's session: each append is ``decide(conversation, questions, **keywords)``."""

    questions: dict[str, Any]
    keywords: DecideKeywords

    def prepare(self, host: SessionHost, text: str, nonce: str) -> Prepared[DecidePlan]:
        keywords: DecideKeywords = {**self.keywords, "fence_nonce": nonce}
        return host.planner.decide(text, self.questions, keywords, host.question_priors)

    def kept_text(self, host: SessionHost, text: str, nonce: str) -> str:
        prompt = host.planner.decide_prompt(self.keywords.get("context"))
        return prompt.head + fence_open("STATE", nonce) + as_data_line(normalise_input(text))

    def head_ids(self, plan: DecidePlan) -> tuple[int, ...]:
        return plan.head_ids

    def names(self, host: SessionHost) -> tuple[str, ...]:
        return tuple(self.questions)

    def check(self, host: SessionHost) -> None:
        check_decide(host.planner.limits, "", self.questions)

    def read(
        self, host: SessionHost, prepared: Prepared[DecidePlan], lookup_ids: tuple[int, ...], base: Prefix, pause: Any
    ) -> tuple[RoundStats, Callable[[Any], Result], Prefix]:
        plan, adjust, meter = prepared
        rounds = RoundStats()
        hidden = adjust is not None and adjust.reads_hidden
        decoded, warnings = read_request(
            host.model,
            lookup_ids,
            plan.whole,
            plan.tasks(),
            meter,
            rounds,
            True,
            pause,
            hidden,
            lookup=lambda ids, use: (base, True, False),  # the session's kept KV is the head
        )
        readouts, spreads = plan.merged(list(decoded.readouts))
        finish = lambda stats: plan.respond(host.model_name, readouts, stats, warnings, adjust, spreads)  # noqa: E731
        return rounds, finish, decoded.prefix

    def observe(self, result: Any, trigger: Trigger) -> Observation:
        if trigger.field not in result.answers:
            raise OptionError(f"no question {trigger.field!r}; the questions are {', '.join(result.answers)}")
        answer = result.answers[trigger.field]
        if isinstance(answer, NoulAnswer):
            probabilities = {"true": answer.noul, "false": 1.0 - answer.noul}
            return observe(answer.noul >= 0.5, probabilities, trigger.label, answer.abstained)
        ranked = sorted(answer.probabilities.items(), key=lambda item: -item[1])
        value = answer.choice if isinstance(answer, ChoiceAnswer) else ranked[0][0]
        return observe(value, answer.probabilities, trigger.label, answer.abstained)
