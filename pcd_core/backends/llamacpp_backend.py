"""The llama.cpp backend: a GGUF read as it is, quantized kernels, packed rows as sequence sets.

Through ``llama-cpp-python``'s low-level API (the only module of pcd-engine that imports it). One
context with a unified KV cache (``kv_unified``) holds every prefix and every pass's rows; a KV cell
may belong to several sequences at once, so:

- a ``Prefix`` owns one sequence id whose cells are its tokens. A child prefix starts as a copy of
  its parent's sequence (``llama_memory_seq_cp`` only adds the id to the parent's cells: no KV is
  copied) and reads its own tokens into it, so the parent never changes and one cached head serves
  any number of requests;
- a packed pass is one ``llama_decode``: the prefix's cells are given to one sequence per leaf of
  the row tree, and the trunk and tree tokens get the sequence sets of ``seqsets.pass_layout``. The
  leaves' sequences are removed afterwards (``llama_memory_seq_rm``), which frees every row cell;
- ``grow`` keeps each generated row in a sequence of its own (``seqsets.grow_layout``), so a step
  reads only the new tokens, as the torch backend's arena does; ``grow_many`` puts several
  generations' steps end to end in one batch, each row still in its own sequence.

Sequence ids are bounded (``llama_max_parallel_sequences``, 256 in 0.3.36): ``MAX_ROWS_PER_PASS``
of them go to one pass's rows, and a call with more rows is split into passes; at most
``MAX_LIVE_PREFIXES`` prefixes keep their cells, the least recently used beyond that are evicted and
re-read from their ids when used again (counted as a pass), so nothing is refused and the KV cache
stays bounded. A prefix's sequence is freed when the ``Prefix`` is garbage-collected (a finalizer
queues it; the next call removes it, under the backend's lock, never inside another call).

The KV cache starts at ``START_CELLS`` cells (or the context's length, if shorter) and doubles, up to
the context's length, when one call needs more cells than are free after evicting every prefix it
does not read: llama.cpp cannot resize a context, so a new one takes its place, every prefix is read
again when next used and growing rows are read again whole at their next step. Memory follows use:
the cells a context holds are resident from its start (llama.cpp clears them), 180 MB for SmolLM2's
8,192.

A prompt's, a packed pass's or a re-read's ``llama_decode`` stops inside once the caller's
cancellation is set (``pass_stop.py``; ``llama_set_abort_callback``, bound here from the library), and
the sequences it wrote are dropped as after any failed pass; a generation's step runs to its end.

At load, packed rows are checked against each row read in a pass of its own in this backend; a
layout that differs by more than ``LAYOUT_TOLERANCE`` is refused (``BackendError``).

It is the only file that imports ``llama_cpp``. Which sequence ids are free, held, pinned by the
running call or evictable is kept by ``seqpool.SeqPool``; the batch layouts are ``seqsets.py``'s.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from pcd_core.backends.base import Backend, Growth, Prefix, Query, Rows
from pcd_core.backends.packing import TokenTree, pack_tree
from pcd_core.backends.pass_stop import StopSignal, watched
from pcd_core.backends.seqpool import Seq, SeqPool
from pcd_core.backends.seqsets import BatchLayout, grow_layout, leaves, pass_layout, pass_layout_for_prompt
from pcd_core.errors import BackendError, BackendUnavailableError, Cancelled, PromptError

try:
    import llama_cpp as llama
except ImportError as error:  # the extra is optional; say how to install it
    raise BackendUnavailableError("llamacpp", "llama_cpp") from error

logger = logging.getLogger(__name__)

#: sequence ids one pass's rows may take (a split beyond); the rest serve prefixes and generations
MAX_ROWS_PER_PASS = 128
#: prefixes whose cells stay in the KV cache; beyond, the least recently used is re-read when needed
MAX_LIVE_PREFIXES = 64
#: how far packed rows may differ from each row read alone, in log-probs (see ``_self_check``)
LAYOUT_TOLERANCE = 1e-3
#: the KV cells a context starts with; it doubles on demand up to the context's length (a fill of the
#: 28-field ticket with its cached head needs about 1,800; 4,096 cells of SmolLM2 are 90 MB)
START_CELLS = 4096

T = TypeVar("T")


class _ContextFull(Exception):
    """A pass found no room in a context that may still grow: ``_locked`` enlarges it and runs again."""


def _log_to_python(level: int, text: bytes, user_data: Any) -> None:
    logger.debug("llama.cpp: %s", text.decode("utf-8", errors="replace").rstrip())


# llama.cpp writes its load report to stderr unless told otherwise; the callback must stay referenced
_LOG_CALLBACK = llama.llama_log_callback(_log_to_python)
llama.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))

# ``llama_set_abort_callback`` is in the library but not in llama-cpp-python's bindings (0.3.36)
_set_abort_callback = llama.llama_cpp._lib.llama_set_abort_callback
_set_abort_callback.argtypes = [llama.llama_context_p_ctypes, llama.ggml_abort_callback, ctypes.c_void_p]
_set_abort_callback.restype = None
#: llama_decode's return code for a batch its abort callback stopped (llama.h)
DECODE_ABORTED = 2


@dataclass(eq=False)
class LlamaPrefixState:
    """A prefix's sequence (re-read from ``ids`` when evicted), and the logits and final hidden state
    after its last token. ``hidden`` is None when the pass that read the prefix computed no hidden
    states, ``logits`` when the prefix was cut from a longer one; ``_prefix_hidden`` and
    ``_prefix_logp`` fill them in on first need.
    """

    seq: Seq
    ids: tuple[int, ...]
    logits: np.ndarray | None
    hidden: np.ndarray | None


@dataclass(frozen=True)
class _Outputs:
    """What one ``llama_decode`` gave for its flagged batch entries, by batch index: the logits, and,
    when the pass computed them, the final hidden states (the context's per-token embeddings: after
    the output norm, the LM head's input).
    """

    logits: dict[int, np.ndarray]
    hidden: dict[int, np.ndarray]


@dataclass(frozen=True, eq=False)
class _RowSeqs:
    """The sequences of growing rows; ``written`` is how many tokens each holds after the prompt."""

    seqs: tuple[Seq, ...]
    written: list[int]


@dataclass(frozen=True, eq=False)
class LlamaRowsState:
    """One ``Rows``' view of its sequences: the row lengths it knows; older views copy before growing."""

    rows: _RowSeqs
    written: tuple[int, ...]


@dataclass(frozen=True)
class _Step:
    """One generation step made ready for a pass: its rows' sequences, its batch, and how many of
    each row's tokens it reads (every token of a row whose cells were lost, else the new ones).
    """

    group: _RowSeqs
    layout: BatchLayout
    reading: list[int]
    trunk_seq: int | None


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    values = logits.astype(np.float64)
    top = values.max()
    return values - top - np.log(np.exp(values - top).sum())


class LlamaCppBackend(Backend):
    """A GGUF model in llama.cpp behind the two primitives; rows are sequence sets in one batch."""

    name = "llamacpp"
    reads_hidden = True
    row_layout = "packed"
    compute_dtype = "gguf"
    # a batch of 32 three-field fills (two rounds each) ran at 0.71x the loop, eight concurrent
    # clients' such fills at 0.74x one client's rate: a request read again costs what it cost first
    batches_fills = False
    max_rows_per_pass = MAX_ROWS_PER_PASS
    mask_bytes_per_entry = 4  # llama.cpp's KQ mask is float32

    def __init__(
        self,
        path: str | Path,
        *,
        threads: int | None = None,
        n_ctx: int | None = None,
        start_cells: int | None = None,
        max_tokens_per_pass: int | None = None,
    ) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be positive, got {threads!r}")
        self.threads = threads or os.cpu_count() or 1
        self.path = Path(path)
        llama.llama_backend_init()
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = 0
        # No repacked weight layouts ("extra buffer types"): on CPUs with AMX tiles (Xeon Sapphire Rapids
        # and later) llama.cpp 0.3.36 moves Q4_1 weights into its AMX layout, whose matrix product
        # segfaults in ggml_backend_amx_mul_mat at the first decode (seen on this project's machines,
        # gdb backtrace); the plain quantized kernels read the same weights and give the same values.
        model_params.use_extra_bufts = False
        self._model = llama.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise BackendError(f"llama.cpp could not load {path}")
        trained = int(llama.llama_model_n_ctx_train(self._model))
        length = min(trained, n_ctx or 8192)
        super().__init__(context_length=length, max_tokens_per_pass=max_tokens_per_pass)
        self.n_seq_max = int(llama.llama_max_parallel_sequences())
        self.cells = min(length, start_cells or START_CELLS)
        try:
            self._ctx = self._new_context(self.cells)
        except BackendError:
            llama.llama_model_free(self._model)
            raise
        # the context and the model, freed together when the backend goes; _enlarge swaps the first
        self._handles = [self._ctx, self._model]
        # Per-token embeddings (the hidden states a trained head reads) are switched on only for the
        # passes that ask for them: with embeddings on, llama.cpp makes every token of a batch an
        # output (its batch allocator overrides the flags), which puts the LM head on every token and
        # grows the output buffer to the batch (a 1,400-token prompt: +318 MB resident on SmolLM2).
        self._embeddings = False
        self._n_embd = int(llama.llama_model_n_embd(self._model))
        self._memory = llama.llama_get_memory(self._ctx)
        self._vocab_p = llama.llama_model_get_vocab(self._model)
        self._vocab = int(llama.llama_vocab_n_tokens(self._vocab_p))
        n_layer, n_embd = int(llama.llama_model_n_layer(self._model)), int(llama.llama_model_n_embd(self._model))
        n_head, n_head_kv = int(llama.llama_model_n_head(self._model)), int(llama.llama_model_n_head_kv(self._model))
        self.kv_bytes_per_token = 2 * n_layer * (n_embd // n_head) * n_head_kv * 2  # f16 keys and values
        self._lock = threading.RLock()
        self.sequences = SeqPool(self.n_seq_max, MAX_LIVE_PREFIXES, self._remove_cells)
        self._row_groups: weakref.WeakSet[_RowSeqs] = weakref.WeakSet()  # to mark lost when the context grows
        weakref.finalize(self, _free_handles, self._handles)
        self.layout_error = self._self_check()
        if self.layout_error > LAYOUT_TOLERANCE:
            raise BackendError(
                f"packed rows differ from single rows by {self.layout_error:.2e} in llama.cpp "
                f"(bound {LAYOUT_TOLERANCE:.0e}): this build's sequence sets do not give the tree mask"
            )

    @property
    def vocab_size(self) -> int:
        return self._vocab

    # -- the context --------------------------------------------------------------------------
    def _new_context(self, cells: int) -> Any:
        params = llama.llama_context_default_params()
        params.n_ctx = cells
        params.n_batch = cells  # a pass is one llama_decode, however many tokens it packs
        params.n_seq_max = self.n_seq_max
        params.kv_unified = True  # one token in several sequences needs one shared cache
        # Where a read's cells lie in the cache moves its result (llama.cpp 0.3.36, SmolLM2 Q4_1,
        # one thread): with flash attention (the default, kept) a row placed in a freed hole
        # before its prefix's cells moved a probability by 0.019; without it, a 14-token prompt
        # read into cells 12-15 mod 16 moved one by 0.026 and strayed further from torch. Packing
        # itself is exact either way (the self-check reads 0.0); see LAYOUT_TOLERANCE.
        params.n_threads = params.n_threads_batch = self.threads
        ctx = llama.llama_init_from_model(self._model, params)
        if not ctx:
            raise BackendError(f"llama.cpp could not make a context of {cells} cells for {self.path}")
        return ctx

    def _enlarge(self) -> None:
        """Replace the context by one of twice the cells (up to ``context_length``), empty: every
        prefix is evicted (read again when used) and every group of growing rows lost (read again
        whole at its next step). The new context is made before the old one goes, so a failure
        leaves the backend as it was.
        """
        cells = min(2 * self.cells, self.context_length)
        ctx = self._new_context(cells)
        logger.info("llama.cpp: the KV cache grows from %d to %d cells", self.cells, cells)
        llama.llama_free(self._handles[0])
        self._ctx = self._handles[0] = ctx
        self._memory, self.cells, self._embeddings = llama.llama_get_memory(ctx), cells, False
        self.sequences.forget_all()
        for group in list(self._row_groups):
            for holder in group.seqs:
                holder.id = None

    def _locked(self, read: Callable[[], T]) -> T:
        """Run one hook's ``read`` under the lock, unpinning its sequences after; a read that finds the
        cache full with nothing left to evict runs again in an enlarged context.
        """
        with self._lock:
            while True:
                try:
                    return read()
                except _ContextFull:
                    self._enlarge()
                finally:
                    self.sequences.unpin_all()

    # -- sequences ----------------------------------------------------------------------------
    def _remove_cells(self, seq: int) -> None:
        """Remove a sequence's cells from the KV cache (the pool frees its id)."""
        llama.llama_memory_seq_rm(self._memory, seq, -1, -1)

    def _prefix_seq(self, prefix: Prefix | None) -> int | None:
        """The sequence of a prefix, pinned for this call; an evicted one is read again first."""
        if prefix is None:
            return None
        state: LlamaPrefixState = prefix.state
        if state.seq.id is None:  # evicted: read its ids again from scratch
            seq = self.sequences.take()
            try:
                self._decode(pass_layout_for_prompt(state.ids, seq), stoppable=True)
            except BaseException:
                self.sequences.drop(seq)
                raise
            self.counter.add(len(state.ids))
            state.seq.id = seq
            self.sequences.register(state.seq)
        return self.sequences.hold(state.seq)

    def _new_prefix(self, ids: tuple[int, ...], seq: int, out: _Outputs | None, index: int = -1) -> LlamaPrefixState:
        holder = Seq(seq)
        logits, hidden = (out.logits[index], out.hidden.get(index)) if out is not None else (None, None)
        state = LlamaPrefixState(holder, ids, logits, hidden)
        self.sequences.release_later(state, holder)
        self.sequences.register(holder)
        return state

    def _copy(self, source: int | None, target: int, end: int = -1) -> None:
        """Give ``target`` the cells of ``source`` (positions below ``end``): no KV is copied."""
        if source is not None:
            llama.llama_memory_seq_cp(self._memory, source, target, -1, end)

    # -- one batch ----------------------------------------------------------------------------
    def _decode(self, layout: BatchLayout, hidden: bool = False, stoppable: bool = False) -> _Outputs:
        """Run one batch; the logits of every flagged entry, by batch index, and their hidden states
        with ``hidden``.

        A ``stoppable`` batch (one whose every sequence its caller drops when it raises: a prompt's,
        a packed pass's rows and trunk, a re-read) stops inside ``llama_decode`` once the caller's
        cancellation is set (``pass_stop.watched``): llama.cpp's graph asks the abort callback
        between its nodes, returns ``DECODE_ABORTED`` and removes the cells of the micro-batch it
        stopped in; the caller's drop removes the rest. A generation's step is not stoppable: its
        rows' sequences continue in place from one step to the next.
        """
        signal = watched() if stoppable else None
        if signal is None:
            return self._decode_batch(layout, hidden)
        stop = llama.ggml_abort_callback(lambda _data: bool(signal.cancelled))
        _set_abort_callback(self._ctx, stop, None)
        try:
            return self._decode_batch(layout, hidden, signal)
        finally:
            _set_abort_callback(self._ctx, llama.ggml_abort_callback(), None)

    def _decode_batch(self, layout: BatchLayout, hidden: bool, signal: StopSignal | None = None) -> _Outputs:
        """``_decode``'s batch; with ``signal``, an aborted decode is its ``Cancelled``."""
        if hidden != self._embeddings:
            llama.llama_set_embeddings(self._ctx, hidden)
            self._embeddings = hidden
        n = len(layout.tokens)
        if n > self.cells:  # more tokens than the context has cells: llama.cpp would refuse the batch
            self._no_room()
        batch = llama.llama_batch_init(n, 0, layout.max_seqs_per_token)
        try:
            for i, (token, position, seqs, wanted) in enumerate(
                zip(layout.tokens, layout.positions, layout.seq_ids, layout.logits)
            ):
                batch.token[i] = token
                batch.pos[i] = position
                batch.n_seq_id[i] = len(seqs)
                row = batch.seq_id[i]
                for j, seq in enumerate(seqs):
                    row[j] = seq
                batch.logits[i] = wanted
            batch.n_tokens = n
            while (code := llama.llama_decode(self._ctx, batch)) == 1:  # no room in the KV cache
                if not self.sequences.evict_one():
                    self._no_room()
            if code == DECODE_ABORTED and signal is not None and signal.cancelled:
                raise Cancelled(f"{signal.reason}; the request's pass was stopped inside llama_decode")
            if code != 0:
                raise BackendError(f"llama_decode failed with code {code}")
            out = _Outputs({}, {})
            for i, wanted in enumerate(layout.logits):
                if wanted:
                    logits = llama.llama_get_logits_ith(self._ctx, i)
                    out.logits[i] = np.ctypeslib.as_array(logits, shape=(self._vocab,)).copy()
                    if hidden:
                        state = llama.llama_get_embeddings_ith(self._ctx, i)
                        out.hidden[i] = np.ctypeslib.as_array(state, shape=(self._n_embd,)).copy()
            return out
        finally:
            llama.llama_batch_free(batch)

    def _no_room(self) -> None:
        if self.cells < self.context_length:
            raise _ContextFull
        raise PromptError(
            f"llama.cpp's KV cache of {self.cells} cells is full: the prompt, the rows and the prefixes "
            "in use do not fit; pass n_ctx to the backend or ask less"
        )

    # -- the hooks ----------------------------------------------------------------------------
    def _prefill(self, ids: tuple[int, ...], parent: Prefix | None, room: int = 0) -> LlamaPrefixState:
        return self._locked(lambda: self._read_prompt(ids, parent, hidden=False))

    def _read_prompt(self, ids: tuple[int, ...], parent: Prefix | None, hidden: bool) -> LlamaPrefixState:
        source = self._prefix_seq(parent)
        seq = self.sequences.take()
        self._copy(source, seq)
        start = parent.n_tokens if parent is not None else 0
        try:
            out = self._decode(pass_layout_for_prompt(ids, seq, start), hidden, stoppable=True)
        except BaseException:
            self.sequences.drop(seq)
            raise
        whole = (parent.ids if parent is not None else ()) + ids
        return self._new_prefix(whole, seq, out, len(ids) - 1)

    def _prefill_hidden(self, ids: tuple[int, ...], parent: Prefix | None, room: int) -> LlamaPrefixState:
        return self._locked(lambda: self._read_prompt(ids, parent, hidden=True))

    def _score_chunk(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], LlamaPrefixState | None]:
        values, state, _ = self._locked(lambda: self._packed(prefix, trunk, tree, queries, hidden=False))
        return values, state

    def _score_chunk_hidden(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], LlamaPrefixState | None, list[np.ndarray]]:
        return self._locked(lambda: self._packed(prefix, trunk, tree, queries, hidden=True))

    def _packed(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query], hidden: bool
    ) -> tuple[list[np.ndarray], LlamaPrefixState | None, list[np.ndarray]]:
        source = self._prefix_seq(prefix)
        n_prefix = prefix.n_tokens if prefix is not None else 0
        trunk_seq = self.sequences.take() if trunk else None
        if trunk_seq is not None:
            self.sequences.pin(trunk_seq)
            self._copy(source, trunk_seq)
        leaf_seqs = []
        try:
            for _ in leaves(tree):
                seq = self.sequences.take()
                self.sequences.pin(seq)
                self._copy(source, seq)
                leaf_seqs.append(seq)
            nodes = [tree.node_of[q.row][q.position] for q in queries]
            layout = pass_layout(n_prefix, trunk, tree, leaf_seqs=leaf_seqs, trunk_seq=trunk_seq, read_nodes=nodes)
            out = self._decode(layout, hidden, stoppable=True)
        except BaseException:
            if trunk_seq is not None:
                self.sequences.drop(trunk_seq)
            raise
        finally:
            for seq in leaf_seqs:  # every row cell goes; the prefix's and the trunk's stay
                self.sequences.drop(seq)
        read = [len(trunk) + node for node in nodes]
        values = [_log_softmax(out.logits[i])[list(q.ids)] for i, q in zip(read, queries, strict=True)]
        state = None
        if trunk_seq is not None:
            ids = (prefix.ids if prefix is not None else ()) + trunk
            state = self._new_prefix(ids, trunk_seq, out, len(trunk) - 1)
        return values, state, [out.hidden[i] for i in read] if hidden else []

    def _cut(self, prefix: Prefix, n_tokens: int) -> Prefix:
        """A sequence of its own that shares the first ``n_tokens`` cells of ``prefix``'s (no KV is
        copied); the logits after its last token are read on first need.
        """
        return Prefix(ids=prefix.ids[:n_tokens], state=self._locked(lambda: self._cut_seq(prefix, n_tokens)))

    def _cut_seq(self, prefix: Prefix, n_tokens: int) -> LlamaPrefixState:
        source = self._prefix_seq(prefix)
        seq = self.sequences.take()
        self._copy(source, seq, n_tokens)
        return self._new_prefix(prefix.ids[:n_tokens], seq, None)

    def _prefix_logp(self, prefix: Prefix) -> np.ndarray:
        state: LlamaPrefixState = prefix.state
        if state.logits is None:
            state.logits, state.hidden = self._locked(lambda: self._reread_last(prefix))
        return _log_softmax(state.logits)

    def _prefix_hidden(self, prefix: Prefix) -> np.ndarray:
        """The stored hidden state, or, for a prefix read without one (``prefill`` not told that it
        would be asked), its last token read again at its position in a sequence of its own: one
        token, counted as a pass.
        """
        state: LlamaPrefixState = prefix.state
        if state.hidden is None:
            state.logits, state.hidden = self._locked(lambda: self._reread_last(prefix))
        return state.hidden

    def _reread_last(self, prefix: Prefix) -> tuple[np.ndarray, np.ndarray]:
        """The logits and hidden state after ``prefix``'s last token, read again in a sequence of its own."""
        source = self._prefix_seq(prefix)
        seq = self.sequences.take()
        try:
            last = prefix.n_tokens - 1
            self._copy(source, seq, last)
            out = self._decode(pass_layout_for_prompt(prefix.ids[last:], seq, last), hidden=True, stoppable=True)
            self.counter.add(1)
            return out.logits[0], out.hidden[0]
        finally:
            self.sequences.drop(seq)

    # -- growing rows (generation) -----------------------------------------------------------
    def _grow(
        self,
        prefix: Prefix,
        rows: Rows | None,
        extended: tuple[tuple[int, ...], ...],
        n_new: list[int],
        trunk: tuple[int, ...] = (),
        room: int = 0,
    ) -> Rows:
        """Read only each row's new tokens, each row in a sequence of its own that keeps its KV.

        A ``Rows`` grown a second time (not the latest view of its sequences) continues from copies
        of them cut at its own lengths, so an older ``Rows`` reads as it did. Rows that would need
        more sequences than are free fall back to the base class (each step re-reads the rows).
        """
        kept: LlamaRowsState | None = rows.state if rows is not None else None
        if (rows is not None and kept is None) or len(extended) > self.n_seq_max - MAX_LIVE_PREFIXES - 2:
            return super()._grow(prefix, rows, extended, n_new, trunk, room)
        growth = Growth(prefix, rows, extended, n_new)
        return self._locked(lambda: self._grow_seqs(growth, kept, trunk))

    def _grow_many(self, growths: list[Growth]) -> list[Rows]:
        """Several generations' steps in one ``llama_decode``: each step's batch as ``_grow`` lays it
        out, the batches end to end. Every step's rows are sequences of their own, so no step sees
        another's cells. Steps that ``_grow`` would not keep in sequences take one pass each.
        """
        rows_needed = sum(len(g.extended) for g in growths)
        kept = [g.rows.state if g.rows is not None else None for g in growths]
        if any(g.rows is not None and k is None for g, k in zip(growths, kept)) or (
            rows_needed > self.n_seq_max - MAX_LIVE_PREFIXES - 2
        ):
            return super()._grow_many(growths)
        return self._locked(lambda: self._grow_joined(growths, kept))

    def _grow_joined(self, growths: list[Growth], kept: list[LlamaRowsState | None]) -> list[Rows]:
        steps = [self._plan_step(growth, rows, ()) for growth, rows in zip(growths, kept)]
        joined = BatchLayout(
            tuple(t for step in steps for t in step.layout.tokens),
            tuple(p for step in steps for p in step.layout.positions),
            tuple(ids for step in steps for ids in step.layout.seq_ids),
            tuple(flag for step in steps for flag in step.layout.logits),
        )
        out = self._decode(joined)
        self.counter.add(len(joined.tokens))
        results, offset = [], 0
        for growth, step in zip(growths, steps):
            results.append(self._read_step(growth, (), step, out, offset))
            offset += len(step.layout.tokens)
        return results

    def _grow_seqs(self, growth: Growth, kept: LlamaRowsState | None, trunk: tuple[int, ...]) -> Rows:
        step = self._plan_step(growth, kept, trunk)
        out = self._decode(step.layout)
        self.counter.add(len(step.layout.tokens))
        return self._read_step(growth, trunk, step, out, 0)

    def _plan_step(self, growth: Growth, kept: LlamaRowsState | None, trunk: tuple[int, ...]) -> _Step:
        """A step's sequences (the rows' own, continued or fresh) and its batch; ``kept`` is the
        backend's state of ``growth``'s rows.
        """
        prefix, extended, n_new = growth.prefix, growth.extended, growth.n_new
        source = self._prefix_seq(prefix)
        base = prefix.n_tokens + len(trunk)
        reading = list(n_new)
        if kept is not None and any(holder.id is None for holder in kept.rows.seqs):
            # the context grew since the last step and its cells are gone: read every row whole again
            kept, reading = None, [len(row) for row in extended]
        written = [len(row) - n for row, n in zip(extended, reading)]
        trunk_seq = None
        if kept is not None and list(kept.written) == kept.rows.written:
            group = kept.rows  # the latest view: the rows' sequences continue in place
        else:
            group = self._row_group(source, kept, base, len(extended))
        if trunk:
            trunk_seq = self.sequences.take()
            self._copy(source, trunk_seq)
        seqs = [holder.id for holder in group.seqs]
        assert all(seq is not None for seq in seqs), "growing rows never lose their sequences"
        new = [row[len(row) - n :] for row, n in zip(extended, reading)]
        layout = grow_layout(base, trunk, [int(s or 0) for s in seqs], written, new, trunk_seq=trunk_seq)
        return _Step(group, layout, reading, trunk_seq)

    def _read_step(self, growth: Growth, trunk: tuple[int, ...], step: _Step, out: _Outputs, offset: int) -> Rows:
        """A step's ``Rows`` from the pass's outputs; its batch starts at ``offset`` in that pass."""
        prefix, extended, n_new = growth.prefix, growth.extended, growth.n_new
        group = step.group
        group.written[:] = [len(row) for row in extended]
        end_of_step = offset + len(step.layout.tokens)
        ends = iter(sorted(index for index in out.logits if offset + len(trunk) <= index < end_of_step))
        by_row: list[np.ndarray | None] = [None] * len(extended)
        for k, n in enumerate(step.reading):
            if n:
                end = next(ends)
                if n_new[k]:  # a row read again without a new token reports none, as the contract says
                    by_row[k] = _log_softmax(out.logits[end])
        if step.trunk_seq is not None:
            state = self._new_prefix(prefix.ids + trunk, step.trunk_seq, out, offset + len(trunk) - 1)
            prefix = Prefix(ids=prefix.ids + trunk, state=state)
        return Rows(prefix, extended, tuple(by_row), LlamaRowsState(group, tuple(group.written)))

    def _row_group(self, source: int | None, kept: LlamaRowsState | None, base: int, n_rows: int) -> _RowSeqs:
        """Fresh sequences for rows: copies of the prefix, or of older rows cut at their lengths."""
        holders = []
        for k in range(n_rows):
            seq = self.sequences.take()
            self.sequences.pin(seq)
            if kept is None:
                self._copy(source, seq)
            else:
                self._copy(kept.rows.seqs[k].id, seq, base + kept.written[k])
            holders.append(Seq(seq))
        group = _RowSeqs(tuple(holders), list(kept.written) if kept is not None else [0] * n_rows)
        for holder in holders:
            self.sequences.release_later(group, holder)
        self._row_groups.add(group)
        return group

    def live_sequences(self) -> dict[int, int]:
        """Every sequence id that holds KV cells, with its last position (``llama_memory_seq_pos_max``)."""
        with self._lock:
            self.sequences.drain()
            ends = {seq: int(llama.llama_memory_seq_pos_max(self._memory, seq)) for seq in range(self.n_seq_max)}
        return {seq: end for seq, end in ends.items() if end >= 0}

    # -- vocabulary and self-check -------------------------------------------------------------
    def token_text(self, token: int) -> str:
        """The token's text as the GGUF stores it (byte-level BPE spelling), for the vocabulary check."""
        return llama.llama_vocab_get_text(self._vocab_p, token).decode("utf-8", errors="replace")

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokenization of plain text (no special tokens parsed, none added)."""
        data = text.encode("utf-8")
        buffer = (llama.llama_token * (len(data) + 8))()
        n = llama.llama_tokenize(self._vocab_p, data, len(data), buffer, len(buffer), False, False)
        if n < 0:
            raise BackendError(f"llama.cpp could not tokenize {text[:40]!r}")
        return list(buffer[:n])

    def _self_check(self) -> float:
        """Max |log-prob| gap between rows packed in one pass (after a prefix and a trunk) and each row
        read on its own after the same prefix, as a plain continuation of its sequence (``prefill``, not
        the packed layout). A wrong sequence set or position moves log-probs by more than 1; on SmolLM2
        Q4_1 and Gemma 3 Q4_K_M the two agree to 0.0.

        Both sides read the prefix in the same chunk: llama.cpp's K-quant kernels give results that
        depend on how many tokens a pass reads (Gemma's Q4_K_M, the whole prompt in one pass against
        six tokens and then the rest: 2.7 in the log-prob of an improbable token), which is a property
        of the kernels, not of the layout; the agreement with torch on real schemas bounds it
        (``tests/test_llamacpp_backend.py``).
        """
        vocab = self._vocab
        prompt = tuple((7 * i + 3) % vocab for i in range(1, 12))
        rows = [tuple((11 * i + 5) % vocab for i in range(1, 6)), tuple((13 * i + 1) % vocab for i in range(1, 4))]
        rows.append(rows[0][:2] + rows[1])  # shares a start with the first row: a deeper tree
        ids = tuple(range(0, vocab, max(1, vocab // 64)))
        saved = self.counter.forward_passes, self.counter.tokens_read
        try:
            prefix = self.prefill(prompt[:6])
            alone = [self.next_logp(self.prefill(prompt[6:] + row, parent=prefix))[list(ids)] for row in rows]
            queries = [Query(r, len(row) - 1, ids) for r, row in enumerate(rows)]
            packed, _ = self._score_chunk(prefix, prompt[6:], pack_tree(rows), queries)
        finally:
            self.counter.forward_passes, self.counter.tokens_read = saved
        return max(float(np.max(np.abs(a - p))) for a, p in zip(alone, packed, strict=True))


def _free_handles(handles: list[Any]) -> None:
    """Free a backend's context and model (``[context, model]``), when the backend goes."""
    llama.llama_free(handles[0])
    llama.llama_model_free(handles[1])
