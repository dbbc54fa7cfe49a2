"""``RemoteDecisions``: any ``/v1/decisions`` endpoint (another ``pcd serve``, a hosted Decisions service)
as a later stage of a ``Cascade`` (pcd_core/cascade.py), spoken through the official ``openai`` client.

It has the two calls a stage needs. ``decide`` maps System One questions to the Decisions API's
(noul to ``predicate``, choice to ``choice``, score to ``score``; ``decision_questions``) and the answers
back, keyed by question id (the question's ``name`` on the wire). ``fill`` asks a schema's closed fields
as questions (a boolean field a ``predicate``, any other a ``choice`` among its labels, instructions from
the field's name and description) and builds a field result from each answer.

A remote that cannot answer (connection refused, slower than ``timeout_s``, any HTTP error status)
raises ``RemoteDecisionsError``, a ``PcdError``, which a cascade catches: the earlier answers stay,
marked as not escalated and why. An answer the remote refuses (``type: "refusal"``) is left out, and
the cascade keeps the earlier one for it. The wire has no candidate mass; a remote answer reports 1.0.
``tests/test_remote_decisions.py`` drives a second ``pcd serve`` on loopback, and servers that are
down, slow and failing.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import Any

from pcd_core import (
    ChoiceAnswer,
    ChoiceQuestion,
    DecideRequest,
    DecideResponse,
    Extraction,
    Field,
    FieldResult,
    NoulAnswer,
    NoulQuestion,
    PcdError,
    Schema,
    ScoreAnswer,
    ScoreQuestion,
    Stats,
    parse_schema,
)
from pcd_core.concurrency.model_lock import in_thread

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'pcd-engine[remote]'"

#: seconds a remote may take before its fields keep the earlier answers
TIMEOUT_S = 30.0


class RemoteDecisionsError(PcdError):
    """The remote did not answer: down, slower than its timeout, or an HTTP error status."""


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def decision_questions(questions: dict[str, Any]) -> list[dict[str, Any]]:
    """System One questions (validated as ``/v1/systemone`` validates them) as Decisions questions, named by id."""
    asked = DecideRequest(state="", questions=questions).questions
    out: list[dict[str, Any]] = []
    for qid, q in asked.items():
        instructions = _text(q.instructions) if q.instructions is not None else ""
        if isinstance(q, NoulQuestion):
            sides = [f"{side}: {_text(text)}" for side, text in (q.criteria or {}).items() if text is not None]
            text = "\n".join([instructions, *sides]).strip()
            out.append({"type": "predicate", "name": qid, "instructions": text})
        elif isinstance(q, ChoiceQuestion):
            choices = [
                {"value": name, **({"description": _text(d)} if d is not None else {})}
                for name, d in q.criteria.items()
            ]
            out.append({"type": "choice", "name": qid, "instructions": instructions, "choices": choices})
        else:
            levels = [{"label": _text(level)} for level in q.criteria]
            out.append({"type": "score", "name": qid, "instructions": instructions, "levels": levels})
    return out


def field_questions(schema: Schema) -> dict[str, dict[str, Any]]:
    """A schema's closed fields as System One questions keyed by field name."""
    return {f.name: _field_question(f) for f in schema.fields}


def _field_question(f: Field) -> dict[str, Any]:
    instructions = f"{f.name}: {f.description}" if f.description else f.name
    if {label.value for label in f.labels} == {True, False}:
        return {"type": "noul", "instructions": instructions}
    return {"type": "choice", "instructions": instructions, "criteria": {label.text: None for label in f.labels}}


def _confidence(probabilities: Sequence[float]) -> float:
    n = len(probabilities)
    return min(1.0, max(0.0, (n * max(probabilities) - 1) / (n - 1))) if n > 1 else 1.0


class RemoteDecisions:
    """A ``/v1/decisions`` endpoint as a cascade stage; ``base_url`` ends in ``/v1``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = "unused",
        timeout_s: float = TIMEOUT_S,
        name: str = "",
    ) -> None:
        try:
            import openai
        except ImportError as error:
            raise ImportError(
                f"a remote Decisions stage needs 'openai', which is not installed; run: {INSTALL_HINT}"
            ) from error
        self._openai = openai
        # no retries: a 5xx or a timeout should hand the fields back now, not after a quiet second try
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)
        self.base_url, self.model, self.timeout_s = base_url, model, timeout_s
        self.model_name = name or f"{model}@{base_url}"

    def _create(self, state: Any, questions: list[dict[str, Any]]) -> tuple[Any, float]:
        started = time.perf_counter()
        try:
            asked: Any = questions  # the SDK types each question as a TypedDict; these are built to that shape
            decision = self.client.decisions.create(model=self.model, input=_text(state), questions=asked)
        except self._openai.APITimeoutError as error:
            raise RemoteDecisionsError(f"{self.base_url} did not answer within {self.timeout_s} s") from error
        except self._openai.APIConnectionError as error:
            raise RemoteDecisionsError(f"cannot reach {self.base_url}: {error}") from error
        except self._openai.APIStatusError as error:
            raise RemoteDecisionsError(f"{self.base_url} answered {error.status_code}: {error.message}") from error
        return decision, (time.perf_counter() - started) * 1000

    def _stats(self, decision: Any, total_ms: float) -> Stats:
        extra = decision.model_extra or {}
        return Stats(
            forward_passes=int(extra.get("x_forward_passes", 0) or 0),
            input_tokens=int(decision.usage.input_tokens) if decision.usage is not None else 0,
            total_ms=total_ms,
        )

    # -- decide -------------------------------------------------------------------------------
    def decide(self, state: Any, questions: dict[str, Any], **keywords: Any) -> DecideResponse:
        """The remote's answers to ``questions`` (System One), keyed by id; a refused one is left out."""
        asked = DecideRequest(state="", questions=questions).questions
        decision, total_ms = self._create(state, decision_questions(questions))
        answers: dict[str, Any] = {}
        for got in decision.answers:
            question = asked.get(got.name or "")
            if question is None or got.type == "refusal":
                continue
            answers[got.name] = _answer_of(question, got)
        return DecideResponse(model=decision.model, answers=answers, stats=self._stats(decision, total_ms))

    def decide_many(self, states: Sequence[Any], questions: dict[str, Any], **keywords: Any) -> list[DecideResponse]:
        return [self.decide(state, questions) for state in states]

    async def adecide(self, state: Any, questions: dict[str, Any], **keywords: Any) -> DecideResponse:
        return await in_thread(self.decide, state, questions)

    # -- fill ---------------------------------------------------------------------------------
    def fill(self, schema: Any, text: str, **keywords: Any) -> Extraction:
        """The schema's closed fields asked as questions (``field_questions``); answers as field results."""
        parsed = parse_schema(schema)
        response = self.decide(text, field_questions(parsed))
        results: dict[str, Any] = {}
        for f in parsed.fields:
            answer = response.answers.get(f.name)
            if answer is not None:
                results[f.name] = _field_result(f, answer)
        return Extraction({n: r.value for n, r in results.items()}, results, response.stats)

    def fill_many(self, schema: Any, texts: list[str], **keywords: Any) -> list[Extraction]:
        return [self.fill(schema, text) for text in texts]

    async def afill(self, schema: Any, text: str, **keywords: Any) -> Extraction:
        return await in_thread(self.fill, schema, text)


def _answer_of(question: Any, got: Any) -> Any:
    """A Decisions answer (the SDK's model) as the System One answer to ``question``."""
    if isinstance(question, NoulQuestion):
        return NoulAnswer(noul=float(got.probability), candidate_mass=1.0)
    if isinstance(question, ChoiceQuestion):
        probabilities = {_text(p.value): float(p.probability) for p in got.probabilities}
        return ChoiceAnswer(
            choice=_text(got.choice),
            probabilities=probabilities,
            confidence=float(got.confidence),
            candidate_mass=1.0,
            logits={},
        )
    assert isinstance(question, ScoreQuestion)
    probabilities = {str(p.value): float(p.probability) for p in got.probabilities}
    return ScoreAnswer(
        score=float(got.score),
        legend={str(i): level for i, level in enumerate(question.criteria)},
        probabilities=probabilities,
        confidence=float(got.confidence),
        candidate_mass=1.0,
        logits={},
    )


def _field_result(f: Field, answer: Any) -> FieldResult:
    """A field's result from the remote's answer to its question (``_field_question``)."""
    if isinstance(answer, NoulAnswer):
        by_text = {"true": answer.noul, "false": 1.0 - answer.noul}
    else:
        by_text = dict(answer.probabilities)
    probabilities = {label.text: by_text.get(label.text, 0.0) for label in f.labels}
    ranked = sorted(f.labels, key=lambda label: -probabilities[label.text])
    best = ranked[0]
    values = list(probabilities.values())
    return FieldResult(
        name=f.name,
        value=best.value,
        probability=probabilities[best.text],
        probabilities=probabilities,
        candidate_mass=answer.candidate_mass,
        confidence=_confidence(values),
        top=[(label.value, probabilities[label.text]) for label in ranked[:5]],
        method="trie",
        wave=0,
    )
