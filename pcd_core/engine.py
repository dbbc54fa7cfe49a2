"""``Engine``: caches, waves and timings around one backend; wiring only, no math.

A warm fill is two forward passes whatever the number of fields. The first reads the request (input
and tail) after the cached head as the *trunk* of a small tree that holds the first field's decision
points, so the first field is decided alone, in the pass that reads the request. The second reads
that field's chosen answer line as the trunk every other row hangs from: the line is written in
before the others are asked (seed 000), and read once, inside the packed pass. Each further
``depends_on`` wave is one more pass, its trunk the answer lines of the wave before. A cold fill adds
the head prefill. ``decide`` reads the state as the trunk of every question's row: one pass warm.
Both go through ``Engine._read``, which fills the same ``Stats``.

Compiled schemas and head KV live in small LRUs. One FIFO lock serialises model access, so threads
and async callers (``afill``, which runs in a worker thread) may share an engine; a request hands the
model to a waiting one at each pass boundary and comes back after it (``fairness.py``), and its
``Stats.queue_ms`` says how long it waited.
``tests/test_engine.py`` checks the pass counts, every ``Stats`` field and the equality with the
four-pass reading this replaced, on the real model.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .asking import render_decide_prompt
from .backends.base import Backend, Prefix
from .calibration import Calibration, adjuster
from .chatting import Generation, Message, as_messages, render_chat, stream_tokens
from .compiler import CompiledSchema, compile_schema
from .conversation import Conversation, check_conversation
from .debias import CONTENT_FREE, content_free_prior
from .deciding import plan_decide
from .decoding import DecisionTask, Decoded, DecodeOptions, RoundStats, decode
from .errors import OptionError, PromptError, ReplyTooLongError
from .fairness import ModelLock, no_pause
from .generation import MAX_ROOM, GeneratedField, GenerationStats, check_caps, generate_open_fields
from .grammar import GrammarTokenizer
from .limits import DEFAULT_LIMITS, Limits, check_decide, check_fill
from .models import load_backend
from .options import LoadOptions, load_options
from .prompt import PromptParts
from .questions import DecideResponse, distribution
from .result import Extraction, FieldResult, Stats, gather_memberships, mass_warnings
from .schema import open_waves, parse_schema
from .tokenizer import TextTokenizer

#: the warning of a request whose input merged with the head's last token
#: the most rotations of an option list one decide reads (each is one more row per question, same pass)
MAX_ORDER_SAMPLES = 8
BYPASSED = "the input merged with the cached head's last token; the whole prompt was read anew"


class _Lru(OrderedDict):
    """A small LRU with its own lock, so that it stays consistent when the model lock is off."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self._guard = threading.RLock()

    def get_or(self, key: Any, make: Callable[[], Any]) -> tuple[Any, bool]:
        with self._guard:
            if key in self:
                self.move_to_end(key)
                return self[key], True
            value = make()
            if self.size > 0:
                self[key] = value
                while len(self) > self.size:
                    self.popitem(last=False)
            return value, False


def schema_key(schema: Any) -> Any:
    if isinstance(schema, type):
        return schema
    return json.dumps(schema, sort_keys=True, default=repr)


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
    ) -> None:
        self.limits = limits  # per-request bounds, checked before any pass (pcd_core/limits.py)
        # trust (pcd_core/debias.py, pcd_core/calibration.py): per-schema content-free priors, fitted
        # calibration, and whether fill and decide debias when a call does not say
        self.calibration = calibration
        self.debias = debias
        self._priors = _Lru(schema_cache_size)
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        # model access, first come first served; a backend that batches concurrent calls itself
        # (vLLM) needs no lock
        self._lock = ModelLock(serialise=backend.serialises)
        self._compile_lock = threading.Lock()  # the compiled-schema LRU: compiling needs no model
        self._compiled = _Lru(schema_cache_size)
        self._heads = _Lru(head_cache_size)
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
            loaded, tokenizer, name, head_cache_size=chosen.head_cache_size, calibration=fitted, debias=chosen.debias
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

    def _head(self, head_ids: tuple[int, ...], use_cache: bool) -> tuple[Prefix, bool]:
        if not use_cache:
            return self.backend.prefill(head_ids), False
        return self._heads.get_or(head_ids, lambda: self.backend.prefill(head_ids))

    def warmup(self, schema: Any, task: str = "") -> Prefix:
        """Compile the schema and prefill its head, so that the first request is already warm.
        Returns the cached head, which token-by-token baselines continue from.
        """
        with self._lock:
            head, _ = self._head(self.compile(schema, task).head_ids, use_cache=True)
            return head

    # -- the one read path --------------------------------------------------------------------
    def _read(
        self,
        head_ids: tuple[int, ...],
        whole: tuple[int, ...],
        tasks: list[DecisionTask],
        stats: Stats,
        rounds: RoundStats,
        use_cache: bool = True,
        pause: Callable[[], None] = no_pause,
    ) -> tuple[Decoded, list[str]]:
        """Read a head and a request, with the first ``tasks``' rows in the request's pass.

        ``whole`` is the prompt up to the first rows, tokenized in one piece. The head comes from
        the cache (or is prefilled); the rest of ``whole`` is the trunk the rows hang from. When the
        request's first token merged with the head's last one, the cached head cannot be extended:
        nothing of it is used, and the whole prompt is the trunk. Fills the head and prefill fields
        of ``stats``; the caller holds the lock, whose ``pause`` it passes on, and calls ``_count``
        when its passes are done.
        """
        stats.row_layout = self.backend.row_layout
        clock = time.perf_counter()
        rest = after_head(whole, head_ids)
        head: Prefix | None = None
        warnings: list[str] = []
        if rest is None:
            stats.head_cache, stats.cached_tokens, trunk = "bypassed", 0, whole
            warnings.append(BYPASSED)
        else:
            head, hit = self._head(head_ids, use_cache)
            stats.head_cache, stats.cached_tokens = ("hit", len(head_ids)) if hit else ("miss", 0)
            if not hit and use_cache and self._heads.size > 0:  # prefilled now and kept for the next request
                stats.cache_write_tokens = len(head_ids)
            trunk = rest
        stats.head_ms = _ms(clock)
        clock = time.perf_counter()
        decoded = decode(self.backend, head, tasks, rounds, trunk=trunk, pause=pause)
        stats.prefill_ms = _ms(clock)
        stats.prompt_tokens = len(trunk)
        return decoded, warnings

    def _count(self, stats: Stats, rounds: RoundStats, passes_before: int, n_head: int) -> None:
        """The totals of a request, once its last pass is read (under the lock). Passes are counted
        per thread: other requests' passes run between this one's when it hands the model over.
        """
        stats.forward_passes = self.backend.counter.mine().forward_passes - passes_before
        stats.n_rows, stats.row_tokens, stats.rounds = rounds.n_rows, rounds.row_tokens, rounds.rounds
        # a bypassed head was read as part of the prompt, so it is in prompt_tokens already
        head_tokens = 0 if stats.head_cache == "bypassed" else n_head
        stats.input_tokens = head_tokens + stats.prompt_tokens + stats.row_tokens

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
    ) -> Extraction:
        """Decide every closed field of ``schema`` for ``text`` and generate every open one; see the
        module docstring for the cost, and ``generation.py`` for open fields (``max_new_tokens`` caps
        them per field).

        ``strategy="exact"`` is short for ``options=DecodeOptions(strategy="exact")`` (or overrides
        the given options' strategy). ``task`` is an instruction put into the prompt after the
        generic ones ("Triage the following support ticket."); each task text gets its own head.
        ``debias`` divides out the content-free prior (``debias.py``; measured once per schema, a few
        fills; None: the engine's default); ``calibrate`` applies the engine's fitted calibration where
        it covers a field.
        ``generate=False`` decides the closed fields only, on the same prompt (the value is then a dict).
        """
        parsed = parse_schema(schema)
        check_fill(self.limits, parsed, text)  # bounds and readable text first
        check_caps(parsed, max_new_tokens)
        options = _options(options, strategy)
        started = time.perf_counter()
        compiled = self.compile(schema, task)
        whole = self.request_ids(compiled, text)  # before the lock: no model needed, and a bad input costs none
        adjust = adjuster(  # the priors are measured before this request's passes are counted
            self.calibration if calibrate else None,
            {f.name: [label.text for label in f.labels] for f in compiled.schema.fields},
            self.debias if debias is None else debias,
            lambda: self.content_free_priors(schema, task),
        )
        stats = Stats(compile_ms=_ms(started))
        rounds = RoundStats()
        results: dict[str, FieldResult] = {}
        chosen: dict[str, int] = {}

        def record(wave_index: int, decoded: Decoded) -> None:
            names = compiled.waves[wave_index] if compiled.waves else ()  # no closed fields: no readouts
            for name, readout in zip(names, decoded.readouts):
                flags: dict[str, Any] = {}
                if adjust is not None:  # debiased / calibrated before the choice feeds a later wave
                    readout, flags = adjust(name, readout)
                chosen[name] = readout.best
                spec = compiled.schema.field(name)
                results[name] = FieldResult.from_readout(spec, readout, options.strategy, wave_index, **flags)

        with self._lock.turn() as turn:
            passes_before = self.backend.counter.mine().forward_passes
            decoded, warnings = self._read(
                compiled.head_ids, whole, self._tasks(compiled, 0, options), stats, rounds, use_head_cache, turn.pause
            )
            record(0, decoded)
            clock = time.perf_counter()
            for wave_index in range(1, len(compiled.waves)):
                turn.pause()
                # the previous wave's answer lines, in schema order, are the trunk of this wave's rows
                previous = set(compiled.waves[wave_index - 1])
                lines = [t for f in compiled.fields if f.name in previous for t in f.answer_ids[chosen[f.name]]]
                tasks = self._tasks(compiled, wave_index, options)
                decoded = decode(self.backend, decoded.prefix, tasks, rounds, trunk=lines, pause=turn.pause)
                stats.prompt_tokens += len(lines)
                record(wave_index, decoded)
            stats.decode_ms = _ms(clock)
            generated: dict[str, GeneratedField] = {}
            if compiled.open_rows and generate:
                clock = time.perf_counter()
                turn.pause()
                generated, open_warnings, open_stats = self._generate_open(
                    compiled, decoded.prefix, chosen, stats, max_new_tokens, turn.pause
                )
                warnings += open_warnings
                stats.generate_ms = _ms(clock)
            self._count(stats, rounds, passes_before, len(compiled.head_ids))
            if compiled.open_rows and generate:  # the open rows' tokens are row tokens too, read by grow
                stats.row_tokens += open_stats.row_tokens
                stats.input_tokens += open_stats.row_tokens
        stats.queue_ms = turn.queue_ms
        stats.total_ms = _ms(started)
        decided = {f.name: results[f.name] for f in compiled.schema.fields}
        everything: dict[str, Any] = {**decided, **gather_memberships(compiled.schema, decided), **generated}
        if compiled.open_rows and not generate:
            ordered = {name: everything[name] for name in compiled.schema.keys if name in everything}
            value: Any = {name: r.value for name, r in ordered.items()}
        else:
            ordered = {name: everything[name] for name in compiled.schema.keys}
            value = compiled.schema.rebuild({name: r.value for name, r in ordered.items()})
        return Extraction(value, ordered, stats, warnings + mass_warnings(decided))

    @staticmethod
    def _tasks(compiled: CompiledSchema, wave_index: int, options: DecodeOptions) -> list[DecisionTask]:
        if not compiled.waves:  # only open fields: the request is read with no rows
            return []
        return [DecisionTask(compiled.field(name).trie, options.strategy) for name in compiled.waves[wave_index]]

    def _generate_open(
        self,
        compiled: CompiledSchema,
        prefix: Prefix,
        chosen: dict[str, int],
        stats: Stats,
        max_new_tokens: dict[str, int] | None,
        pause: Callable[[], None],
    ) -> tuple[dict[str, GeneratedField], list[str], GenerationStats]:
        """Generate every open field; the first step also writes in the closed answers not yet in the prompt."""
        written = {name for wave in compiled.waves[:-1] for name in wave}
        lines = [t for f in compiled.fields if f.name not in written for t in f.answer_ids[chosen[f.name]]]
        stats.prompt_tokens += len(lines)
        open_stats = GenerationStats()
        generated, warnings = generate_open_fields(
            self.backend,
            self.grammar_tokenizer,
            prefix,
            compiled.open_rows,
            compiled.schema,
            open_stats,
            max_new_tokens,
            pause,
            written_in=tuple(lines),
        )
        stats.open_steps = open_stats.steps
        stats.output_tokens = sum(g.n_tokens for g in generated.values())
        return generated, warnings, open_stats

    def request_ids(self, compiled: CompiledSchema, text: str) -> tuple[int, ...]:
        """The whole prompt's ids, tokenized in one piece, after checking that it fits the context.
        ``pcd bench`` feeds its token-by-token baselines the same ids.
        """
        whole = self.tokenizer.encode_head(compiled.prompt.head + compiled.prompt.request_text(text))
        answers = sum(max(map(len, f.answer_ids)) for f in compiled.fields)
        budget = len(whole) + answers + max(compiled.max_variant_tokens, open_row_budget(compiled))
        if budget > self.context_length:
            raise PromptError(
                f"the input needs {budget} tokens with the schema, over the model's context of "
                f"{self.context_length}; shorten the input"
            )
        return whole

    # -- trust: debiasing and fitted calibration (the math is in debias.py and calibration.py) ----
    def content_free_priors(self, schema: Any, task: str = "") -> dict[str, tuple[float, ...]]:
        """Per closed field, the mean label distribution over the ``CONTENT_FREE`` inputs, read raw
        through the same prompt; measured once per schema and cached beside the compiled schema.
        """

        def measure() -> dict[str, tuple[float, ...]]:
            readings = [
                self.fill(schema, text, task=task, debias=False, calibrate=False, generate=False)
                for text in CONTENT_FREE
            ]
            decided = [name for name, r in readings[0].fields.items() if isinstance(r, FieldResult)]
            return {
                name: content_free_prior([list(r.fields[name].probabilities.values()) for r in readings])
                for name in decided
            }

        with self._lock:
            priors, _ = self._priors.get_or((schema_key(schema), task), measure)
            return priors

    def fill_many(self, schema: Any, texts: list[str], **options: Any) -> list[Extraction]:
        """Many inputs against one schema: the head is compiled and prefilled once for all of them."""
        self.warmup(schema, options.get("task", ""))
        return [self.fill(schema, text, **options) for text in texts]

    async def afill(self, schema: Any, text: str, **options: Any) -> Extraction:
        return await asyncio.to_thread(self.fill, schema, text, **options)

    async def afill_many(self, schema: Any, texts: list[str], **options: Any) -> list[Extraction]:
        return await asyncio.to_thread(self.fill_many, schema, texts, **options)

    # -- plain generation ---------------------------------------------------------------------
    def generate(
        self, messages: str | Sequence[Message], *, max_new_tokens: int = 256, stop: Sequence[str] = ()
    ) -> Generation:
        """A greedy reply to chat ``messages`` (``chatting.py``): text, finish reason and cost."""
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
        """The same reply as text deltas, as they are generated; pass ``result`` to read the cost."""
        result = result if result is not None else Generation()
        head_text, rest = render_chat(self.tokenizer, as_messages(messages))
        head_ids = self.tokenizer.encode_head(head_text)
        whole = self.tokenizer.encode_head(head_text + rest)
        if len(whole) + max_new_tokens > self.context_length:
            raise ReplyTooLongError(
                f"the messages take {len(whole)} tokens and up to {max_new_tokens} may be generated, over "
                f"the model's context of {self.context_length}; shorten them or lower max_new_tokens",
                prompt_tokens=len(whole),
                max_new_tokens=max_new_tokens,
                context_length=self.context_length,
            )
        with self._lock.turn() as turn:
            head, hit = self._heads.get_or(head_ids, lambda: self.backend.prefill(head_ids))
            after = after_head(whole, head_ids)
            # room for the reply behind the prompt's KV, so the steps write there instead of copying
            # it; a longer reply outgrows it and the backend's buffers grow
            room = min(max_new_tokens, MAX_ROOM)
            if after:
                prefix = self.backend.prefill(after, parent=head, room=room)
            else:
                prefix = self.backend.prefill(whole, room=room)
        result.forward_passes, result.queue_ms = (0 if hit else 1) + 1, turn.queue_ms
        result.input_tokens, result.cached_tokens = len(whole), len(head_ids) if hit and after else 0
        yield from stream_tokens(
            self.backend,
            self.tokenizer,
            prefix,
            max_new_tokens=max_new_tokens,
            stop=stop,
            lock=self._lock,
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
        order_samples: int = 1,
    ) -> DecideResponse:
        """Jev-style questions over one state (``pcd_core/deciding.py``): the state is the trunk of
        every question's row, one pass warm. ``usage.input_tokens`` counts every token read: head,
        state and all rows. ``debias`` and ``calibrate`` are as in ``fill``; a calibration covers a
        question whose id and answer names (``true``/``false``, the options, the level indices) it
        was fitted on. ``order_samples`` K > 1 also reads K - 1 rotations of each choice's and score's
        options as more rows of the same pass and averages them (``DecidePlan.merged``).

        ``context`` holds earlier turns and the caller's instructions (``conversation.py``). Its
        turns are cached with the head only when a ``cache_key`` is given (OpenAI's
        ``prompt_cache_key``): a caller that says it will come back with the same conversation.
        """
        started = time.perf_counter()
        if not 1 <= order_samples <= MAX_ORDER_SAMPLES:
            raise OptionError(f"order_samples must be 1 to {MAX_ORDER_SAMPLES}, not {order_samples!r}")
        # everything that needs no model runs before the lock, so concurrent requests overlap here
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
        adjust = adjuster(  # the priors are measured before this request's passes are counted
            self.calibration if calibrate else None,
            {qid: asked.names for qid, asked in zip(request.questions, plan.asked)},
            self.debias if debias is None else debias,
            lambda: self.question_priors(request.questions),
        )
        stats = Stats(compile_ms=_ms(started))
        rounds = RoundStats()
        with self._lock.turn() as turn:
            passes_before = self.backend.counter.mine().forward_passes
            decoded, warnings = self._read(plan.head_ids, plan.whole, plan.tasks(), stats, rounds, pause=turn.pause)
            self._count(stats, rounds, passes_before, len(plan.head_ids))
        stats.queue_ms = turn.queue_ms
        stats.total_ms = _ms(started)
        readouts, spreads = plan.merged(list(decoded.readouts))
        flags: list[dict[str, Any]] = [{} for _ in readouts]
        if adjust is not None:  # candidate mass stays raw
            adjusted = [adjust(qid, r) for qid, r in zip(request.questions, readouts)]
            readouts, flags = [r for r, _ in adjusted], [f for _, f in adjusted]
        return plan.respond(self.model_name, readouts, stats, warnings, flags, spreads)

    async def adecide(self, state: Any, questions: dict[str, Any], **options: Any) -> DecideResponse:
        """``decide`` in a worker thread; ``options`` are its ``debias`` and ``calibrate``."""
        return await asyncio.to_thread(self.decide, state, questions, **options)

    def question_priors(self, questions: dict[str, Any]) -> dict[str, tuple[float, ...]]:
        """Per question (validated models, as ``DecideRequest.questions`` holds them), the mean answer
        distribution over the ``CONTENT_FREE`` states, cached by the question set; a noul's
        distribution is (true, false), the order its readout uses.
        """

        def measure() -> dict[str, tuple[float, ...]]:
            readings = [self.decide(text, questions, debias=False, calibrate=False).answers for text in CONTENT_FREE]
            return {qid: content_free_prior([distribution(r[qid]) for r in readings]) for qid in questions}

        key = json.dumps({qid: q.model_dump() for qid, q in questions.items()}, sort_keys=True, default=repr)
        with self._lock:
            priors, _ = self._priors.get_or(("decide", key), measure)
            return priors


def open_row_budget(compiled: CompiledSchema) -> int:
    """Tokens the open rows may need past the closed answers: every wave but the last is written in
    whole, and the longest row of the last wave grows to its cap.
    """
    if not compiled.open_rows:
        return 0
    size = {row.field.name: len(row.opening) + row.field.max_new_tokens for row in compiled.open_rows}
    waves = open_waves(compiled.schema)
    return sum(size[n] for wave in waves[:-1] for n in wave) + max(size[n] for n in waves[-1])


def _options(options: DecodeOptions | None, strategy: str | None) -> DecodeOptions:
    """The call's options: the given ones (or the defaults), with ``strategy`` overriding theirs."""
    options = options if options is not None else DecodeOptions()
    return options if strategy is None else options.replace(strategy=strategy)


def after_head(whole: Sequence[int], head_ids: Sequence[int]) -> tuple[int, ...] | None:
    """The ids after ``head_ids`` when ``whole`` starts with them. None when the text after the head
    merged with the head's last token: the cached head cannot be extended, so all is read anew.
    """
    n_head = len(head_ids)
    if tuple(whole[:n_head]) != tuple(head_ids):
        return None
    return tuple(whole[n_head:])


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0
