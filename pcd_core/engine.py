"""``Engine``: one loaded model behind ``fill``, ``decide``, sessions and plain generation; wiring only.

A request is checked and planned before it holds the model (``planning/planner.py``); the engine
holds the model side as one record (``reading/loaded_model.py``: backend, tokenizer, head KV cache,
model lock, step join). A warm fill is two forward passes whatever the number of fields, plus one
per further ``depends_on`` wave (``planning/filling.py``); a warm decide is one
(``planning/deciding.py``); ``fill_many`` / ``decide_many`` read a batch in those passes
(``planning/batching.py``). Every prompt, a chat reply's included, is read through
``reading/read_path.py`` into one ``Stats`` (``cost.py``). One FIFO lock serialises model access,
handed to a waiting request at each pass boundary (``concurrency/model_lock.py``), so threads and
async callers may share an engine; concurrent replies' steps, concurrent decides over one head and
concurrent closed fills of one schema are read together in shared passes
(``concurrency/pass_join.py``). ``tests/test_engine.py`` checks the pass counts and every ``Stats``
field on the real model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, Unpack

from pcd_core.backends.base import Backend, Prefix
from pcd_core.concurrency.model_lock import in_thread
from pcd_core.concurrency.session_memory import SessionMemory
from pcd_core.loading.load import load_backend
from pcd_core.loading.options import LoadOptions, load_options
from pcd_core.planning.deciding import DecideKeywords
from pcd_core.planning.filling import FillKeywords
from pcd_core.planning.plan_reads import PlanReads
from pcd_core.planning.planner import Planner, PlannerSettings, PriorRead, questions_key, schema_key
from pcd_core.prompting.compiler import CompiledSchema
from pcd_core.reading.chatting import Message, stream_reply
from pcd_core.reading.loaded_model import LoadedModel
from pcd_core.reading.rounds import DecodeOptions
from pcd_core.request.conversation import Conversation
from pcd_core.request.questions import DecideResponse, distribution
from pcd_core.result import Extraction, FieldResult, Generation
from pcd_core.sessions.session import Session, open_session
from pcd_core.tokenizer import TextTokenizer


class Engine:
    """One loaded model behind ``fill`` (schemas) and ``decide`` (Jev-style questions)."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: TextTokenizer,
        model_name: str,
        *,
        head_cache_size: int = 8,
        max_sessions: int = 64,
        max_session_tokens: int | None = None,
        **settings: Unpack[PlannerSettings],
    ) -> None:
        if (calibration := settings.get("calibration")) is not None:  # another model's heads, or no states
            calibration.check_heads(model_name, backend.name, backend.reads_hidden, backend.hidden_parts)
        self.model = LoadedModel.build(backend, tokenizer, head_cache_size)
        self.model_name = model_name
        self.planner = Planner(tokenizer, backend.context_length, **settings)
        # which sessions keep their KV (session_memory.py); each session's prompt is at most this long
        self.sessions = SessionMemory(max_sessions, max_session_tokens)
        self.reads = PlanReads(self.model, model_name)  # alone, joined with waiting callers, or batched

    @classmethod
    def load(cls, options: LoadOptions | str | None = None, /, **keywords: Any) -> Engine:
        """Load a model as a ``LoadOptions`` says (``options.py``), or as keywords that build or
        override one (``Engine.load("smollm2-135m", backend="llamacpp")``); all checked before it loads.
        """
        chosen = load_options(options, **keywords)
        fitted = chosen.fitted_calibration()
        loaded, tokenizer, name = load_backend(chosen)
        return cls(
            loaded,
            tokenizer,
            name,
            head_cache_size=chosen.head_cache_size,
            max_sessions=chosen.max_sessions,
            max_session_tokens=chosen.max_session_tokens,
            calibration=fitted,
            debias=chosen.debias,
            order_samples=chosen.order_samples,
        )

    @property
    def backend(self) -> Backend:
        return self.model.backend

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.model.tokenizer

    @property
    def waiting(self) -> int:
        """Requests queued for the model now, behind the one that holds it (``concurrency/model_lock.py``)."""
        return self.model.lock.waiting

    @property
    def context_length(self) -> int:
        return self.backend.context_length

    # -- compile and cache --------------------------------------------------------------------
    def compile(self, schema: Any, task: str = "") -> CompiledSchema:
        """Compile once per (schema, task); ``task`` is a sentence put after the instructions."""
        return self.planner.compile(schema, task)

    def request_ids(self, compiled: CompiledSchema, text: str) -> tuple[int, ...]:
        """The whole prompt's ids, checked against the context; ``pcd bench``'s baselines read them too."""
        return self.planner.request_ids(compiled, text)

    def warmup(self, schema: Any, task: str = "") -> Prefix:
        """Compile the schema and prefill its head, so that the first request is already warm.
        Returns the cached head, which token-by-token baselines continue from.
        """
        with self.model.lock:
            head, _, _ = self.model.head(self.compile(schema, task).head_ids, use_cache=True)
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
        fence_nonce: str | None = None,
    ) -> Extraction:
        """Decide every closed field of ``schema`` for ``text`` and generate every open one: the
        module docstring says the cost, ``filling.py`` the plan, ``FillKeywords`` each keyword.
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
            fence_nonce=fence_nonce,
        )
        prepared = self.planner.fill(schema, text, keywords, self.content_free_priors)
        return self.reads.fill(prepared, use_head_cache, started)

    def fill_many(self, schema: Any, texts: list[str], **keywords: Unpack[FillKeywords]) -> list[Extraction]:
        """Many inputs against one schema, read together (``batching.py``): one pass per wave for all
        of them, the answers of their solo calls. Every input is checked before any pass; a fill that
        generates open fields runs solo.
        """
        prepared = [self.planner.fill(schema, text, keywords, self.content_free_priors) for text in texts]
        return self.reads.fill_many(prepared, keywords.get("use_head_cache", True))

    async def afill(self, schema: Any, text: str, **keywords: Unpack[FillKeywords]) -> Extraction:
        """``fill`` in a worker thread, so that the event loop keeps running while the model reads."""
        return await in_thread(self.fill, schema, text, **keywords)

    async def afill_many(self, schema: Any, texts: list[str], **keywords: Unpack[FillKeywords]) -> list[Extraction]:
        return await in_thread(self.fill_many, schema, texts, **keywords)

    # -- sessions -----------------------------------------------------------------------------
    def session(self, schema_or_questions: Any, *, keep_last_tokens: int | None = None, **keywords: Any) -> Session:
        """A conversation whose ``append(text, role=...)`` returns the result of ``fill`` (a schema) or
        ``decide`` (a question set) for the whole conversation so far, reading only the new turn, the
        tail and the rows (``session.py``). ``keywords`` are that call's (``FillKeywords`` or
        ``DecideKeywords``); ``keep_last_tokens=N`` drops whole early turns to keep N tokens of
        conversation, where by default a conversation over the context is a ``SessionOverflowError``.
        """
        return open_session(self, schema_or_questions, keywords, keep_last_tokens)

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
        yield from stream_reply(self.model, messages, max_new_tokens=max_new_tokens, stop=stop, result=result)

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
        fence_nonce: str | None = None,
    ) -> DecideResponse:
        """Jev-style questions over one state (``deciding.py``): the state is the trunk of every
        question's row, one pass warm; ``usage.input_tokens`` counts every token read (head, state,
        rows). ``DecideKeywords`` says what each keyword does.
        """
        started = time.perf_counter()
        keywords = DecideKeywords(
            context=context,
            cache_key=cache_key,
            order_samples=order_samples,
            debias=debias,
            calibrate=calibrate,
            fence_nonce=fence_nonce,
        )
        return self.reads.decide(self.planner.decide(state, questions, keywords, self.question_priors), started)

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
        prepared = [self.planner.decide(state, questions, keywords, self.question_priors) for state in states]
        return self.reads.decide_many(prepared)

    async def adecide(
        self, state: Any, questions: dict[str, Any], **keywords: Unpack[DecideKeywords]
    ) -> DecideResponse:
        """``decide`` in a worker thread, with the same keywords."""
        return await in_thread(self.decide, state, questions, **keywords)

    async def adecide_many(
        self, states: Sequence[Any], questions: dict[str, Any], **keywords: Any
    ) -> list[DecideResponse]:
        """``decide_many`` in a worker thread."""
        return await in_thread(self.decide_many, states, questions, **keywords)

    # -- content-free priors, for debiasing (measured once per schema or question set) --------
    def content_free_priors(self, schema: Any, task: str = "") -> dict[str, tuple[float, ...]]:
        """Per closed field, the mean label distribution over the ``CONTENT_FREE`` inputs, read raw
        through the same prompt (``debias.py``).
        """

        def read(text: str) -> dict[str, list[float]]:
            fields = self.fill(schema, text, task=task, debias=False, calibrate=False, generate=False).fields
            return {name: list(r.probabilities.values()) for name, r in fields.items() if isinstance(r, FieldResult)}

        return self._priors((schema_key(schema), task), read)

    def question_priors(
        self, questions: dict[str, Any], order_samples: int | None = None
    ) -> dict[str, tuple[float, ...]]:
        """Per question (validated models, as ``DecideRequest.questions`` holds them), the mean answer
        distribution over the ``CONTENT_FREE`` states; a noul's is (true, false), its readout's order.
        Read in ``order_samples`` orders (None: the engine's default, as ``decide``), as the answers it
        debiases: K = 3 averages out most of the first-listed lean that a one-order prior carries, and
        dividing by that prior would over-correct.
        """
        samples = self.planner.order_samples if order_samples is None else order_samples

        def read(text: str) -> dict[str, list[float]]:
            answers = self.decide(text, questions, debias=False, calibrate=False, order_samples=samples).answers
            return {qid: distribution(answers[qid]) for qid in questions}

        return self._priors(("decide", questions_key(questions), samples), read)

    def _priors(self, key: Any, read: PriorRead) -> dict[str, tuple[float, ...]]:
        with self.model.lock:  # one measurement per key, however many callers ask at once
            return self.planner.priors(key, read)
