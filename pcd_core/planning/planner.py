"""``Planner``: everything a request needs before it holds the model.

The engine (``engine.py``) checks, tokenizes and plans a fill or a decide before it takes the model
lock, so a bad input costs no pass and concurrent callers overlap here. The planner holds what that
needs and nothing of the model's: the per-request limits, the compiled schemas, the decide prompt,
the debias default, the fitted calibration and the content-free priors (measured by the engine, once
per schema or question set, and kept here). It returns ``Prepared`` records (``batching.py``): a
plan (``filling.FillPlan``, ``deciding.DecidePlan``), its debias / calibration step, and a ``Meter``
whose ``compile_ms`` is already set.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

from pcd_core.concurrency.lru import Lru
from pcd_core.cost import Meter, Stats
from pcd_core.planning.batching import Prepared
from pcd_core.planning.deciding import DecideKeywords, DecidePlan, plan_decide
from pcd_core.planning.filling import FillKeywords, FillPlan, fill_options, request_ids
from pcd_core.prompting.compiler import CompiledSchema, compile_schema
from pcd_core.prompting.prompt import PromptParts
from pcd_core.prompting.question_rows import render_decide_prompt
from pcd_core.reading.generation import check_caps
from pcd_core.reading.read_path import ms_since
from pcd_core.request.conversation import Conversation, check_conversation
from pcd_core.request.limits import DEFAULT_LIMITS, Limits, check_decide, check_fill, check_order_samples
from pcd_core.request.schema import parse_schema
from pcd_core.tokenizer import TextTokenizer
from pcd_core.trust.calibration import Calibration
from pcd_core.trust.calibration_applying import Adjust, adjuster
from pcd_core.trust.debias import content_free_priors

#: what a prior's read returns for one content-free input: per field or question, its distribution
PriorRead = Callable[[str], dict[str, list[float]]]
Priors = Mapping[str, Sequence[float]]


def schema_key(schema: Any) -> Any:
    """The cache key of a schema as a caller passed it: the class itself, or its canonical JSON, so
    that the same schema written twice finds one compiled entry.
    """
    if isinstance(schema, type):
        return schema
    return json.dumps(schema, sort_keys=True, default=repr)


class PlannerSettings(TypedDict, total=False):
    """An engine's request-side settings (``Engine(...)``'s keywords after ``head_cache_size``)."""

    limits: Limits  # per-request bounds (limits.py); DEFAULT_LIMITS when not given
    calibration: Calibration | None  # fitted per field or question, heads included (calibration.py)
    debias: bool  # whether a call that does not say divides out the content-free prior (debias.py)
    order_samples: int  # decide's default K (DecideKeywords.order_samples), 1 to MAX_ORDER_SAMPLES
    schema_cache_size: int  # compiled schemas (and their priors) kept, 64 when not given


class Planner:
    """A tokenizer's requests made ready for the model, under one engine's settings."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        context_length: int,
        *,
        limits: Limits = DEFAULT_LIMITS,
        calibration: Calibration | None = None,
        debias: bool = False,
        order_samples: int = 1,
        schema_cache_size: int = 64,
    ) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.limits, self.calibration, self.debias = limits, calibration, debias  # PlannerSettings says
        self.order_samples = check_order_samples(order_samples)
        self._compiled = Lru(schema_cache_size)  # its lock makes one compile per key, however many callers
        self._priors = Lru(schema_cache_size)
        self._decide_prompt: PromptParts | None = None

    def compile(self, schema: Any, task: str = "") -> CompiledSchema:
        """Compile once per (schema, task); ``task`` is a sentence put after the instructions."""
        key = (schema_key(schema), task)
        compiled, _ = self._compiled.get_or(key, lambda: compile_schema(parse_schema(schema), self.tokenizer, task))
        return compiled

    def request_ids(self, compiled: CompiledSchema, text: str, nonce: str | None = None) -> tuple[int, ...]:
        """The whole prompt's ids, after checking that it fits the context (``filling.request_ids``)."""
        return request_ids(self.tokenizer, compiled, text, self.context_length, nonce)

    def priors(self, key: Any, read: PriorRead) -> dict[str, tuple[float, ...]]:
        """The content-free priors under ``key``, measured with ``read`` on a miss
        (``debias.content_free_priors``); the caller holds the model while they are read.
        """
        priors, _ = self._priors.get_or(key, lambda: content_free_priors(read))
        return priors

    def fill(
        self, schema: Any, text: str, keywords: FillKeywords, priors: Callable[[Any, str], Priors]
    ) -> Prepared[FillPlan]:
        """A fill made ready: checked, tokenized, planned; ``priors(schema, task)`` is called only if
        a field is debiased. ``keywords.use_head_cache`` is the caller's business.
        """
        parsed, task, caps = parse_schema(schema), keywords.get("task", ""), keywords.get("max_new_tokens")
        check_fill(self.limits, parsed, text)  # bounds and readable text first
        check_caps(parsed, caps)
        read_options = fill_options(keywords.get("options"), keywords.get("strategy"))
        started = time.perf_counter()
        compiled = self.compile(schema, task)
        generate, hidden = keywords.get("generate", True), keywords.get("hidden", False)
        whole = self.request_ids(compiled, text, keywords.get("fence_nonce"))
        plan = FillPlan(compiled, whole, read_options, generate, caps, hidden)
        names = {f.name: [label.text for label in f.labels] for f in compiled.schema.fields}
        adjust = self._adjuster(names, keywords, lambda: priors(schema, task))
        return plan, adjust, Meter(Stats(compile_ms=ms_since(started)))

    def decide(
        self,
        state: Any,
        questions: dict[str, Any],
        keywords: DecideKeywords,
        priors: Callable[[dict[str, Any], int], Priors],
    ) -> Prepared[DecidePlan]:
        """A decide made ready: checked, rendered, planned; ``priors(questions, order_samples)`` gets the
        validated questions and the orders they are read in, and is called only if one is debiased.
        """
        started = time.perf_counter()
        context, cache_key, order_samples = (
            keywords.get("context"),
            keywords.get("cache_key"),
            keywords.get("order_samples"),
        )
        request = check_decide(self.limits, state, questions)  # bounds and readable text first
        if context:
            check_conversation(self.limits, context, request.state)
        prompt = self.decide_prompt(context)
        samples = self.order_samples if order_samples is None else check_order_samples(order_samples)
        plan = plan_decide(
            self.tokenizer,
            prompt,
            request,
            self.context_length,
            self.limits,
            cache_turns=cache_key is not None,
            order_samples=samples,
            nonce=keywords.get("fence_nonce"),
        )
        names = {qid: asked.names for qid, asked in zip(request.questions, plan.asked)}
        adjust = self._adjuster(names, keywords, lambda: priors(request.questions, samples))
        return plan, adjust, Meter(Stats(compile_ms=ms_since(started)))

    def decide_prompt(self, context: Conversation | None = None) -> PromptParts:
        """The decide prompt around a state: rendered with ``context``, or the one without (kept)."""
        if context:
            return render_decide_prompt(self.tokenizer, context)
        if self._decide_prompt is None:
            self._decide_prompt = render_decide_prompt(self.tokenizer)
        return self._decide_prompt

    def _adjuster(
        self, names: Mapping[str, Sequence[str]], keywords: FillKeywords | DecideKeywords, priors: Callable[[], Priors]
    ) -> Adjust | None:
        """A call's debias / calibration step (``calibration_applying.adjuster``), None when it does neither;
        the priors are measured here, before the request's passes are counted.
        """
        debias = keywords.get("debias")
        calibration = self.calibration if keywords.get("calibrate", True) else None
        return adjuster(calibration, names, self.debias if debias is None else debias, priors)


def questions_key(questions: Mapping[str, Any]) -> str:
    """A question set's key in the priors cache: its validated questions as canonical JSON."""
    return json.dumps({qid: q.model_dump() for qid, q in questions.items()}, sort_keys=True, default=repr)
