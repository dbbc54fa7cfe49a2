"""The backend contract: two primitives, and everything a backend shares.

A backend knows nothing about schemas, labels or JSON. It offers:

``prefill(ids, parent=None) -> Prefix``
    Reads ``ids`` after ``parent`` (or from scratch) and returns a new, immutable ``Prefix``.
    The parent is never modified, so one cached head can serve any number of requests.

``score(prefix, rows, queries, trunk=(), pause=None) -> Scored``
    Reads the *trunk* tokens right after ``prefix`` (``prefix`` may be None when the trunk is the
    whole prompt), then hangs every row from the trunk's end: each row token sees the prefix, the
    whole trunk and the earlier tokens of its own row, never another row. The trunk is the common
    root of the packed tree, so one pass reads a request together with its first decision points,
    or an answer line together with every row asked after it. Each ``Query(row, position, ids)``
    returns the full-vocabulary log-softmax after token ``rows[row][position]`` (``position == -1``
    means after the trunk's last token, or the prefix's when there is no trunk), gathered at
    ``ids``, as float64: ``Scored.values``, one array per query. ``Scored.prefix`` is the prefix
    extended by the trunk, its KV kept as ``prefill(trunk, parent=prefix)`` would return it (to
    float rounding), so that the next pass continues from it; with no trunk it is ``prefix`` itself. Neither the
    given prefix nor any row is kept. ``pause`` is called between two passes of one call (chunks,
    below): the engine hands the model to a waiting request there (``pcd_core/concurrency/model_lock.py``).

``grow(prefix, rows, new) -> Rows``
    The generation primitive: every open row gets its new tokens in ONE forward pass, each row seeing
    the prefix and its own earlier tokens, and the full-vocabulary log-softmax after each extended row
    comes back. Rows never see each other and the prefix is never modified. The base class implements
    it with ``score`` (every row re-read whole, one pass per call); a backend that keeps the rows' KV
    (torch) reads only the new tokens. ``check_backend`` proves both agree with plain prefills.

``grow_many(steps) -> list[Rows]``
    The steps of several generations, each after its own prefix (a ``GrowStep``: a prefix, its
    rows, their new tokens), read in ONE forward pass where the backend can join them (torch's
    packed layout, llama.cpp): each row sees its own prefix and its own row only, so each result is
    its own ``grow``'s. This is how concurrent replies share a pass (``pcd_core/concurrency/pass_join.py``): a
    step of one token is dominated by reading the weights, which a joined pass reads once. The base
    class runs the steps one ``grow`` after another.

``cut(prefix, n_tokens)`` gives the first ``n_tokens`` of a prefix as a prefix of their own, over the
same KV where the backend can; a session keeps its conversation so (``pcd_core/sessions/session.py``).

``next_logp(prefix)``, the full-vocabulary log-softmax after a prefix, exists for token-by-token
baselines; the engine needs a whole vocabulary only for generated rows.

Memory is bounded by two settings. ``max_tokens_per_pass`` (default 4096) is the number of distinct
row tokens read in one forward pass beyond the start its rows all share (``plan_chunks``): the base
class splits rows into such chunks (whole rows, never a row across two chunks), so chunking cannot
change a result, only the number of passes; the trunk goes with the first chunk and later chunks
hang from the extended prefix. ``max_pass_bytes`` (default
2 GiB) caps one pass's estimated KV and attention-mask bytes: a call whose pass would need more is
refused with ``PromptError`` before any pass runs, instead of building an n-by-n mask that does not
fit. Each pass's rows reach the backend as one ``TokenTree``, rows that start alike merged, so that
their shared tokens are read once; ``tokens_read`` counts those distinct tokens plus the trunk,
and ``counter.mine()`` what the calling thread read. Every pass is counted in ``forward_passes``; `pcd_core.testing.check_backend` proves the rest of the
contract for any backend, a trunk equal to a prefill followed by a score included.

The contract is read in this file (``STYLE.md`` section 1); how rows are grouped into passes and
merged into one pass's tree is in ``packing.py``, the pass counter in ``counting.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar

import numpy as np

from pcd_core.backends import model_thread
from pcd_core.backends.counting import PassCounter
from pcd_core.backends.packing import TokenTree, pack_tree, plan_chunks
from pcd_core.errors import BackendError, HiddenStatesUnavailableError, PromptError

_T = TypeVar("_T")

#: how a backend's rows share the prefix (``Stats.row_layout`` reports it)
RowLayout = Literal["packed", "copies"]
#: what a load may ask for: a layout, or "auto" for the torch backend's self-check to choose
LayoutChoice = Literal["auto", "packed", "copies"]


@dataclass(frozen=True)
class Query:
    """Which log-probs to read: after token ``position`` of row ``row``, at token ``ids``."""

    row: int
    position: int
    ids: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Prefix:
    """An immutable read prompt: its token ids and the backend's state for them (KV, last hidden)."""

    ids: tuple[int, ...]
    state: Any = field(repr=False)

    @property
    def n_tokens(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, eq=False)
class Scored:
    """What ``Backend.score`` returns: one log-prob array per query, and the prefix extended by the
    trunk (the given prefix when there was none), from which the next pass continues.
    """

    values: list[np.ndarray]
    prefix: Prefix
    #: with ``score(..., hidden=True)``: the state at each query's position, read in the same pass as
    #: its log-probs, the parts of ``Backend.hidden_parts`` joined end to end
    hidden: list[np.ndarray] | None = None


def cut_states(states: tuple[int, Any, Any] | None, n_tokens: int) -> tuple[int, Any, Any] | None:
    """The per-token states a cut to ``n_tokens`` keeps, from those a pass kept (where it began
    reading, its final states, its middle states): None when the cut does not end inside them. The
    torch and MLX backends take a cut's last states from here (``_cut``).
    """
    if states is None:
        return None
    start, hidden, middle = states
    if not start < n_tokens <= start + len(hidden):
        return None
    end = n_tokens - start
    return start, hidden[:end], middle[:end]


#: row tokens per forward pass when the caller sets no limit: a few thousand rows' worth of masks
DEFAULT_MAX_TOKENS_PER_PASS = 4096
#: estimated KV and mask bytes one pass may need before ``score`` refuses it
DEFAULT_MAX_PASS_BYTES = 2 * 2**30

#: the hidden parts of a backend that gives the final state alone, and what a head or an answers-file
#: line saved before there were parts read
FINAL_STATE: tuple[str, ...] = ("final",)

#: the band of depth whose layer outputs the ``middle`` hidden part averages. A probe on SmolLM2-135M's
#: polarity states (1,000 train / 1,000 held out, docs/heads.md) read 0.753 from the final state and
#: 0.805 from this band's mean; single layers in the band read 0.778 to 0.820, and the layer just below
#: it 0.685. The band is fixed by depth so it means the same on any model, and its mean does not hang
#: on picking one layer well
MIDDLE_BAND = (0.5, 0.75)


def middle_layers(n_layers: int) -> range:
    """The 0-based indices of the layers whose outputs make the ``middle`` hidden part: those whose
    1-based number lies in ``MIDDLE_BAND`` of ``n_layers`` (layers 15 to 22 of SmolLM2's 30).
    """
    low, high = MIDDLE_BAND
    return range(max(1, round(low * n_layers)) - 1, max(1, int(high * n_layers)))


@dataclass(frozen=True, eq=False)
class Rows:
    """Rows growing after one prefix: each row's ids so far, the log-probs after each row's last token
    (``None`` for a row that got no token in the last pass), and the backend's state for the rows.
    """

    prefix: Prefix
    ids: tuple[tuple[int, ...], ...]
    logp: tuple[np.ndarray | None, ...]
    state: Any = field(default=None, repr=False)


@dataclass(frozen=True, eq=False)
class GrowStep:
    """One generation's step for ``Backend.grow_many``: ``grow(prefix, rows, new)``'s arguments."""

    prefix: Prefix
    rows: Rows | None
    new: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, eq=False)
class Growth:
    """A checked ``GrowStep`` as the ``_grow`` hooks take it: every row extended, and how many of each
    row's tokens are new.
    """

    prefix: Prefix
    rows: Rows | None
    extended: tuple[tuple[int, ...], ...]
    n_new: list[int]


def new_tokens(extended: tuple[tuple[int, ...], ...], n_new: list[int]) -> tuple[list[int], list[int], list[int]]:
    """A step's new tokens in row order: each one's row, its depth in the row, and the token (the
    backends that keep the rows' KV read only these).
    """
    owner, depth, tokens = [], [], []
    for k, (row, n) in enumerate(zip(extended, n_new)):
        for j in range(len(row) - n, len(row)):
            owner.append(k)
            depth.append(j)
            tokens.append(row[j])
    return owner, depth, tokens


class Backend(ABC):
    """A loaded causal LM behind the two primitives. Subclasses implement the underscored hooks."""

    #: short name used in stats and errors ("torch", "mlx", "oracle")
    name: str = "backend"
    #: how rows share the prefix: "packed" (one sequence, tree mask) or "copies" (a KV copy per row)
    row_layout: RowLayout = "packed"
    #: whether model access must be serialised: true for an in-process model; a remote server that
    #: batches concurrent requests itself (vLLM) sets it false, so the engine takes no lock around it
    serialises: bool = True
    #: bytes of keys and values per token over all layers; the memory estimate of a pass reads it
    kv_bytes_per_token: int = 0
    #: bytes per (query, key) entry of the attention masks a pass builds
    mask_bytes_per_entry: int = 1
    #: rows one pass may hold, where a backend bounds them (llama.cpp: a sequence id per row); a call
    #: with more is split into passes, as ``max_tokens_per_pass`` splits it
    max_rows_per_pass: int | None = None
    #: whether ``score(..., hidden=True)`` works: the backend overrides ``_score_chunk_hidden`` and
    #: ``_prefix_hidden``
    reads_hidden: bool = False
    #: whether many inputs' fills read in shared passes (``pcd_core/planning/batching.py``), where each request
    #: is read again in every round after its first, beat reading them one by one; false where a pass
    #: costs its tokens and little else (llama.cpp: docs/benchmarks.md), so its fills run one by one
    batches_fills: bool = True
    #: the end of the sentence that refuses ``hidden`` on a backend without it
    hidden_unavailable_because: str = "does not expose hidden states"
    #: what a hidden state holds, in order, each of the model's hidden size: ``final`` (after the last
    #: norm, the LM head's input) and, where the backend runs the layers itself, ``middle`` (the mean
    #: of the outputs of ``middle_layers``). A trained head reads a leading run of them
    hidden_parts: tuple[str, ...] = FINAL_STATE
    #: what the model computes in, for every result's ``stats.dtype``: torch's dtype, ``gguf`` where
    #: the backend computes in the file's own quantized types (llama.cpp), empty where it is not known
    #: here (a vLLM server's)
    compute_dtype: str = ""

    def __init__(
        self,
        *,
        context_length: int,
        max_tokens_per_pass: int | None = None,
        max_pass_bytes: int | None = None,
    ) -> None:
        for name, value in (("max_tokens_per_pass", max_tokens_per_pass), ("max_pass_bytes", max_pass_bytes)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be positive, got {value!r}")
        self.context_length = context_length
        self.max_tokens_per_pass: int | None = max_tokens_per_pass or DEFAULT_MAX_TOKENS_PER_PASS
        self.max_pass_bytes: int | None = max_pass_bytes or DEFAULT_MAX_PASS_BYTES
        self.counter = PassCounter()

    @property
    def forward_passes(self) -> int:
        return self.counter.forward_passes

    @property
    def packs_trunk(self) -> bool:
        """Whether ``_score_chunk`` reads a trunk in its own pass; if not, ``score`` prefills it first."""
        return self.row_layout == "packed"

    # -- the contract -------------------------------------------------------------------------
    def prefill(
        self, ids: Sequence[int], parent: Prefix | None = None, *, room: int = 0, hidden: bool = False
    ) -> Prefix:
        """Read ``ids`` after ``parent``. ``room`` is a hint: about how many tokens a ``grow`` after
        this prefix will write, which a backend may reserve behind the prefix's state so that the
        generation never copies it (the torch backend does); it never changes a result. ``hidden``
        says that the hidden state after the last token will be asked for (``score(..., hidden=True)``
        with a query there): a backend that computes hidden states only on request (llama.cpp) then
        computes it in this pass instead of reading the last token again later.
        """
        ids = tuple(int(i) for i in ids)
        if not ids:
            raise BackendError("prefill needs at least one token")
        start = parent.n_tokens if parent is not None else 0
        if start + len(ids) > self.context_length:
            raise PromptError(f"{start + len(ids)} tokens do not fit the model's context of {self.context_length}")
        if room < 0:
            raise BackendError(f"room must be 0 or more tokens, got {room}")
        self.counter.add(len(ids))
        read = self._prefill_hidden if hidden else self._prefill
        state = self._on_model_thread(lambda: read(ids, parent, room))
        return Prefix(ids=(parent.ids if parent is not None else ()) + ids, state=state)

    def score(
        self,
        prefix: Prefix | None,
        rows: Sequence[Sequence[int]],
        queries: Sequence[Query],
        trunk: Sequence[int] = (),
        pause: Callable[[], None] | None = None,
        hidden: bool = False,
    ) -> Scored:
        """Log-probs at each query; with ``hidden``, also the hidden state there (``hidden_parts``; a
        trained head reads it: ``pcd_core/trust/heads.py``), from the same passes. A backend that cannot expose hidden
        states refuses ``hidden`` with ``HiddenStatesUnavailableError`` before any pass.
        """
        if hidden and not self.reads_hidden:
            raise HiddenStatesUnavailableError(f"the {self.name} backend {self.hidden_unavailable_because}")
        given: list[tuple[int, ...]] = [tuple(int(i) for i in row) for row in rows]
        trunk = tuple(int(i) for i in trunk)
        if (prefix is None or prefix.n_tokens == 0) and not trunk:
            raise BackendError("score needs a non-empty prefix or a trunk")
        self._check_queries(given, queries)
        start = (prefix.n_tokens if prefix is not None else 0) + len(trunk)
        longest = max((len(row) for row in given), default=0)
        if start + longest > self.context_length:
            raise PromptError(
                f"a row reaches {start + longest} tokens, over the model's context of {self.context_length}"
            )
        passes = []  # (rows of the chunk, the queries it answers), only chunks that answer one
        for chunk in plan_chunks(given, self.max_tokens_per_pass, self.max_rows_per_pass):
            local = {row: n for n, row in enumerate(chunk)}
            picked = [k for k, q in enumerate(queries) if q.row in local and q.position >= 0]
            if picked:
                tree = pack_tree([given[row] for row in chunk])
                passes.append(
                    (tree, picked, [Query(local[queries[k].row], queries[k].position, queries[k].ids) for k in picked])
                )
        carried = len(trunk) if self.packs_trunk else 0  # trunk tokens that go into the first pass
        before = (prefix.n_tokens if prefix is not None else 0) + len(trunk) - carried
        self._check_memory(before, carried, [tree for tree, _, _ in passes])
        if trunk and (not passes or not self.packs_trunk):
            prefix, trunk = self.prefill(trunk, parent=prefix, hidden=hidden), ()
        results: list[np.ndarray | None] = [None] * len(queries)
        states: list[np.ndarray | None] = [None] * len(queries)
        for number, (tree, picked, chunk_queries) in enumerate(passes):
            if number and pause is not None:
                pause()  # a pass boundary: ``prefix`` and the chunks left are this call's own
            self.counter.add(len(trunk) + self.pass_tokens(prefix, len(trunk), tree))
            if hidden:
                values, state, chunk_states = self._on_model_thread(
                    partial(self._score_chunk_hidden, prefix, trunk, tree, chunk_queries)
                )
                for k, vector in zip(picked, chunk_states):
                    states[k] = vector
            else:
                values, state = self._on_model_thread(partial(self._score_chunk, prefix, trunk, tree, chunk_queries))
            for k, value in zip(picked, values):
                results[k] = np.asarray(value, dtype=np.float64)
            if trunk:
                prefix = Prefix(ids=(prefix.ids if prefix is not None else ()) + trunk, state=state)
                trunk = ()
        assert prefix is not None  # a trunk was read by now, or there was a prefix
        after_prefix = [k for k, q in enumerate(queries) if q.position == -1]
        if after_prefix:
            logp = self._on_model_thread(partial(self._prefix_logp, prefix))
            for k in after_prefix:
                results[k] = logp[list(queries[k].ids)].astype(np.float64)
                if hidden:
                    states[k] = self._on_model_thread(partial(self._prefix_hidden, prefix))
        values = [r if r is not None else np.zeros(0) for r in results]
        _check_finite(values)
        if not hidden:
            return Scored(values, prefix)
        return Scored(values, prefix, [s if s is not None else np.zeros(0, dtype=np.float32) for s in states])

    def grow(
        self,
        prefix: Prefix,
        rows: Rows | None,
        new: Sequence[Sequence[int]],
        *,
        trunk: Sequence[int] = (),
        room: int = 0,
    ) -> Rows:
        """Append ``new[i]`` to row ``i`` (``rows=None`` starts the rows) in one pass; see the contract.

        Starting rows may carry a ``trunk``: tokens that continue the prompt, read causally in the
        same pass, with every row hung after them. The returned ``Rows.prefix`` is then prefix +
        trunk, the prefix every later step and later reader continues from. ``room`` is the hint
        of ``prefill``, for the rows that will grow after that prefix.
        """
        trunk = tuple(int(t) for t in trunk)
        if trunk and rows is not None:
            raise BackendError("only a grow that starts rows can read a trunk")
        if room < 0:
            raise BackendError(f"room must be 0 or more tokens, got {room}")
        growth = self._extend(GrowStep(prefix, rows, tuple(tuple(int(t) for t in n) for n in new)), len(trunk))
        if not any(growth.n_new):
            if trunk:
                prefix = self.prefill(trunk, parent=prefix, room=room)
            return Rows(prefix, growth.extended, tuple(None for _ in new), rows.state if rows is not None else None)
        grown = self._on_model_thread(partial(self._grow, prefix, rows, growth.extended, growth.n_new, trunk, room))
        _check_finite([logp for logp in grown.logp if logp is not None])
        return grown

    def grow_many(self, steps: Sequence[GrowStep]) -> list[Rows]:
        """Every step's ``grow`` (no trunks), joined into one pass where the backend can; see the
        contract. All steps are checked before any pass; a step with no new token runs none.
        """
        growths = [self._extend(step, 0) for step in steps]
        results: list[Rows | None] = [None] * len(growths)
        active = []
        for k, growth in enumerate(growths):
            if any(growth.n_new):
                active.append(k)
            else:
                kept = growth.rows.state if growth.rows is not None else None
                results[k] = Rows(growth.prefix, growth.extended, tuple(None for _ in growth.n_new), kept)
        if len(active) == 1:
            only = growths[active[0]]
            results[active[0]] = self._on_model_thread(
                partial(self._grow, only.prefix, only.rows, only.extended, only.n_new)
            )
        elif active:
            joined_rows = self._on_model_thread(partial(self._grow_many, [growths[k] for k in active]))
            for k, joined in zip(active, joined_rows, strict=True):
                results[k] = joined
        done = [grown for grown in results if grown is not None]
        assert len(done) == len(growths)
        _check_finite([logp for grown in done for logp in grown.logp if logp is not None])
        return done

    def _extend(self, step: GrowStep, n_trunk: int) -> Growth:
        """A step checked against its rows and the context: each row with its new tokens appended."""
        rows, new = step.rows, step.new
        old = rows.ids if rows is not None else tuple(() for _ in new)
        if rows is not None and rows.prefix is not step.prefix:
            raise BackendError("grow continues rows only after the prefix they started from")
        if len(new) != len(old):
            raise BackendError(f"grow got {len(new)} extensions for {len(old)} rows")
        extended = tuple(o + n for o, n in zip(old, new))
        if any(new):
            reach = step.prefix.n_tokens + n_trunk + max(len(row) for row in extended)
            if reach > self.context_length:
                raise PromptError(
                    f"a generated row reaches {reach} tokens, over the model's context of {self.context_length}"
                )
        return Growth(step.prefix, rows, extended, [len(n) for n in new])

    def _grow_many(self, growths: list[Growth]) -> list[Rows]:
        """The steps of several generations, each with a new token somewhere: here one ``_grow``
        (one pass) after another; a backend that can read them in one pass overrides it.
        """
        return [self._grow(g.prefix, g.rows, g.extended, g.n_new) for g in growths]

    def _grow(
        self,
        prefix: Prefix,
        rows: Rows | None,
        extended: tuple[tuple[int, ...], ...],
        n_new: list[int],
        trunk: tuple[int, ...] = (),
        room: int = 0,
    ) -> Rows:
        """Re-read every extended row with ``score`` (the trunk with them) and gather the whole
        vocabulary at each row's end; ``room`` is for backends that keep the rows' KV.
        """
        active = [k for k, n in enumerate(n_new) if n]
        every_id = tuple(range(self.vocab_size))
        queries = [Query(j, len(extended[k]) - 1, every_id) for j, k in enumerate(active)]
        scored = self.score(prefix, [extended[k] for k in active], queries, trunk=trunk)
        logp: list[np.ndarray | None] = [None] * len(extended)
        for k, value in zip(active, scored.values):
            logp[k] = value
        return Rows(scored.prefix, extended, tuple(logp))

    def cut(self, prefix: Prefix, n_tokens: int) -> Prefix:
        """The first ``n_tokens`` of ``prefix`` as a prefix of their own, equal to
        ``prefill(prefix.ids[:n_tokens])``, sharing the KV ``prefix`` holds instead of reading the
        tokens again where the backend can (torch, llama.cpp, MLX and vLLM can; the base class reads
        them again). A session reads a new turn in the same pass as the closing lines and rows after
        it, then keeps only the conversation: the turn's end is inside that pass's trunk
        (``pcd_core/sessions/session.py``). ``prefix`` is left as it was.
        """
        if not 0 < n_tokens <= prefix.n_tokens:
            raise BackendError(f"cannot cut a prefix of {prefix.n_tokens} tokens to {n_tokens}")
        if n_tokens == prefix.n_tokens:
            return prefix
        shared = self._on_model_thread(partial(self._cut, prefix, n_tokens))
        return shared if shared is not None else self.prefill(prefix.ids[:n_tokens])

    def next_logp(self, prefix: Prefix) -> np.ndarray:
        """Full-vocabulary log-softmax after the prefix (for token-by-token baselines)."""
        logp = np.asarray(self._on_model_thread(partial(self._prefix_logp, prefix)), dtype=np.float64)
        _check_finite([logp])
        return logp

    def pass_tokens(self, prefix: Prefix | None, n_trunk: int, tree: TokenTree) -> int:
        """The row tokens one pass over ``tree`` after ``prefix`` reads (what ``counter`` charges
        beside the trunk): a packed pass reads each distinct token once, a pass of copies every row
        whole.
        """
        return len(tree.tokens) if self.row_layout == "packed" else sum(map(len, tree.node_of))

    def pass_bytes(self, n_context: int, n_trunk: int, tree: TokenTree) -> int:
        """Estimated KV and mask bytes of one pass over ``tree`` after ``n_context`` cached tokens."""
        if self.row_layout == "packed":
            n_new = n_trunk + len(tree.tokens)
            n_keys = n_context + n_new
            return self.kv_bytes_per_token * n_keys + self.mask_bytes_per_entry * n_new * n_keys
        # copies: every row gets its own prefix, padded to the longest row
        return self._batch_bytes(len(tree.node_of), max(map(len, tree.node_of)), n_context)

    def _batch_bytes(self, batch: int, width: int, n_context: int) -> int:
        """A pass of ``batch`` sequences padded to ``width``, each over its own copy of the context."""
        n_keys = n_context + width
        return batch * (self.kv_bytes_per_token * n_keys + self.mask_bytes_per_entry * width * n_keys)

    def _on_model_thread(self, call: Callable[[], _T]) -> _T:
        """``call()`` (a hook) where this backend's work runs: for a model in this process the one
        model thread (``model_thread.py``: OpenMP's thread teams), for a remote one this thread.
        """
        return model_thread.run(call) if self.serialises else call()

    # -- hooks --------------------------------------------------------------------------------
    @abstractmethod
    def _prefill(self, ids: tuple[int, ...], parent: Prefix | None, room: int) -> Any:
        """Read ``ids`` after ``parent`` and return the new prefix's state, leaving the parent's intact;
        ``room`` as in ``prefill`` (a backend that keeps no KV of its own ignores it).
        """

    @abstractmethod
    def _score_chunk(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], Any]:
        """One forward pass over ``trunk`` then the rows of ``tree`` after ``prefix``: one gathered
        log-prob array per query, and the state of prefix + trunk (None without a trunk). A query
        names a row and a position in it; ``tree.node_of`` maps that to a token. A backend whose
        ``packs_trunk`` is false never gets a trunk.
        """

    @abstractmethod
    def _prefix_logp(self, prefix: Prefix) -> np.ndarray:
        """Full-vocabulary log-softmax after the prefix's last token, from its stored state."""

    def _cut(self, prefix: Prefix, n_tokens: int) -> Prefix | None:
        """``cut`` without a pass: the first ``n_tokens`` over ``prefix``'s KV, or None where this
        backend cannot share it for that length (``cut`` then reads the tokens again).
        """
        return None

    def _score_chunk_hidden(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], Any, list[np.ndarray]]:
        """``_score_chunk``, plus the final hidden state (float32) at each query's position."""
        raise HiddenStatesUnavailableError(f"the {self.name} backend {self.hidden_unavailable_because}")

    def _prefill_hidden(self, ids: tuple[int, ...], parent: Prefix | None, room: int) -> Any:
        """``_prefill`` for a prefix whose last hidden state will be read; the same unless a backend
        keeps hidden states only when asked.
        """
        return self._prefill(ids, parent, room)

    def _prefix_hidden(self, prefix: Prefix) -> np.ndarray:
        """The final hidden state after the prefix's last token, from its stored state."""
        raise HiddenStatesUnavailableError(f"the {self.name} backend {self.hidden_unavailable_because}")

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of rows of the output head."""

    # -- shared checks ------------------------------------------------------------------------
    @staticmethod
    def _check_queries(rows: list[tuple[int, ...]], queries: Sequence[Query]) -> None:
        for query in queries:
            if query.position == -1:
                continue
            if not 0 <= query.row < len(rows):
                raise BackendError(f"query {query!r} names row {query.row}, but there are {len(rows)}")
            if not 0 <= query.position < len(rows[query.row]):
                raise BackendError(
                    f"query {query!r} reads position {query.position} of a {len(rows[query.row])}-token row"
                )
            if not query.ids:
                raise BackendError(f"query {query!r} asks for no token ids")

    def _check_memory(self, n_context: int, n_trunk: int, trees: list[TokenTree]) -> None:
        """Refuse, before any pass, a call whose largest pass is estimated over ``max_pass_bytes``;
        the trunk's ``n_trunk`` tokens go with the first pass, later passes see them as context.
        """
        if self.max_pass_bytes is None or not trees:
            return
        estimates = [
            self.pass_bytes(n_context + (0 if k == 0 else n_trunk), n_trunk if k == 0 else 0, tree)
            for k, tree in enumerate(trees)
        ]
        worst = max(estimates)
        if worst > self.max_pass_bytes:
            raise PromptError(
                f"one forward pass would need about {worst / 2**20:.0f} MiB of KV and masks, over the "
                f"backend's max_pass_bytes of {self.max_pass_bytes / 2**20:.0f} MiB "
                f"(max_tokens_per_pass is {self.max_tokens_per_pass}); lower max_tokens_per_pass, "
                "ask fewer questions per request, or raise max_pass_bytes"
            )


def _check_finite(values: Sequence[np.ndarray]) -> None:
    """Refuse log-probabilities that are NaN or +infinity (-infinity is a token the model rules out).
    A log-softmax of finite logits has neither, so they mean that the model's activations overflowed,
    as Gemma's do in float16; answers read from them would be arbitrary, not just imprecise.
    """
    if any(np.isnan(v).any() or np.isposinf(v).any() for v in values):
        raise BackendError(
            "the model returned log-probabilities that are NaN or infinite: its activations overflow in "
            "this dtype; load it in bfloat16 or float32"
        )
