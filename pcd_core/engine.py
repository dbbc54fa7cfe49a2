"""``Engine``: one backend behind ``fill``, ``decide`` and plain generation; wiring only, no math.

The engine holds the caches (compiled schemas, head KV, content-free priors: ``caches.py``), the
model lock and the timings. ``filling.py`` and ``deciding.py`` plan the passes (a warm fill is two
forward passes whatever the number of fields, plus one per further ``depends_on`` wave; a warm decide
is one; ``fill_many`` / ``decide_many`` read a whole batch in those passes, ``batching.py``); every
prompt, a chat reply's included, is read through ``reading.py``, which fills one ``Stats``
(``cost.py``): the cost record that ``fill``, ``decide``, ``generate`` and ``stream`` all return. One
FIFO lock serialises model access, so threads and async callers may share an engine; a request hands
the model to a waiting one at each pass boundary (``fairness.py``), and its ``Stats.queue_ms`` says how long it waited. ``tests/test_engine.py`` checks the pass counts, every
``Stats`` field and the equality with the four-pass reading this replaced, on the real model.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Unpack

from .asking import render_decide_prompt
from .backends.base import Backend, Prefix
from .batching import BatchRead, Prepared
from .caches import Lru, schema_key
from .calibration import Adjust, Calibration, adjuster
from .chatting import Message, stream_reply
from .compiler import CompiledSchema, compile_schema
from .conversation import Conversation, check_conversation
from .cost import Meter, Stats
from .debias import content_free_priors
from .deciding import DecideKeywords, DecidePlan, plan_decide
from .decoding import DecodeOptions
from .fairness import ModelLock
from .filling import FillKeywords, FillPlan, fill_options, fill_passes, request_ids
from .generation import check_caps
from .grammar import GrammarTokenizer
from .limits import DEFAULT_LIMITS, Limits, check_decide, check_fill, check_order_samples
from .models import load_backend
from .options import LoadOptions, load_options
from .prompt import PromptParts
from .questions import DecideResponse, distribution
from .reading import ms_since
from .result import Extraction, FieldResult, Generation
from .schema import parse_schema
from .tokenizer import TextTokenizer


class Engine:
    """One loaded model behind ``fill`` (schemas) and ``decide`` (Jev-style questions)."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: TextTokenizer,
        model_name: str,
        *,
        head_cache_size: int = 8,
        schema_cache_size: int = 64,
        limits: Limits = DEFAULT_LIMITS,
        calibration: Calibration | None = None,
        debias: bool = False,
        order_samples: int = 1,
    ) -> None:
        self.limits = limits  # per-request bounds, checked before any pass (pcd_core/limits.py)
        # trust (pcd_core/debias.py, pcd_core/calibration.py): per-schema content-free priors, fitted
        # calibration, and whether fill and decide debias when a call does not say
        self.calibration = calibration
        self.debias = debias
        self.order_samples = check_order_samples(order_samples)  # decide's default (LoadOptions.order_samples)
        if calibration is not None:  # heads of another model, or a backend without hidden states
            calibration.check_heads(model_name, backend.name, backend.reads_hidden)
        self._priors = Lru(schema_cache_size)
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        # model access, first come first served; a backend that batches concurrent calls itself
        # (vLLM) needs no lock
        self._lock = ModelLock(serialise=backend.serialises)
        self._compile_lock = threading.Lock()  # the compiled-schema LRU: compiling needs no model
        self._compiled = Lru(schema_cache_size)
        self._heads = Lru(head_cache_size)
        self._decide_prompt: PromptParts | None = None
        self._grammar_tokenizer: GrammarTokenizer | None = None

    @classmethod
    def load(cls, options: LoadOptions | str | None = None, /, **keywords: Any) -> Engine:
        """Load a model as a ``LoadOptions`` says (``pcd_core/options.py``: each option's meaning, which
        backend honours which). ``Engine.load("smollm2-135m", backend="llamacpp")`` builds one from a model
        name and keywords, ``Engine.load(options, dtype="bfloat16")`` overrides the given one's fields.
        Every option is checked, and a calibration file read, before anything loads.
        """
        chosen = load_options(options, **keywords)
        fitted = chosen.fitted_calibration()
        loaded, tokenizer, name = load_backend(chosen)
        return cls(
            loaded,
            tokenizer,
            name,
            head_cache_size=chosen.head_cache_size,
            calibration=fitted,
            debias=chosen.debias,
            order_samples=chosen.order_samples,
        )

    @property
    def waiting(self) -> int:
        """Requests queued for the model now, behind the one that holds it (``pcd_core/fairness.py``)."""
        return self._lock.waiting

    @property
    def context_length(self) -> int:
        return self.backend.context_length

    @property
    def grammar_tokenizer(self) -> GrammarTokenizer:
        """The grammar engine's view of the tokenizer, built on first use (it reads the vocabulary)."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = GrammarTokenizer(self.tokenizer.hf, self.tokenizer.eos_ids)
        return self._grammar_tokenizer

    # -- compile and cache --------------------------------------------------------------------
    def compile(self, schema: Any, task: str = "") -> CompiledSchema:
        """Compile once per (schema, task); ``task`` is a sentence put after the instructions."""
        with self._compile_lock:
            compiled, _ = self._compiled.get_or(
                (schema_key(schema), task), lambda: compile_schema(parse_schema(schema), self.tokenizer, task)
            )
            return compiled

    def _head(self, head_ids: tuple[int, ...], use_cache: bool) -> tuple[Prefix, bool, bool]:
        """The head's prefix, whether it came from the cache, and whether the cache holds it now."""
        if not use_cache:
            return self.backend.prefill(head_ids), False, False
        head, hit = self._heads.get_or(head_ids, lambda: self.backend.prefill(head_ids))
        return head, hit, self._heads.size > 0

    def warmup(self, schema: Any, task: str = "") -> Prefix:
        """Compile the schema and prefill its head, so that the first request is already warm.
        Returns the cached head, which token-by-token baselines continue from.
        """
        with self._lock:
            head, _, _ = self._head(self.compile(schema, task).head_ids, use_cache=True)
            return head

    # -- fill ---------------------------------------------------------------------------------
    def fill(
        self,
        schema: Any,
        text: str,
        options: DecodeOptions | None = None,
        *,
        strategy: str | None = None,
        task: str = "",
        use_head_cache: bool = True,
        max_new_tokens: dict[str, int] | None = None,
        debias: bool | None = None,
        calibrate: bool = True,
        generate: bool = True,
        hidden: bool = False,
    ) -> Extraction:
        """Decide every closed field of ``schema`` for ``text`` and generate every open one; see the
        module docstring for the cost, ``filling.py`` for the plan, and ``generation.py`` for open
        fields (``max_new_tokens`` caps them per field).

        ``strategy="exact"`` is short for ``options=DecodeOptions(strategy="exact")``; giving both is
        an ``OptionError``. ``task`` is an instruction put into the prompt after the generic ones
        ("Triage the following support ticket."); each task text gets its own head.
        ``debias`` divides out the content-free prior (``debias.py``; measured once per schema, a few
        fills; None: the engine's default); ``calibrate`` applies the engine's fitted calibration where
        it covers a field.
        ``generate=False`` decides the closed fields only, on the same prompt (the value is then a dict).
        ``hidden=True`` keeps each field's hidden state at its first decision point (``FieldResult.hidden``,
        the same passes): what ``pcd calibrate --head probe`` fits heads on.
        """
        started = time.perf_counter()
        keywords = FillKeywords(
            options=options,
            strategy=strategy,
            task=task,
            max_new_tokens=max_new_tokens,
            debias=debias,
            calibrate=calibrate,
            generate=generate,
            hidden=hidden,
        )
        return self._read_fill(self._plan_fill(schema, text, **keywords), use_head_cache, started)

    def _read_fill(self, prepared: Prepared[FillPlan], use_head_cache: bool, started: float) -> Extraction:
        """A prepared fill's passes, under the lock; ``started`` is when its call began."""
        plan, adjust, meter = prepared
        with self._lock.turn() as turn:  # the grammar tokenizer is built on first use, under the lock
            filled = fill_passes(
                self.backend,
                self._head,
                lambda: self.grammar_tokenizer,
                plan,
                adjust,
                meter,
                use_head_cache,
                turn.pause,
            )
        return plan.assemble(filled, replace(meter.stats, queue_ms=turn.queue_ms, total_ms=ms_since(started)))

    def _plan_fill(self, schema: Any, text: str, **keywords: Unpack[FillKeywords]) -> Prepared[FillPlan]:
        """A fill made ready before the lock (no model needed, so a bad input costs no pass): its plan,
        its debias / calibration step, its ``Meter`` with ``compile_ms``. ``use_head_cache`` is the
        caller's business (a keyword of ``fill_many`` passed on whole).
        """
        parsed, task, caps = parse_schema(schema), keywords.get("task", ""), keywords.get("max_new_tokens")
        check_fill(self.limits, parsed, text)  # bounds and readable text first
        check_caps(parsed, caps)
        read_options = fill_options(keywords.get("options"), keywords.get("strategy"))
        started = time.perf_counter()
        compiled = self.compile(schema, task)
        whole = self.request_ids(compiled, text)
        plan = FillPlan(
            compiled, whole, read_options, keywords.get("generate", True), caps, keywords.get("hidden", False)
        )
        names = {f.name: [label.text for label in f.labels] for f in compiled.schema.fields}
        priors = lambda: self.content_free_priors(schema, task)  # noqa: E731
        adjust = self._adjuster(names, keywords.get("debias"), keywords.get("calibrate", True), priors)
        return plan, adjust, Meter(Stats(compile_ms=ms_since(started)))

    def request_ids(self, compiled: CompiledSchema, text: str) -> tuple[int, ...]:
        """The whole prompt's ids, tokenized in one piece, after checking that it fits the context
        (``filling.request_ids``). ``pcd bench`` feeds its token-by-token baselines the same ids.
        """
        return request_ids(self.tokenizer, compiled, text, self.context_length)

    # -- trust: debiasing and fitted calibration (the math is in debias.py and calibration.py) ----
    def content_free_priors(self, schema: Any, task: str = "") -> dict[str, tuple[float, ...]]:
        """Per closed field, the mean label distribution over the ``CONTENT_FREE`` inputs, read raw
        through the same prompt; measured once per schema and cached beside the compiled schema.
        """

        def read(text: str) -> dict[str, list[float]]:
            fields = self.fill(schema, text, task=task, debias=False, calibrate=False, generate=False).fields
            return {name: list(r.probabilities.values()) for name, r in fields.items() if isinstance(r, FieldResult)}

        return self._prior((schema_key(schema), task), read)

    def _adjuster(
        self,
        names: Mapping[str, Sequence[str]],
        debias: bool | None,
        calibrate: bool,
        priors: Callable[[], Mapping[str, Sequence[float]]],
    ) -> Adjust | None:
        """A call's debias / calibration step (``calibration.adjuster``), None when it does neither;
        the priors are measured here, before this request's passes are counted.
        """
        calibration = self.calibration if calibrate else None
        return adjuster(calibration, names, self.debias if debias is None else debias, priors)

    def _prior(self, key: Any, read: Callable[[str], dict[str, list[float]]]) -> dict[str, tuple[float, ...]]:
        """The content-free priors under ``key``, measured (``debias.content_free_priors``) on a miss."""
        with self._lock:
            priors, _ = self._priors.get_or(key, lambda: content_free_priors(read))
            return priors

    def fill_many(self, schema: Any, texts: list[str], **keywords: Unpack[FillKeywords]) -> list[Extraction]:
        """Many inputs against one schema, read together (``batching.py``): one pass per wave for all
        of them, the answers of their solo calls. Every input is checked before any pass; a fill that
        generates open fields runs solo.
        """
        prepared = [self._plan_fill(schema, text, **keywords) for text in texts]
        use_cache = keywords.get("use_head_cache", True)
        batch = BatchRead(self.backend, self._head, self._lock, use_cache)
        # an input the batch cannot take is read alone from the plan made for it above
        return batch.fill_many(prepared, lambda k: self._read_fill(prepared[k], use_cache, time.perf_counter()))

    async def afill(self, schema: Any, text: str, **keywords: Unpack[FillKeywords]) -> Extraction:
        """``fill`` in a worker thread, so that the event loop keeps running while the model reads."""
        return await asyncio.to_thread(self.fill, schema, text, **keywords)

    async def afill_many(self, schema: Any, texts: list[str], **keywords: Unpack[FillKeywords]) -> list[Extraction]:
        return await asyncio.to_thread(self.fill_many, schema, texts, **keywords)

    # -- plain generation ---------------------------------------------------------------------
    def generate(
        self, messages: str | Sequence[Message], *, max_new_tokens: int = 256, stop: Sequence[str] = ()
    ) -> Generation:
        """A greedy reply to chat ``messages`` (``chatting.py``): text, finish reason and its ``Stats``."""
        result = Generation()
        for _ in self.stream(messages, max_new_tokens=max_new_tokens, stop=stop, result=result):
            pass
        return result

    def stream(
        self,
        messages: str | Sequence[Message],
        *,
        max_new_tokens: int = 256,
        stop: Sequence[str] = (),
        result: Generation | None = None,
    ) -> Iterator[str]:
        """The same reply as text deltas, as they are generated; pass ``result`` to read the text and
        the cost (``result.stats``, filled on the read path of ``fill`` and ``decide``: ``chatting.py``).
        """
        result = result if result is not None else Generation()
        yield from stream_reply(
            self.backend,
            self.tokenizer,
            self._head,
            self._lock,
            messages,
            max_new_tokens=max_new_tokens,
            stop=stop,
            result=result,
        )

    # -- questions ----------------------------------------------------------------------------
    def decide(
        self,
        state: Any,
        questions: dict[str, Any],
        *,
        context: Conversation | None = None,
        cache_key: str | None = None,
        debias: bool | None = None,
        calibrate: bool = True,
        order_samples: int | None = None,
    ) -> DecideResponse:
        """Jev-style questions over one state (``pcd_core/deciding.py``): the state is the trunk of
        every question's row, one pass warm. ``usage.input_tokens`` counts every token read: head,
        state and all rows. ``debias`` and ``calibrate`` are as in ``fill``; a calibration covers a
        question whose id and answer names (``true``/``false``, the options, the level indices) it
        was fitted on. ``order_samples`` K > 1 also reads K - 1 rotations of each choice's and score's
        options as more rows of the same pass and averages them (``DecidePlan.merged``); None takes the
        engine's default (``LoadOptions.order_samples``).

        ``context`` holds earlier turns and the caller's instructions (``conversation.py``). Its
        turns are cached with the head only when a ``cache_key`` is given (OpenAI's
        ``prompt_cache_key``): a caller that says it will come back with the same conversation.
        """
        started = time.perf_counter()
        # everything that needs no model runs before the lock, so concurrent requests overlap here
        keywords = DecideKeywords(
            context=context, cache_key=cache_key, order_samples=order_samples, debias=debias, calibrate=calibrate
        )
        return self._read_decide(self._plan_decide(state, questions, **keywords), started)

    def _read_decide(self, prepared: Prepared[DecidePlan], started: float) -> DecideResponse:
        """A prepared decide's pass, under the lock; ``started`` is when its call began."""
        plan, adjust, meter = prepared
        with self._lock.turn() as turn:
            decoded, warnings = plan.read(
                self.backend, self._head, meter, turn.pause, adjust is not None and adjust.reads_hidden
            )
        stats = replace(meter.stats, queue_ms=turn.queue_ms, total_ms=ms_since(started))
        readouts, spreads = plan.merged(list(decoded.readouts))
        return plan.respond(self.model_name, readouts, stats, warnings, adjust, spreads)

    def _plan_decide(
        self, state: Any, questions: dict[str, Any], **keywords: Unpack[DecideKeywords]
    ) -> Prepared[DecidePlan]:
        """A decide made ready before the lock: its plan, debias / calibration step and ``Meter``;
        ``keywords`` are ``decide``'s after the questions.
        """
        started = time.perf_counter()
        context, cache_key = keywords.get("context"), keywords.get("cache_key")
        order_samples = keywords.get("order_samples")
        order_samples = self.order_samples if order_samples is None else check_order_samples(order_samples)
        request = check_decide(self.limits, state, questions)  # bounds and readable text first
        if context:
            check_conversation(self.limits, context, request.state)
            prompt = render_decide_prompt(self.tokenizer, context)
        else:
            if self._decide_prompt is None:
                self._decide_prompt = render_decide_prompt(self.tokenizer)
            prompt = self._decide_prompt
        plan = plan_decide(
            self.tokenizer,
            prompt,
            request,
            self.context_length,
            self.limits,
            cache_turns=cache_key is not None,
            order_samples=order_samples,
        )
        names = {qid: asked.names for qid, asked in zip(request.questions, plan.asked)}
        priors = lambda: self.question_priors(request.questions)  # noqa: E731
        adjust = self._adjuster(names, keywords.get("debias"), keywords.get("calibrate", True), priors)
        return plan, adjust, Meter(Stats(compile_ms=ms_since(started)))

    def decide_many(
        self,
        states: Sequence[Any],
        questions: dict[str, Any],
        *,
        debias: bool | None = None,
        calibrate: bool = True,
        order_samples: int | None = None,
    ) -> list[DecideResponse]:
        """One question set over many states, read together (``batching.py``): one pass warm for all
        of them, each the answers of its own ``decide``. Every state is checked before any pass.
        """
        keywords = DecideKeywords(debias=debias, calibrate=calibrate, order_samples=order_samples)
        prepared = [self._plan_decide(state, questions, **keywords) for state in states]
        batch = BatchRead(self.backend, self._head, self._lock)
        # a state the batch cannot take is read alone from the plan made for it above
        return batch.decide_many(
            prepared, self.model_name, lambda k: self._read_decide(prepared[k], time.perf_counter())
        )

    async def adecide_many(
        self, states: Sequence[Any], questions: dict[str, Any], **keywords: Any
    ) -> list[DecideResponse]:
        """``decide_many`` in a worker thread."""
        return await asyncio.to_thread(self.decide_many, states, questions, **keywords)

    async def adecide(
        self, state: Any, questions: dict[str, Any], **keywords: Unpack[DecideKeywords]
    ) -> DecideResponse:
        """``decide`` in a worker thread, with the same keywords."""
        return await asyncio.to_thread(self.decide, state, questions, **keywords)

    def question_priors(self, questions: dict[str, Any]) -> dict[str, tuple[float, ...]]:
        """Per question (validated models, as ``DecideRequest.questions`` holds them), the mean answer
        distribution over the ``CONTENT_FREE`` states, cached by the question set; a noul's
        distribution is (true, false), the order its readout uses.
        """

        def read(text: str) -> dict[str, list[float]]:
            answers = self.decide(text, questions, debias=False, calibrate=False).answers
            return {qid: distribution(answers[qid]) for qid in questions}

        key = json.dumps({qid: q.model_dump() for qid, q in questions.items()}, sort_keys=True, default=repr)
        return self._prior(("decide", key), read)
