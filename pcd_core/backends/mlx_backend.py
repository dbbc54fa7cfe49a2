"""The MLX backend: the two primitives on mlx / mlx-lm, on Apple silicon and on Linux CPU alike.

mlx-lm's model call takes neither a mask nor position ids, so this module drives the model's own
layers (projections, norms, rotary embedding, MLP) in a loop of its own:

- ``prefill`` attends the new tokens to the parent's keys and values and returns new per-layer
  arrays; mlx arrays are immutable, so the parent cannot change.
- ``score`` packs the trunk and then every row into one sequence after the prefix, the rows as a
  ``TokenTree`` (rows that start alike share those tokens). Each token gets its own rotary position
  (the trunk's end + its depth in the tree) and a tree mask lets it see the prefix, the trunk and its
  own ancestors only, so rows share the prefix keys and values without a copy per row and carry no
  padding. The trunk's keys and values are kept as the extended prefix. On the Linux CPU wheel
  (SmolLM2 Q4_1, 300-token prefix, 12 rows of 122 tokens, 156 when padded) one row pass took
  29-35 s packed, 38-40 s as a padded batch that attends to the prefix broadcast from batch size 1,
  and 40-41 s with ``mx.repeat`` copies: the pass is bound by matmuls over row tokens, so padding
  costs more than prefix copies do.
- The LM head runs only at the queried positions: a vocabulary can be 262k wide.
- ``grow`` keeps each row's own keys and values after the prefix (``_MlxRows``), so a step reads its
  new tokens only, under the same tree rules; ``grow_many`` reads several generations' steps in one
  pass, each step's queries over its own keys. A row read again from the prefix at every step (the
  base class's way) made a 24-token reply on the Linux CPU wheel six times as slow (docs/mlx.md).

Weights come from an HF directory, loaded as mlx-lm loads it, or natively from a llama GGUF kept
quantized (Q4_0, Q4_1 and Q8_0 arrive from ``mx.load`` as MLX affine triples, group size 32); both
loaders live in ``mlx_loading``. At load the layer loop is checked once against mlx-lm's own forward
pass, so a layout it gets wrong fails there and not inside a decision. ``tests/test_mlx_backend.py``
runs the backend conformance checks and the parity with the torch backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pcd_core.backends.base import Backend, Growth, Prefix, Query, Rows, cut_states, middle_layers, new_tokens
from pcd_core.backends.packing import TokenTree, pack_tree
from pcd_core.errors import BackendError, BackendUnavailableError

try:
    import mlx.core as mx
    from mlx import nn
except ImportError as error:  # the extra is optional; say how to install it
    raise BackendUnavailableError("mlx", "mlx") from error

from pcd_core.backends.mlx_loading import load_hf_dir, load_llama_gguf  # it needs mlx, imported above

#: mlx-lm model types whose blocks this loop reproduces (the load-time check proves each one)
_SUPPORTED_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma3_text"})


@dataclass(frozen=True, eq=False)
class _PrefixState:
    """Per-layer rotated keys and values, ``[1, n_kv_heads, n_tokens, head_dim]``, and the last hidden."""

    keys: tuple[Any, ...]
    values: tuple[Any, ...]
    last_hidden: Any  # [hidden_size], before the final norm
    last_middle: Any  # [hidden_size], the middle layers' mean (base.py's middle_layers)
    #: where the pass that made the prefix began reading (its trunk, or what a prefill read), and its
    #: states per token there, from which ``_cut`` takes the last states of a cut that ends inside
    trunk_states: tuple[int, Any, Any] | None = None


@dataclass(frozen=True, eq=False)
class _MlxRows:
    """Growing rows' own keys and values after their prefix, per layer ``[1, n_kv_heads, n, head_dim]``
    (immutable, so an older ``Rows`` still reads as it did), and per row token its row and depth.
    """

    keys: tuple[Any, ...]
    values: tuple[Any, ...]
    owner: np.ndarray
    depth: np.ndarray


@dataclass(frozen=True, eq=False)
class _Step:
    """One generation's part of a ``_read_steps`` pass: its growth, trunk, new tokens and masks."""

    growth: Growth
    kept: _MlxRows | None
    trunk: tuple[int, ...]
    owner: np.ndarray
    depth: np.ndarray
    tokens: list[int]
    positions: np.ndarray  # the trunk's, then each new token's
    masks: dict[int | None, Any]  # per sliding window (None: none), over prefix, kept, trunk, new keys

    @property
    def size(self) -> int:
        return len(self.trunk) + len(self.tokens)

    def prefix_after(self, keys: list[Any], values: list[Any], last_hidden: Any, last_middle: Any) -> Prefix:
        """The rows' prefix once the pass read this step (``keys``: its own, per layer): the growth's
        prefix, extended by the trunk where there is one (``last_*``: the states at the trunk's end).
        """
        prefix, n = self.growth.prefix, len(self.trunk)
        if not n:
            return prefix
        state: _PrefixState = prefix.state
        return Prefix(
            ids=prefix.ids + self.trunk,
            state=_PrefixState(
                keys=tuple(mx.concatenate([old, new[:, :, :n]], axis=2) for old, new in zip(state.keys, keys)),
                values=tuple(mx.concatenate([old, new[:, :, :n]], axis=2) for old, new in zip(state.values, values)),
                last_hidden=last_hidden,
                last_middle=last_middle,
            ),
        )

    def rows_after(self, keys: list[Any], values: list[Any]) -> _MlxRows:
        """The rows' state once the pass read this step: the kept tokens, then the new ones."""
        n = len(self.trunk)
        new_keys, new_values = [k[:, :, n:] for k in keys], [v[:, :, n:] for v in values]
        if self.kept is None:
            return _MlxRows(tuple(new_keys), tuple(new_values), self.owner, self.depth)
        kept = self.kept
        return _MlxRows(
            keys=tuple(mx.concatenate([old, new], axis=2) for old, new in zip(kept.keys, new_keys)),
            values=tuple(mx.concatenate([old, new], axis=2) for old, new in zip(kept.values, new_values)),
            owner=np.concatenate([kept.owner, self.owner]),
            depth=np.concatenate([kept.depth, self.depth]),
        )


Attend = Callable[[int, Any, Any, Any], Any]


class MlxBackend(Backend):
    """An mlx-lm model behind the two primitives; rows are packed after the prefix under a tree mask."""

    name = "mlx"
    reads_hidden = True
    hidden_parts = ("final", "middle")
    row_layout = "packed"

    def __init__(self, model: nn.Module, *, context_length: int, max_tokens_per_pass: int | None = None) -> None:
        super().__init__(context_length=context_length, max_tokens_per_pass=max_tokens_per_pass)
        model_type = getattr(model, "model_type", None)
        if model_type not in _SUPPORTED_TYPES:
            raise BackendError(
                f"the mlx backend drives {sorted(_SUPPORTED_TYPES)} models, not {model_type!r}; "
                "use backend='torch' for this model"
            )
        self.model = model
        self._layers = list(model.layers)
        self._middle = middle_layers(len(self._layers))
        args = model.args
        n_kv = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
        self.kv_bytes_per_token = 2 * len(self._layers) * int(n_kv) * int(head_dim) * 4
        self.mask_bytes_per_entry = 2  # the numpy mask and its mx copy, one byte each
        # Gemma 3 wraps both sublayers in norms ("sandwich") and scales the embeddings by
        # sqrt(hidden). mlx-lm rounds that factor to bfloat16 (25.25 for 640) where transformers
        # keeps float32 (25.298); on Gemma 3 270M the rounding alone moved log-probs by 0.023 nats
        # against torch (4.8e-4 without it), so this loop keeps the float32 factor.
        self._sandwich = hasattr(self._layers[0], "pre_feedforward_layernorm")
        hidden_size = model.args.hidden_size
        self._embed_scale = hidden_size**0.5 if model_type == "gemma3_text" else None
        self._windows = [_sliding_window(layer, model.args) for layer in self._layers]
        self._check_against_mlx_lm()

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def from_gguf(
        cls, path: str | Path, *, max_tokens_per_pass: int | None = None, dtype: str = "float32"
    ) -> MlxBackend:
        """Load a llama-architecture GGUF natively, keeping its Q4_0/Q4_1/Q8_0 tensors quantized.

        ``dtype`` is the compute type. The GGUF stores scales in float16, which float32 holds
        exactly; on the Linux CPU wheel a float16 quantized matmul ([400, 576] x [576, 1536]) took
        31.5 s against 0.79 s in float32, and float32 also stays within 2e-4 nats of torch.
        """
        model, context_length = load_llama_gguf(path, dtype)
        return cls(model, context_length=context_length, max_tokens_per_pass=max_tokens_per_pass)

    @classmethod
    def from_hf_dir(cls, path: str | Path, *, max_tokens_per_pass: int | None = None) -> MlxBackend:
        """Load an HF model directory (or a cached HF id) as mlx-lm does; see ``load_hf_dir``."""
        model, context_length = load_hf_dir(path)
        return cls(model, context_length=context_length, max_tokens_per_pass=max_tokens_per_pass)

    # -- the hooks ----------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self._head().weight.shape[0])

    def _prefill(self, ids: tuple[int, ...], parent: Prefix | None, room: int = 0) -> _PrefixState:
        start = parent.n_tokens if parent is not None else 0
        q_pos = np.arange(start, start + len(ids))[:, None]
        k_pos = np.arange(start + len(ids))[None]
        masks = {window: mx.array((k_pos <= q_pos) & _window_ok(q_pos, k_pos, window)) for window in set(self._windows)}
        keys: list[Any] = []
        values: list[Any] = []

        def attend(index: int, q: Any, k: Any, v: Any) -> Any:
            if parent is not None:
                k = mx.concatenate([parent.state.keys[index], k], axis=2)
                v = mx.concatenate([parent.state.values[index], v], axis=2)
            keys.append(k)
            values.append(v)
            return self._attention(index, q, k, v, masks[self._windows[index]])

        hidden, middle = self._run_layers(mx.array([ids]), start, attend)
        read = (start, hidden[0], middle[0])  # a cut may end inside what this prefill read
        state = _PrefixState(tuple(keys), tuple(values), hidden[0, -1], middle[0, -1], trunk_states=read)
        mx.eval(state.keys, state.values, state.last_hidden, state.last_middle, read[1], read[2])
        return state

    def _score_chunk(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], _PrefixState | None]:
        values, kept, _ = self._read_chunk(prefix, trunk, tree, queries, keep_hidden=False)
        return values, kept

    def _score_chunk_hidden(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], _PrefixState | None, list[np.ndarray]]:
        return self._read_chunk(prefix, trunk, tree, queries, keep_hidden=True)

    def _read_chunk(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query], keep_hidden: bool
    ) -> tuple[list[np.ndarray], _PrefixState | None, list[np.ndarray]]:
        state: _PrefixState | None = prefix.state if prefix is not None else None
        n_prefix, n_trunk = (prefix.n_tokens if prefix is not None else 0), len(trunk)
        positions = n_prefix + np.concatenate([np.arange(n_trunk), n_trunk + np.array(tree.depth, dtype=int)])
        q_pos = positions[:, None]
        own_row = tree.with_trunk(n_trunk)
        keys: list[Any] = []
        values: list[Any] = []
        masks = {
            window: mx.array(
                np.concatenate(
                    [
                        _window_ok(q_pos, np.arange(n_prefix)[None], window),
                        own_row & _window_ok(q_pos, positions[None], window),
                    ],
                    axis=1,
                )
            )
            for window in set(self._windows)
        }

        def attend(index: int, q: Any, k: Any, v: Any) -> Any:
            if state is not None:
                k = mx.concatenate([state.keys[index], k], axis=2)
                v = mx.concatenate([state.values[index], v], axis=2)
            if trunk:
                keys.append(k[:, :, : n_prefix + n_trunk])
                values.append(v[:, :, : n_prefix + n_trunk])
            return self._attention(index, q, k, v, masks[self._windows[index]])

        hidden, middle = self._run_layers(mx.array([list(trunk) + tree.tokens]), mx.array(positions), attend)
        hidden, middle = hidden[0], middle[0]
        read = [n_trunk + tree.node_of[q.row][q.position] for q in queries]
        gathered = self._gather(hidden, read, queries)
        states = list(self._joined(hidden[mx.array(read)], middle[mx.array(read)])) if keep_hidden else []
        if not trunk:
            return gathered, None, states
        ends = {"last_hidden": hidden[n_trunk - 1], "last_middle": middle[n_trunk - 1]}
        trunk_states = (n_prefix, hidden[:n_trunk], middle[:n_trunk])
        kept = _PrefixState(keys=tuple(keys), values=tuple(values), trunk_states=trunk_states, **ends)
        mx.eval(kept.keys, kept.values, kept.last_hidden, kept.last_middle, trunk_states[1], trunk_states[2])
        return gathered, kept, states

    def _cut(self, prefix: Prefix, n_tokens: int) -> Prefix | None:
        """Slices of the first ``n_tokens`` keys and values, when they end inside what the pass that
        made ``prefix`` read (its trunk, or a prefill's tokens), whose states it kept; else None.
        """
        state: _PrefixState = prefix.state
        kept = cut_states(state.trunk_states, n_tokens)
        if kept is None:
            return None
        cut = _PrefixState(
            keys=tuple(k[:, :, :n_tokens] for k in state.keys),
            values=tuple(v[:, :, :n_tokens] for v in state.values),
            last_hidden=kept[1][-1],
            last_middle=kept[2][-1],
            trunk_states=kept,
        )
        return Prefix(ids=prefix.ids[:n_tokens], state=cut)

    def _grow(
        self,
        prefix: Prefix,
        rows: Rows | None,
        extended: tuple[tuple[int, ...], ...],
        n_new: list[int],
        trunk: tuple[int, ...] = (),
        room: int = 0,
    ) -> Rows:
        """Read only each row's new tokens, over the prefix (and a trunk, read causally before them
        in the same pass) and the rows' kept keys and values (``_MlxRows``); ``room`` is not needed,
        since mlx arrays are never written in place.
        """
        if rows is not None and rows.state is None:  # rows another path started: read them again
            return super()._grow(prefix, rows, extended, n_new, trunk, room)
        (grown,) = self._read_steps([Growth(prefix, rows, extended, n_new)], trunk)
        return grown

    def _grow_many(self, growths: list[Growth]) -> list[Rows]:
        """Several generations' steps in one pass: the projections and MLP read every step's tokens at
        once, and each step's queries attend over that step's own prefix, kept rows and new tokens.
        """
        if any(g.rows is not None and g.rows.state is None for g in growths):
            return super()._grow_many(growths)
        return self._read_steps(growths, ())

    def _read_steps(self, growths: list[Growth], trunk: tuple[int, ...]) -> list[Rows]:
        steps = [self._plan_step(growth, trunk) for growth in growths]
        self.counter.add(sum(step.size for step in steps))
        starts = np.cumsum([0] + [step.size for step in steps])
        new_keys: list[list[Any]] = [[] for _ in steps]  # per step, per layer: this pass's keys
        new_values: list[list[Any]] = [[] for _ in steps]

        def attend(index: int, q: Any, k: Any, v: Any) -> Any:
            outputs = []
            for n, step in enumerate(steps):
                part = slice(int(starts[n]), int(starts[n + 1]))
                state: _PrefixState = step.growth.prefix.state
                old = [] if step.kept is None else [step.kept.keys[index]]
                old_values = [] if step.kept is None else [step.kept.values[index]]
                own_k, own_v = k[:, :, part], v[:, :, part]
                new_keys[n].append(own_k)
                new_values[n].append(own_v)
                keys = mx.concatenate([state.keys[index], *old, own_k], axis=2)
                values = mx.concatenate([state.values[index], *old_values, own_v], axis=2)
                mask = step.masks[self._windows[index]]
                outputs.append(self._attention(index, q[:, :, part], keys, values, mask))
            return mx.concatenate(outputs, axis=2)

        ids = [token for step in steps for token in (*step.trunk, *step.tokens)]
        positions = np.concatenate([step.positions for step in steps])
        hidden, middle = self._run_layers(mx.array([ids]), mx.array(positions), attend)
        hidden, middle = hidden[0], middle[0]
        ends = [int(starts[n]) + len(step.trunk) + i for n, step in enumerate(steps) for i in _last_of_rows(step)]
        logp = np.array(self._logp(hidden[mx.array(ends)])).astype(np.float64) if ends else np.zeros((0, 0))
        results, read = [], 0
        for n, step in enumerate(steps):
            end = int(starts[n]) + len(step.trunk) - 1  # the trunk's last token, when there is one
            prefix = step.prefix_after(new_keys[n], new_values[n], hidden[end], middle[end])
            kept = step.rows_after(new_keys[n], new_values[n])
            mx.eval(kept.keys, kept.values, prefix.state.keys, prefix.state.values)
            by_row: list[np.ndarray | None] = [None] * len(step.growth.extended)
            for k in _rows_read(step):
                by_row[k], read = logp[read], read + 1
            results.append(Rows(prefix, step.growth.extended, tuple(by_row), kept))
        return results

    def _plan_step(self, growth: Growth, trunk: tuple[int, ...]) -> _Step:
        """A generation's new tokens and its masks over its keys: the prefix's, its rows' kept ones,
        then this pass's (the trunk's, then the rows' new tokens'). A trunk token sees the prefix and
        the trunk before it; a row token sees the prefix, the trunk, its own row's kept tokens and its
        own row's earlier new tokens; positions continue after the trunk by depth in the row.
        """
        kept: _MlxRows | None = growth.rows.state if growth.rows is not None else None
        owner_list, depth_list, tokens = new_tokens(growth.extended, growth.n_new)
        owner, depth = np.array(owner_list, dtype=int), np.array(depth_list, dtype=int)
        old_owner = kept.owner if kept is not None else np.zeros(0, dtype=int)
        old_depth = kept.depth if kept is not None else np.zeros(0, dtype=int)
        n_prefix, n_trunk, n_old, n_new = growth.prefix.n_tokens, len(trunk), len(old_owner), len(tokens)
        base = n_prefix + n_trunk
        trunk_pos = np.arange(n_prefix, base)
        q_pos = np.concatenate([trunk_pos, base + depth])
        k_pos = np.concatenate([np.arange(n_prefix), base + old_depth, trunk_pos, base + depth])
        allowed = np.zeros((n_trunk + n_new, n_prefix + n_old + n_trunk + n_new), dtype=bool)
        allowed[:, :n_prefix] = True
        columns = n_prefix + n_old  # where this pass's keys start
        allowed[:n_trunk, columns : columns + n_trunk] = np.tril(np.ones((n_trunk, n_trunk), dtype=bool))
        allowed[n_trunk:, n_prefix:columns] = owner[:, None] == old_owner[None, :]
        allowed[n_trunk:, columns : columns + n_trunk] = True
        allowed[n_trunk:, columns + n_trunk :] = (owner[:, None] == owner[None, :]) & (depth[None, :] <= depth[:, None])
        masks = {
            window: mx.array(allowed & _window_ok(q_pos[:, None], k_pos[None], window)) for window in set(self._windows)
        }
        return _Step(growth, kept, trunk, owner, depth, tokens, q_pos, masks)

    def _prefix_logp(self, prefix: Prefix) -> np.ndarray:
        logp = self._logp(prefix.state.last_hidden[None])[0]
        return np.array(logp.astype(mx.float32))

    def _prefix_hidden(self, prefix: Prefix) -> np.ndarray:
        return self._joined(prefix.state.last_hidden[None], prefix.state.last_middle[None])[0]

    def _joined(self, hidden: Any, middle: Any) -> np.ndarray:
        """States ``[n, 2 * hidden]`` as float32: after the final norm (the LM head's input), then the
        middle layers' mean (``hidden_parts``).
        """
        final = self.model.model.norm(hidden)
        return np.array(mx.concatenate([final, middle], axis=-1).astype(mx.float32))

    # -- the layer loop -----------------------------------------------------------------------
    def _run_layers(self, ids: Any, rope_offset: int | Any, attend: Attend) -> tuple[Any, Any]:
        """Hidden states before the final norm, ``[batch, length, hidden]``, and the mean of the middle
        layers' outputs (``middle_layers`` in base.py) of the same shape.

        ``rope_offset`` is the position of every sequence's first token, or an array holding one
        position per token of a single packed sequence.
        """
        hidden = self._embed(ids)
        middle: Any = 0.0
        for index, layer in enumerate(self._layers):
            hidden = self._block(index, layer, hidden, rope_offset, attend)
            if index in self._middle:
                middle = middle + hidden
        return hidden, middle / len(self._middle)

    def _embed(self, ids: Any) -> Any:
        hidden = self.model.model.embed_tokens(ids)
        return hidden if self._embed_scale is None else hidden * self._embed_scale

    def _block(self, index: int, layer: Any, x: Any, rope_offset: int | Any, attend: Attend) -> Any:
        attn = layer.self_attn
        batch, length, _ = x.shape
        normed = layer.input_layernorm(x)
        q = attn.q_proj(normed).reshape(batch, length, attn.n_heads, -1)
        k = attn.k_proj(normed).reshape(batch, length, attn.n_kv_heads, -1)
        v = attn.v_proj(normed).reshape(batch, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = _rotate(attn.rope, q.transpose(0, 2, 1, 3), rope_offset)
        k = _rotate(attn.rope, k.transpose(0, 2, 1, 3), rope_offset)
        out = attend(index, q, k, v).transpose(0, 2, 1, 3).reshape(batch, length, -1)
        out = attn.o_proj(out)
        if self._sandwich:
            h = x + layer.post_attention_layernorm(out)
            return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))
        h = x + out
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _attention(self, index: int, q: Any, k: Any, v: Any, mask: Any) -> Any:
        scale = self._layers[index].self_attn.scale
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)

    # -- the head, only where it is read ------------------------------------------------------
    def _head(self) -> Any:
        """The output projection: ``lm_head``, or the tied embedding (read with ``as_linear``)."""
        head = getattr(self.model, "lm_head", None)
        return head if head is not None else self.model.model.embed_tokens

    def _logp(self, hidden: Any) -> Any:
        """Full-vocabulary log-softmax for hidden states ``[n, hidden]`` (before the final norm)."""
        normed = self.model.model.norm(hidden)
        head = self._head()
        logits = head.as_linear(normed) if hasattr(head, "as_linear") else head(normed)
        logits = logits.astype(mx.float32)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _gather(self, hidden: Any, flat_positions: list[int], queries: list[Query]) -> list[np.ndarray]:
        """Log-probs at each query's ids; one head row per distinct queried position."""
        distinct = sorted(set(flat_positions))
        slot = {position: n for n, position in enumerate(distinct)}
        logp = self._logp(hidden[mx.array(distinct)])
        picked_rows = [slot[p] for p, q in zip(flat_positions, queries) for _ in q.ids]
        picked_ids = [i for q in queries for i in q.ids]
        picked = np.array(logp[mx.array(picked_rows), mx.array(picked_ids)])
        splits = np.cumsum([len(q.ids) for q in queries])[:-1]
        return list(np.split(picked.astype(np.float64), splits))

    # -- load-time check ----------------------------------------------------------------------
    def _check_against_mlx_lm(self) -> None:
        """Prove the layer loop, the packed rows and the head fast path equal mlx-lm's forward pass."""
        ids = [(7 * n + 3) % self.vocab_size for n in range(1, 9)]
        reference_input = {}
        if self._embed_scale is not None:  # undo mlx-lm's bfloat16 rounding of the factor
            rounded = mx.array(self._embed_scale, mx.bfloat16).item()
            reference_input["input_embeddings"] = self._embed(mx.array([ids])) / rounded
        full = self.model(mx.array([ids]), **reference_input).astype(mx.float32)[0]
        expected = np.array(full - mx.logsumexp(full, axis=-1, keepdims=True))
        # tokens 0-2 prefilled, token 3 read as a trunk, the rest as two rows hanging from it
        prefix = Prefix(ids=tuple(ids[:3]), state=self._prefill(tuple(ids[:3]), None))
        rows = [tuple(ids[4:]), tuple(ids[4:6])]
        queries = [Query(0, p, tuple(ids)) for p in range(4)] + [Query(1, 1, tuple(ids))]
        got, kept = self._score_chunk(prefix, tuple(ids[3:4]), pack_tree(rows), queries)
        got_prefix = self._prefix_logp(Prefix(ids=tuple(ids[:4]), state=kept))[ids]
        diffs = [np.abs(got_prefix - expected[3, ids]).max()]
        diffs += [np.abs(got[p] - expected[4 + p, ids]).max() for p in range(4)]
        diffs.append(np.abs(got[4] - expected[5, ids]).max())
        tolerance = 1e-3 if full.dtype == mx.float32 and self._compute_dtype() == mx.float32 else 5e-2
        if max(diffs) > tolerance:
            raise BackendError(
                f"the mlx layer loop disagrees with mlx-lm's own forward pass by {max(diffs):.3g} "
                f"nats on {self.model.model_type!r}; this architecture needs its own block"
            )

    def _compute_dtype(self) -> Any:
        return self.model.model.norm.weight.dtype


def _rotate(rope: Any, x: Any, offset: int | Any) -> Any:
    """Apply the layer's rotary embedding at ``offset``: an int, or one position per packed token.

    ``mx.fast.rope`` accepts one offset per batch entry, so a packed sequence ``[1, H, T, D]`` is
    turned into T single-token entries for the rotation.
    """
    if isinstance(offset, int):
        return rope(x, offset=offset)
    return rope(x.transpose(2, 1, 0, 3), offset=offset).transpose(2, 1, 0, 3)


def _sliding_window(layer: Any, args: Any) -> int | None:
    """The layer's attention window in tokens (llama's ``use_sliding``, Gemma's ``is_sliding``)."""
    if getattr(layer, "use_sliding", False) or getattr(layer.self_attn, "is_sliding", False):
        return int(args.sliding_window)
    return None


def _window_ok(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> np.ndarray:
    """Which keys a sliding-window layer still sees (mlx-lm's rule: q - k < window)."""
    if window is None:
        return np.ones(np.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=bool)
    return (q_pos - k_pos) < window


def _rows_read(step: _Step) -> list[int]:
    """The rows with a new token this step, in order: each one's last new token is read."""
    return sorted(set(step.owner.tolist()))


def _last_of_rows(step: _Step) -> list[int]:
    """Each read row's last new token's index among the step's new tokens, in ``_rows_read`` order."""
    last = {int(row): i for i, row in enumerate(step.owner.tolist())}
    return [last[row] for row in _rows_read(step)]
