"""``Engine``: caches, waves and timings around one backend; wiring only, no math.

A warm fill is two forward passes whatever the number of fields. The first reads the request (input
and tail) after the cached head as the *trunk* of a small tree that holds the first field's decision
points, so the first field is decided alone, in the pass that reads the request. The second reads
that field's chosen answer line as the trunk every other row hangs from: the line is written in
before the others are asked (seed 000), and read once, inside the packed pass. Each further
``depends_on`` wave is one more pass, its trunk the answer lines of the wave before. A cold fill adds
the head prefill. ``decide`` reads the state as the trunk of every question's row: one pass warm.
Both go through ``Engine._read``, which fills the same ``Stats``.

Compiled schemas and head KV live in small LRUs. One lock serialises model access, so threads and
async callers (``afill``, which runs in a worker thread) may share an engine.
``tests/test_engine.py`` checks the pass counts, every ``Stats`` field and the equality with the
four-pass reading this replaced, on the real model.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .asking import render_decide_prompt
from .backends.base import Backend, Prefix
from .compiler import CompiledSchema, compile_schema
from .deciding import plan_decide
from .decoding import DecisionTask, Decoded, DecodeOptions, RoundStats, decode
from .errors import PromptError
from .models import DEFAULT_MODEL, load_backend
from .prompt import PromptParts
from .questions import DecideResponse
from .result import Extraction, FieldResult, Stats, mass_warnings
from .schema import parse_schema
from .tokenizer import TextTokenizer

#: the warning of a request whose input merged with the head's last token
BYPASSED = "the input merged with the cached head's last token; the whole prompt was read anew"


class _Lru(OrderedDict):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def get_or(self, key: Any, make: Callable[[], Any]) -> tuple[Any, bool]:
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
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._lock = threading.RLock()  # model access and the head LRU
        self._compile_lock = threading.Lock()  # the compiled-schema LRU: compiling needs no model
        self._compiled = _Lru(schema_cache_size)
        self._heads = _Lru(head_cache_size)
        self._decide_prompt: PromptParts | None = None

    @classmethod
    def load(
        cls,
        model: str = DEFAULT_MODEL,
        backend: str = "torch",
        device: str | None = None,
        dtype: str | None = None,
        max_tokens_per_pass: int | None = None,
        row_layout: str = "auto",
        head_cache_size: int = 8,
        max_pass_bytes: int | None = None,
    ) -> Engine:
        """Load a model. ``max_tokens_per_pass`` (default 4096 row tokens) and ``max_pass_bytes``
        (default 2 GiB of estimated KV and masks per pass) bound memory; see ``backends/base.py``.
        """
        loaded, tokenizer, name = load_backend(model, backend, device, dtype, max_tokens_per_pass, row_layout)
        if max_pass_bytes is not None:
            loaded.max_pass_bytes = max_pass_bytes
        return cls(loaded, tokenizer, name, head_cache_size=head_cache_size)

    @property
    def context_length(self) -> int:
        return self.backend.context_length

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
    ) -> tuple[Decoded, list[str]]:
        """Read a head and a request, with the first ``tasks``' rows in the request's pass.

        ``whole`` is the prompt up to the first rows, tokenized in one piece. The head comes from
        the cache (or is prefilled); the rest of ``whole`` is the trunk the rows hang from. When the
        request's first token merged with the head's last one, the cached head cannot be extended:
        nothing of it is used, and the whole prompt is the trunk. Fills the head and prefill fields
        of ``stats``; the caller holds the lock and calls ``_count`` when its passes are done.
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
            trunk = rest
        stats.head_ms = _ms(clock)
        clock = time.perf_counter()
        decoded = decode(self.backend, head, tasks, rounds, trunk=trunk)
        stats.prefill_ms = _ms(clock)
        stats.prompt_tokens = len(trunk)
        return decoded, warnings

    def _count(self, stats: Stats, rounds: RoundStats, passes_before: int, n_head: int) -> None:
        """The totals of a request, once its last pass is read (under the lock)."""
        stats.forward_passes = self.backend.forward_passes - passes_before
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
    ) -> Extraction:
        """Decide every field of ``schema`` for ``text``; see the module docstring for the cost.

        ``strategy="exact"`` is short for ``options=DecodeOptions(strategy="exact")`` (or overrides
        the given options' strategy). ``task`` is an instruction put into the prompt after the
        generic ones ("Triage the following support ticket."); each task text gets its own head.
        """
        options = _options(options, strategy)
        started = time.perf_counter()
        compiled = self.compile(schema, task)
        whole = self.request_ids(compiled, text)  # before the lock: no model needed, and a bad input costs none
        stats = Stats(compile_ms=_ms(started))
        rounds = RoundStats()
        results: dict[str, FieldResult] = {}
        chosen: dict[str, int] = {}

        def record(wave_index: int, decoded: Decoded) -> None:
            for name, readout in zip(compiled.waves[wave_index], decoded.readouts):
                chosen[name] = readout.best
                spec = compiled.schema.field(name)
                results[name] = FieldResult.from_readout(spec, readout, options.strategy, wave_index)

        with self._lock:
            passes_before = self.backend.forward_passes
            decoded, warnings = self._read(
                compiled.head_ids, whole, self._tasks(compiled, 0, options), stats, rounds, use_head_cache
            )
            record(0, decoded)
            clock = time.perf_counter()
            for wave_index in range(1, len(compiled.waves)):
                # the previous wave's answer lines, in schema order, are the trunk of this wave's rows
                previous = set(compiled.waves[wave_index - 1])
                lines = [t for f in compiled.fields if f.name in previous for t in f.answer_ids[chosen[f.name]]]
                tasks = self._tasks(compiled, wave_index, options)
                decoded = decode(self.backend, decoded.prefix, tasks, rounds, trunk=lines)
                stats.prompt_tokens += len(lines)
                record(wave_index, decoded)
            stats.decode_ms = _ms(clock)
            self._count(stats, rounds, passes_before, len(compiled.head_ids))
        stats.total_ms = _ms(started)
        ordered = {f.name: results[f.name] for f in compiled.schema.fields}
        value = compiled.schema.rebuild({name: r.value for name, r in ordered.items()})
        return Extraction(value, ordered, stats, warnings + mass_warnings(ordered))

    @staticmethod
    def _tasks(compiled: CompiledSchema, wave_index: int, options: DecodeOptions) -> list[DecisionTask]:
        return [DecisionTask(compiled.field(name).trie, options.strategy) for name in compiled.waves[wave_index]]

    def request_ids(self, compiled: CompiledSchema, text: str) -> tuple[int, ...]:
        """The whole prompt's ids, tokenized in one piece, after checking that it fits the context.
        ``pcd bench`` feeds its token-by-token baselines the same ids.
        """
        whole = self.tokenizer.encode_head(compiled.prompt.head + compiled.prompt.request_text(text))
        answers = sum(max(map(len, f.answer_ids)) for f in compiled.fields)
        budget = len(whole) + answers + compiled.max_variant_tokens
        if budget > self.context_length:
            raise PromptError(
                f"the input needs {budget} tokens with the schema, over the model's context of "
                f"{self.context_length}; shorten the input"
            )
        return whole

    def fill_many(self, schema: Any, texts: list[str], **options: Any) -> list[Extraction]:
        """Many inputs against one schema: the head is compiled and prefilled once for all of them."""
        self.warmup(schema, options.get("task", ""))
        return [self.fill(schema, text, **options) for text in texts]

    async def afill(self, schema: Any, text: str, **options: Any) -> Extraction:
        return await asyncio.to_thread(self.fill, schema, text, **options)

    async def afill_many(self, schema: Any, texts: list[str], **options: Any) -> list[Extraction]:
        return await asyncio.to_thread(self.fill_many, schema, texts, **options)

    # -- questions ----------------------------------------------------------------------------
    def decide(self, state: Any, questions: dict[str, Any]) -> DecideResponse:
        """Jev-style questions over one state (``pcd_core/deciding.py``): the state is the trunk of
        every question's row, one pass warm. ``usage.input_tokens`` counts every token read: head,
        state and all rows.
        """
        started = time.perf_counter()
        # everything that needs no model runs before the lock, so concurrent requests overlap here
        if self._decide_prompt is None:
            self._decide_prompt = render_decide_prompt(self.tokenizer)
        plan = plan_decide(self.tokenizer, self._decide_prompt, state, questions, self.context_length)
        stats = Stats(compile_ms=_ms(started))
        rounds = RoundStats()
        with self._lock:
            passes_before = self.backend.forward_passes
            decoded, warnings = self._read(plan.head_ids, plan.whole, plan.tasks(), stats, rounds)
            self._count(stats, rounds, passes_before, len(plan.head_ids))
        stats.total_ms = _ms(started)
        return plan.respond(self.model_name, decoded.readouts, stats, warnings)

    async def adecide(self, state: Any, questions: dict[str, Any]) -> DecideResponse:
        return await asyncio.to_thread(self.decide, state, questions)


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
