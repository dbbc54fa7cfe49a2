"""``Engine``: caches, waves and timings around one backend; wiring only, no math.

A warm fill is four forward passes: the request prefill on the cached head, the first field alone,
its answer line, and one packed pass for every other field (``depends_on`` adds two passes per extra
wave). A cold fill adds the head prefill. Compiled schemas and head KV live in small LRUs. One lock
serialises model access, so threads and async callers (``afill``, which runs in a worker thread) may
share an engine. ``tests/test_engine.py`` checks the pass counts and the cache on the real model.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .asking import as_text, ask, render_decide_prompt
from .backends.base import Backend, Prefix
from .calibration import Calibration
from .compiler import CompiledSchema, compile_schema
from .debias import CONTENT_FREE, content_free_prior, debiased
from .decoding import DecisionTask, RoundStats, check_strategy, decode
from .errors import PromptError
from .models import DEFAULT_MODEL, load_backend
from .prompt import PromptParts, normalise_input
from .questions import DecideRequest, DecideResponse, NoulAnswer, Usage
from .readout import Readout
from .result import Extraction, FieldResult, Stats, mass_warnings
from .schema import parse_schema
from .tokenizer import TextTokenizer


class _Lru(OrderedDict):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def get_or(self, key: Any, make) -> tuple[Any, bool]:
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
        calibration: Calibration | None = None,
    ) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._lock = threading.RLock()  # model access and the head LRU
        self._compile_lock = threading.Lock()  # the compiled-schema LRU: compiling needs no model
        self._compiled = _Lru(schema_cache_size)
        self._heads = _Lru(head_cache_size)
        self._decide_prompt: PromptParts | None = None
        # trust (pcd_core/debias.py, pcd_core/calibration.py): per-schema content-free priors, fitted calibration
        self.calibration = calibration
        self._priors = _Lru(schema_cache_size)

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
        calibration: str | Path | Calibration | None = None,
    ) -> Engine:
        """``calibration``: a file written by ``pcd calibrate`` (or a ``Calibration``), applied to the
        fields it was fitted on; read before the model loads, so a bad file costs no load.
        """
        fitted = Calibration.load(calibration) if isinstance(calibration, (str, Path)) else calibration
        loaded, tokenizer, name = load_backend(model, backend, device, dtype, max_tokens_per_pass, row_layout)
        return cls(loaded, tokenizer, name, head_cache_size=head_cache_size, calibration=fitted)

    @property
    def context_length(self) -> int:
        return self.backend.context_length

    # -- compile and cache --------------------------------------------------------------------
    def compile(self, schema: Any) -> CompiledSchema:
        with self._compile_lock:
            compiled, _ = self._compiled.get_or(
                schema_key(schema), lambda: compile_schema(parse_schema(schema), self.tokenizer)
            )
            return compiled

    def _head(self, compiled: CompiledSchema, use_cache: bool) -> tuple[Prefix, bool]:
        if not use_cache:
            return self.backend.prefill(compiled.head_ids), False
        return self._heads.get_or(compiled.head_ids, lambda: self.backend.prefill(compiled.head_ids))

    def warmup(self, schema: Any) -> Prefix:
        """Compile the schema and prefill its head, so that the first request is already warm.
        Returns the cached head, which token-by-token baselines continue from.
        """
        with self._lock:
            head, _ = self._head(self.compile(schema), use_cache=True)
            return head

    # -- fill ---------------------------------------------------------------------------------
    def fill(
        self,
        schema: Any,
        text: str,
        *,
        strategy: str = "trie",
        use_head_cache: bool = True,
        debias: bool = False,
        calibrate: bool = True,
    ) -> Extraction:
        """Decide every field of ``schema`` for ``text``; see the module docstring for the cost.
        ``debias`` divides out the content-free prior (pcd_core/debias.py; measured once per schema, a
        few fills); ``calibrate`` applies the engine's fitted calibration where it covers a field.
        """
        check_strategy(strategy)
        started = time.perf_counter()
        compiled = self.compile(schema)
        whole = self.request_ids(compiled, text)  # before the lock: no model needed, and a bad input costs none
        adjust = self._adjuster(schema, compiled, debias, calibrate)  # trust: before the passes are counted
        stats = Stats(compile_ms=_ms(started))
        with self._lock:
            stats.row_layout = self.backend.row_layout
            passes_before = self.backend.forward_passes
            clock = time.perf_counter()
            head, hit = self._head(compiled, use_head_cache)
            stats.head_ms, stats.head_cache = _ms(clock), "hit" if hit else "miss"
            clock = time.perf_counter()
            prefix, warnings = self._request_prefix(compiled, head, whole, stats)
            stats.prefill_ms = _ms(clock)
            clock = time.perf_counter()
            results = self._decide_waves(compiled, prefix, strategy, stats, adjust)
            stats.decode_ms = _ms(clock)
            stats.forward_passes = self.backend.forward_passes - passes_before
        # a bypassed head was read as part of the prompt, so it is in prompt_tokens already
        head_tokens = 0 if stats.head_cache == "bypassed" else len(compiled.head_ids)
        stats.input_tokens = head_tokens + stats.prompt_tokens + stats.row_tokens
        stats.total_ms = _ms(started)
        ordered = {f.name: results[f.name] for f in compiled.schema.fields}
        value = compiled.schema.rebuild({name: r.value for name, r in ordered.items()})
        return Extraction(value, ordered, stats, warnings + mass_warnings(ordered))

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

    def _request_prefix(
        self, compiled: CompiledSchema, head: Prefix, whole: tuple[int, ...], stats: Stats
    ) -> tuple[Prefix, list[str]]:
        """Read the input and the tail after the head, checking the seam in context."""
        rest = after_head(whole, compiled.head_ids)
        if rest is not None:
            stats.cached_tokens = len(compiled.head_ids) if stats.head_cache == "hit" else 0
            stats.prompt_tokens = len(rest)
            return self.backend.prefill(rest, parent=head), []
        stats.head_cache, stats.prompt_tokens = "bypassed", len(whole)
        return self.backend.prefill(whole), ["the input merged with the cached head; the head was re-read"]

    def _decide_waves(
        self, compiled: CompiledSchema, prefix: Prefix, strategy: str, stats: Stats, adjust: _Adjust | None = None
    ) -> dict[str, FieldResult]:
        results: dict[str, FieldResult] = {}
        chosen: dict[str, int] = {}
        rounds = RoundStats()
        for wave_index, wave in enumerate(compiled.waves):
            if wave_index:
                # the previous wave's answers are written into the prompt, in schema order
                previous = set(compiled.waves[wave_index - 1])
                ids = [t for f in compiled.fields if f.name in previous for t in f.answer_ids[chosen[f.name]]]
                prefix = self.backend.prefill(ids, parent=prefix)
                stats.prompt_tokens += len(ids)
            tasks = [DecisionTask(compiled.field(name).trie, strategy) for name in wave]
            for name, readout in zip(wave, decode(self.backend, prefix, tasks, rounds)):
                flags: dict[str, bool] = {}
                if adjust is not None:  # trust: debiased / calibrated before the choice feeds a later wave
                    readout, flags = adjust(name, readout)
                chosen[name] = readout.best
                results[name] = FieldResult.from_readout(
                    compiled.schema.field(name), readout, strategy, wave_index, **flags
                )
        stats.n_rows, stats.row_tokens, stats.rounds = rounds.n_rows, rounds.row_tokens, rounds.rounds
        return results

    # -- trust: debiasing and fitted calibration (the math is in pcd_core/debias.py and calibration.py)
    def content_free_priors(self, schema: Any) -> dict[str, tuple[float, ...]]:
        """Per field, the mean label distribution over the ``CONTENT_FREE`` inputs, read raw through
        the same prompt; measured once per schema and cached beside the compiled schema.
        """

        def measure() -> dict[str, tuple[float, ...]]:
            readings = [self.fill(schema, text, calibrate=False) for text in CONTENT_FREE]
            return {
                name: content_free_prior([list(r.fields[name].probabilities.values()) for r in readings])
                for name in readings[0].fields
            }

        with self._lock:
            priors, _ = self._priors.get_or(schema_key(schema), measure)
            return priors

    def _adjuster(self, schema: Any, compiled: CompiledSchema, debias: bool, calibrate: bool) -> _Adjust | None:
        """The per-field readout transform of one fill, or None when it leaves every field raw. A field
        the calibration covers is debiased exactly when the calibration was fitted on debiased answers.
        """
        fitted = self.calibration if calibrate else None
        covered = {
            f.name: fitted.for_field(f.name, [label.text for label in f.labels]) if fitted else None
            for f in compiled.schema.fields
        }
        use_prior = {name: (fitted.debias if fitted and found else debias) for name, found in covered.items()}
        if not any(use_prior.values()) and not any(covered.values()):
            return None
        priors = self.content_free_priors(schema) if any(use_prior.values()) else {}

        def adjust(name: str, readout: Readout) -> tuple[Readout, dict[str, bool]]:
            if use_prior[name]:
                readout = debiased(readout, priors[name])
            calibration = covered[name]
            if calibration is not None:
                readout = calibration.apply(readout)
            return readout, {"debiased": use_prior[name], "calibrated": calibration is not None}

        return adjust

    def fill_many(self, schema: Any, texts: list[str], **options: Any) -> list[Extraction]:
        """Many inputs against one schema: the head is compiled and prefilled once for all of them."""
        self.warmup(schema)
        return [self.fill(schema, text, **options) for text in texts]

    async def afill(self, schema: Any, text: str, **options: Any) -> Extraction:
        return await asyncio.to_thread(self.fill, schema, text, **options)

    async def afill_many(self, schema: Any, texts: list[str], **options: Any) -> list[Extraction]:
        return await asyncio.to_thread(self.fill_many, schema, texts, **options)

    # -- questions ----------------------------------------------------------------------------
    def decide(self, state: Any, questions: dict[str, Any], *, debias: bool = False) -> DecideResponse:
        """Jev-style questions over one state: one state prefill, then every question's row in one
        packed pass. ``usage.input_tokens`` counts every token read: head, state and all rows.
        ``debias`` divides out each question's content-free prior (measured once per question set).
        """
        request = DecideRequest(state=state, questions=questions)
        priors = self._decide_priors(request) if debias else None  # trust: before the passes are counted
        # everything that needs no model runs before the lock, so concurrent requests overlap here
        if self._decide_prompt is None:
            self._decide_prompt = render_decide_prompt(self.tokenizer)
        prompt = self._decide_prompt
        head_ids = self.tokenizer.encode_head(prompt.head)
        state_text = prompt.head + normalise_input(as_text(request.state))
        whole = self.tokenizer.encode_head(state_text)
        asked = [ask(self.tokenizer, prompt, state_text, q, qid) for qid, q in request.questions.items()]
        longest = max(max(len(v.ids) for v in a.trie.variants) for a in asked)
        if len(whole) + longest > self.context_length:
            raise PromptError(
                f"the state and its longest question need {len(whole) + longest} tokens, over the "
                f"model's context of {self.context_length}; shorten the state"
            )
        stats = Stats()
        rounds = RoundStats()
        with self._lock:
            passes_before = self.backend.forward_passes
            stats.row_layout = self.backend.row_layout
            head, hit = self._heads.get_or(head_ids, lambda: self.backend.prefill(head_ids))
            rest = after_head(whole, head_ids)
            if rest is not None:
                prefix = self.backend.prefill(rest, parent=head)
            else:
                prefix, stats.head_cache = self.backend.prefill(whole), "bypassed"
            tasks = [DecisionTask(a.trie, "trie", branch_norm=a.branch_norm) for a in asked]
            readouts = decode(self.backend, prefix, tasks, rounds)
            stats.forward_passes = self.backend.forward_passes - passes_before
        stats.n_rows, stats.row_tokens, stats.rounds = rounds.n_rows, rounds.row_tokens, rounds.rounds
        stats.prompt_tokens, stats.cached_tokens = len(whole) - len(head_ids), len(head_ids) if hit else 0
        if priors is not None:  # trust: candidate mass stays raw
            readouts = [debiased(r, priors[qid]) for qid, r in zip(request.questions, readouts)]
        answers = {qid: a.answer(r) for qid, a, r in zip(request.questions, asked, readouts)}
        stats.input_tokens = len(whole) + rounds.row_tokens
        usage = Usage(input_tokens=stats.input_tokens)
        return DecideResponse(model=self.model_name, answers=answers, usage=usage, stats=stats)

    async def adecide(self, state: Any, questions: dict[str, Any], *, debias: bool = False) -> DecideResponse:
        return await asyncio.to_thread(self.decide, state, questions, debias=debias)

    def _decide_priors(self, request: DecideRequest) -> dict[str, tuple[float, ...]]:
        """Per question, the mean answer distribution over the ``CONTENT_FREE`` states, cached by the
        question set; a noul's distribution is (true, false), the order its readout uses.
        """
        questions = dict(request.questions)

        def measure() -> dict[str, tuple[float, ...]]:
            readings = [self.decide(text, questions).answers for text in CONTENT_FREE]
            return {qid: content_free_prior([_distribution(r[qid]) for r in readings]) for qid in questions}

        key = json.dumps({qid: q.model_dump() for qid, q in questions.items()}, sort_keys=True, default=repr)
        with self._lock:
            priors, _ = self._priors.get_or(("decide", key), measure)
            return priors


_Adjust = Callable[[str, Readout], tuple[Readout, dict[str, bool]]]


def _distribution(answer: Any) -> list[float]:
    if isinstance(answer, NoulAnswer):
        return [answer.noul, 1.0 - answer.noul]
    return list(answer.probabilities.values())


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
