"""The PyTorch backend: any ``transformers`` causal LM, on CPU or CUDA.

Rows share the prefix KV without a copy per row. A pass packs the trunk and then every row into one
sequence after the prefix, under a tree-shaped 4D mask: the trunk is causal, each row token sees the
whole prefix, the whole trunk and the earlier tokens of its own row, and each row's positions restart
at the trunk's end. The trunk's keys and values are kept, so the pass also returns the extended
prefix. A pass after a prefix whose rows part into groups of their own (the requests of many inputs
in a batch, ``pcd_core/planning/batching.py``) is read as a batch of those groups instead, each over its own
view of the prefix KV, when that costs less (``packing.batch_groups``): a packed mask is dense, so
packed inputs cost attention in the square of their summed length, and a batch only in each one's.
Such a pass keeps the keys and states of each input's request (``StemMemo``), and the next pass
after the same prefix whose groups start with them (the batch's next round, which asks for every
request again in front of its rows) takes them from there and reads only what follows.
Models with sliding-window layers (Gemma 3) get a second mask with the window applied. The
output head runs only at queried positions: on this CPU the head over every row token cost as much
as the whole input prefill.

Generation (``grow``) keeps the rows' own KV in an arena. After a prefix read with ``room``, the
arena is that room, right behind the prefix in the same buffers, so a step copies nothing. Several
generations' steps share one pass (``grow_many``): the projections and MLP read every step's tokens
at once, and the model's attention, routed through a function registered with ``transformers``
(``_route_attention``), attends each step's queries over that step's own keys (``JoinedPass``), so a
joined step attends over what its steps would alone and copies no step's keys beside another's.

The packed path is checked against a plain full forward pass when the backend is built: to 1e-3 in
float32, and in a 16-bit dtype to twice what the model's own code differs from itself there (a read
through its KV cache against one whole pass), since bfloat16 rounding alone moves log-probs by tenths
while a wrong mask or position moves them by more than 1. A model whose attention ignores custom
masks fails that check and falls back to ``copies`` (one broadcast KV per row, padded), which
``stats.row_layout`` reports; if that fails too the backend refuses to load. The copies fallback
reads a trunk as a prefill of its own (one more pass) instead of once per row.

On CUDA the default dtype is bfloat16 (``default_dtype``), as GPU serving runs, and the masks are what
SDPA's memory-efficient kernel takes: additive, in the model's dtype, one copy shared by every head
(transformers repeats the key/value heads itself when a mask is given), the key dimension padded to a
multiple of 16 elements and passed as a view (``MASK_ALIGN``), so that no layer pads a copy of its
own. The same masks, views included, are what CPU runs and what the tests check; whether CUDA picks
that kernel rather than the math one is not checked here (no GPU): ``examples/gpu_check.sh`` times
it. Every prefill ends with a device synchronisation (``synchronize``), so that timings taken
around backend calls count the GPU's work, not only its queueing.

The cache layers that read over a prefix's tensors and the generation arena are in
``torch_cache.py``; the model's own passes the layout check compares with are in ``torch_check.py``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import numpy as np

from pcd_core.backends.base import (
    Backend,
    Growth,
    LayoutChoice,
    Prefix,
    Query,
    RowLayout,
    Rows,
    middle_layers,
    new_tokens,
)
from pcd_core.backends.packing import TokenTree, batch_groups, leading_chain, pack_tree
from pcd_core.errors import BackendError, BackendUnavailableError

try:
    import torch
    from transformers.cache_utils import Cache
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise BackendUnavailableError("torch", error.name or "torch") from error

# they need torch, imported above
from pcd_core.backends.torch_cache import (
    Arena,
    ArenaLayer,
    BatchLayer,
    GrownRows,
    JoinedLayer,
    JoinedPass,
    PrefixLayer,
    Room,
    StemKV,
    StemMemo,
    TorchState,
)
from pcd_core.backends.torch_check import CheckCase, rounding_floor, whole_pass_case

logger = logging.getLogger(__name__)

#: how closely a row layout must match the model's own forward pass in float32 (max |log-prob| apart);
#: a lower precision adds twice the disagreement the model's own code shows with itself
LAYOUT_TOLERANCE = 1e-3

#: the key dimension of every additive mask is padded to this many elements, and the mask passed as a
#: view: the memory-efficient kernel wants each row of a bias to start 16 bytes apart (8 bfloat16s,
#: 4 float32s) and pads a copy per layer otherwise; 16 elements covers every dtype offered
MASK_ALIGN = 16

#: what one token's projections and MLP cost, in keys of its attention: a pass after a prefix reads
#: its rows packed as one sequence (a dense mask: each token attends over all of them) or as a batch
#: of groups padded to the widest (``packing.batch_groups``), whichever costs fewer key-equivalents.
#: In arithmetic SmolLM2-135M's token is about 2,800 keys (0.19 GFLOP against 69 kFLOP a key over 30
#: layers), but masked attention runs at a lower rate than the matrix products, so a key costs more
#: time than its arithmetic. The figure decides only where the layouts' costs are close, and there
#: either reads about as fast; many inputs' requests are far from close (docs/benchmarks.md).
TOKEN_COST_IN_KEYS = 1000

#: the keyword a joined pass of steps hands its ``JoinedPass`` to the attention under (``_route_attention``)
JOINED_KEYWORD = "pcd_joined"

#: the name the routed attention is registered under, before the model's own implementation's
ROUTED_ATTENTION = "pcd_routed_"

#: the most tokens of leading paths a backend keeps from its last pass after a prefix (``StemMemo``):
#: a batch group's requests sum to at most ``batching.BATCH_STEM_TOKENS``, so this holds a group's with
#: room to spare; kept until the next such pass, it costs SmolLM2-135M at most 90 MiB in float32
STEM_MEMO_TOKENS = 2048


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA, as GPU serving runs; float32 elsewhere. A CPU with AMX reads wide passes
    (batches, a long request) faster in bfloat16, but a one-token step slower, and bfloat16 rounding
    moves log-probabilities by tenths; the CPU figures in the docs are float32 unless they say so.
    """
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class TorchBackend(Backend):
    name = "torch"
    reads_hidden = True  # the final state (the LM head's input) and the middle layers' mean (base.py)
    hidden_parts = ("final", "middle")

    def __init__(
        self, model: Any, *, max_tokens_per_pass: int | None = None, row_layout: LayoutChoice = "auto"
    ) -> None:
        config = model.config
        context = getattr(config, "max_position_embeddings", None) or 2048
        super().__init__(context_length=int(context), max_tokens_per_pass=max_tokens_per_pass)
        self.model = model.eval()
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.device = next(model.parameters()).device
        self.n_layers = int(config.num_hidden_layers)
        self._middle = middle_layers(self.n_layers)
        self.layer_types = tuple(getattr(config, "layer_types", None) or ("full_attention",) * self.n_layers)
        self.window = getattr(config, "sliding_window", None)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self._vocab = int(self.head.weight.shape[0])
        dtype = next(model.parameters()).dtype
        n_kv = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        element = torch.finfo(dtype).bits // 8
        self.kv_bytes_per_token = 2 * self.n_layers * n_kv * head_dim * element
        # the boolean mask, its additive copy in the model's dtype, and the tree's numpy ancestors
        self.mask_bytes_per_entry = 2 + element
        self._checked: CheckCase | None = None
        self._stems: StemMemo | None = None  # the last batch of groups' requests (``_batched_hidden``)
        self._joins = _route_attention(model)
        # the self-check's passes, on the thread every later pass runs on (``model_thread.py``)
        self.row_layout = self._on_model_thread(partial(self._choose_layout, row_layout))

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def compute_dtype(self) -> str:  # type: ignore[override]
        return self.placement["dtype"]

    @property
    def placement(self) -> dict[str, str]:
        """Where the model computes and in what, for benchmark records: ``{"device", "dtype"}``."""
        dtype = next(self.model.parameters()).dtype
        return {"device": str(self.device), "dtype": str(dtype).removeprefix("torch.")}

    # -- prefill ------------------------------------------------------------------------------
    def _cache(self, prefix: Prefix | None, keep: int | None, room: int = 0, record: bool = False) -> Cache:
        if prefix is None:
            return Cache(layers=[PrefixLayer(None, None, keep, room) for _ in range(self.n_layers)])
        state: TorchState = prefix.state
        return Cache(layers=[PrefixLayer(k, v, keep, room, record) for k, v in zip(state.keys, state.values)])

    def _decode(self, **inputs: Any) -> tuple[Any, torch.Tensor]:
        """One decoder forward, and the mean of the middle layers' outputs at every position
        (``middle_layers`` in base.py), summed as each layer finishes so no layer's output is kept.
        """
        total: list[torch.Tensor] = []

        def add(_module: Any, _args: Any, output: Any) -> None:
            state = output[0] if isinstance(output, tuple) else output
            total.append(state if not total else total.pop() + state)

        hooks = [self.decoder.layers[i].register_forward_hook(add) for i in self._middle]
        try:
            out = self.decoder(**inputs)
        finally:
            for hook in hooks:
                hook.remove()
        return out, total[0] / len(self._middle)

    @staticmethod
    def _kept(cache: Cache, last_hidden: torch.Tensor, last_middle: torch.Tensor) -> TorchState:
        layers = [layer for layer in cache.layers if isinstance(layer, PrefixLayer)]
        assert len(layers) == len(cache.layers), "every layer of the engine's caches is a PrefixLayer"
        keys = tuple(layer.keys for layer in layers if layer.keys is not None)
        values = tuple(layer.values for layer in layers if layer.values is not None)
        room = None
        buffers = [layer.buffers for layer in layers if layer.buffers is not None]
        if buffers and len(buffers) == len(layers):
            room = Room([k for k, _ in buffers], [v for _, v in buffers], keys[0].shape[-2])
        return TorchState(
            keys=keys, values=values, last_hidden=last_hidden.detach(), room=room, last_middle=last_middle.detach()
        )

    @torch.inference_mode()
    def _prefill(self, ids: tuple[int, ...], parent: Prefix | None, room: int = 0) -> TorchState:
        start = parent.n_tokens if parent is not None else 0
        cache = self._cache(parent, keep=None, room=room)
        q_pos = torch.arange(start, start + len(ids), device=self.device)
        mask = None  # a read from the start: transformers runs SDPA's causal kernel without a mask
        if parent is not None:
            # after a prefix, transformers would hand SDPA a boolean mask, which SDPA turns into an
            # additive one in every layer; the additive one, made once, reads the same and is cheaper
            k_pos = torch.arange(start + len(ids), device=self.device)
            mask = self._masks(q_pos[None], k_pos[None], (k_pos[None, :] <= q_pos[:, None])[None])
        out, middle = self._decode(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=q_pos[None],
            attention_mask=mask,
            cache=cache,
            use_cache=True,
        )
        state = self._kept(cache, out.last_hidden_state[0, -1], middle[0, -1])
        self.synchronize()
        return state

    def synchronize(self) -> None:
        """Wait for the device's queued work (CUDA runs asynchronously); a no-op on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def device_memory_mark(self) -> int | None:
        """Bytes the CUDA allocator holds now, its peak counter reset to them; None off CUDA, where
        the process's RSS counts the model's memory.
        """
        if self.device.type != "cuda":
            return None
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def device_memory_peak(self) -> int:
        """The CUDA allocator's peak since ``device_memory_mark``."""
        return int(torch.cuda.max_memory_allocated(self.device))

    def _logp(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.log_softmax(logits, dim=-1)

    @torch.inference_mode()
    def _prefix_logp(self, prefix: Prefix) -> np.ndarray:
        return self._logp(prefix.state.last_hidden[None])[0].double().cpu().numpy()

    # -- scoring ------------------------------------------------------------------------------
    def _score_chunk(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], TorchState | None]:
        values, state, _ = self._read_chunk(prefix, trunk, tree, queries, keep_hidden=False)
        return values, state

    def _score_chunk_hidden(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], TorchState | None, list[np.ndarray]]:
        return self._read_chunk(prefix, trunk, tree, queries, keep_hidden=True)

    @torch.inference_mode()
    def _read_chunk(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query], keep_hidden: bool
    ) -> tuple[list[np.ndarray], TorchState | None, list[np.ndarray]]:
        state = None
        if self.row_layout == "packed":
            hidden, middle, index, state = self._packed_hidden(prefix, trunk, tree, queries)
        else:
            assert prefix is not None and not trunk  # packs_trunk is false: score prefilled the trunk
            hidden, middle, index = self._copied_hidden(prefix, tree.rows, queries)
        read = hidden[index]
        logp = self._logp(read)
        values = [logp[k, list(q.ids)].double().cpu().numpy() for k, q in enumerate(queries)]
        if not keep_hidden:
            return values, state, []
        return values, state, list(torch.cat([read, middle[index]], -1).float().cpu().numpy())

    def _prefix_hidden(self, prefix: Prefix) -> np.ndarray:
        state: TorchState = prefix.state
        return torch.cat([state.last_hidden, state.last_middle]).float().cpu().numpy()

    def _masks(self, q_pos: torch.Tensor, k_pos: torch.Tensor, allowed: torch.Tensor) -> Any:
        """Additive masks per attention type; ``allowed`` is [batch, q, k] before any window. Each is a
        [batch, 1, q, k] view of a buffer whose key dimension is padded to ``MASK_ALIGN``.
        """
        dtype = next(self.model.parameters()).dtype
        blocked = torch.finfo(dtype).min
        n_keys = allowed.shape[-1]
        width = -(-n_keys // MASK_ALIGN) * MASK_ALIGN

        def additive(ok: torch.Tensor) -> torch.Tensor:
            padded = torch.full((*ok.shape[:-1], width), blocked, dtype=dtype, device=ok.device)
            mask = padded[..., :n_keys]
            mask.masked_fill_(ok, 0.0)
            return mask[:, None]

        if "sliding_attention" not in self.layer_types:
            return additive(allowed)
        assert self.window is not None, "a model with sliding-window layers names its window"
        in_window = (q_pos[..., :, None] - k_pos[..., None, :]) < self.window
        return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & in_window)}

    def _packed_hidden(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], TorchState | None]:
        n_prefix, n_trunk = (prefix.n_tokens if prefix is not None else 0), len(trunk)
        groups = self._groups(n_prefix, n_trunk, tree, prefix)
        if groups is not None:
            assert prefix is not None  # _groups batches only a pass after a prefix
            hidden, middle, index = self._batched_hidden(prefix, tree, groups, queries)
            return hidden, middle, index, None
        depth = torch.tensor(tree.depth, device=self.device, dtype=torch.long)
        q_pos = torch.cat([torch.arange(n_trunk, device=self.device), n_trunk + depth]) + n_prefix
        k_pos = torch.cat([torch.arange(n_prefix, device=self.device), q_pos])
        allowed = torch.cat(
            [
                torch.ones(len(q_pos), n_prefix, dtype=torch.bool, device=self.device),
                torch.from_numpy(tree.with_trunk(n_trunk)).to(self.device),
            ],
            1,
        )
        record = prefix is not None and not trunk  # a batch's first round, packed: its requests are kept
        cache = self._cache(prefix, keep=n_prefix + n_trunk if trunk else 0, record=record)
        out, middle = self._decode(
            input_ids=torch.tensor([list(trunk) + tree.tokens], device=self.device),
            position_ids=q_pos[None],
            attention_mask=self._masks(q_pos[None], k_pos[None], allowed[None]),
            cache=cache,
            use_cache=True,
        )
        hidden, middle = out.last_hidden_state[0], middle[0]
        if record:
            assert prefix is not None
            self._keep_packed_stems(prefix, tree, cache, hidden, middle)
        index = [n_trunk + tree.node_of[q.row][q.position] for q in queries]
        kept = self._kept(cache, hidden[n_trunk - 1], middle[n_trunk - 1]) if trunk else None
        return hidden, middle, index, kept

    def _groups(
        self, n_prefix: int, n_trunk: int, tree: TokenTree, prefix: Prefix | None = None
    ) -> list[list[int]] | None:
        """The groups a pass reads side by side as a batch (``packing.batch_groups``), or None where
        one packed sequence costs less or the batch's copies of the prefix would not fit in
        ``max_pass_bytes``: a pass with a trunk (whose KV it keeps) and the copies layout always
        read their own way. A tree that stays one group is read as a batch of one when ``prefix``
        is given and the last batch kept the start of its path (``StemMemo``): a later round that
        only one input of a batch needed.
        """
        if self.row_layout != "packed" or n_trunk or not n_prefix:
            return None
        groups = batch_groups(tree, lambda batch, width: batch * width * (TOKEN_COST_IN_KEYS + n_prefix + width))
        if len(groups) < 2:
            whole = [list(range(len(tree.tokens)))]
            kept = prefix is not None and self._stems is not None and self._reused(prefix, tree, whole)[0][1] > 0
            return whole if kept else None
        fits = self.max_pass_bytes is None or (
            self._batch_bytes(len(groups), max(map(len, groups)), n_prefix) <= self.max_pass_bytes
        )
        return groups if fits else None

    def pass_tokens(self, prefix: Prefix | None, n_trunk: int, tree: TokenTree) -> int:
        """As the base class counts, or for a batch of groups each group's tokens (a shared
        ancestor once per group that holds it) less those whose keys it takes from ``StemMemo``.
        """
        groups = self._groups(prefix.n_tokens if prefix is not None else 0, n_trunk, tree, prefix)
        if groups is None or prefix is None:
            return super().pass_tokens(prefix, n_trunk, tree)
        return sum(len(nodes) - n for nodes, (_, n) in zip(groups, self._reused(prefix, tree, groups)))

    def _reused(self, prefix: Prefix, tree: TokenTree, groups: list[list[int]]) -> list[tuple[StemKV | None, int]]:
        """Per group, the kept path it starts with (``StemMemo``) and how many of its first tokens that
        path gives: the tokens it shares with the group's leading path, and never the group's last token
        (a pass reads at least one token a row). A path that gives less than half the group's leading
        path is not taken: another batch's inputs share the opening of their template with these, and
        taking a few tokens costs more in copies than reading them.
        """
        memo = self._stems
        reused: list[tuple[StemKV | None, int]] = []
        for nodes in groups:
            stem, n = (None, 0)
            if memo is not None:
                path = tuple(tree.tokens[node] for node in nodes[: leading_chain(tree, nodes)])
                stem, n = memo.longest(prefix.state, path)
                if 2 * n < len(path):
                    stem, n = None, 0
            reused.append((stem, min(n, len(nodes) - 1)))
        return reused

    def pass_bytes(self, n_context: int, n_trunk: int, tree: TokenTree) -> int:
        """As the base class estimates, or for a batch of groups (``_groups``) what that batch holds."""
        groups = self._groups(n_context, n_trunk, tree)
        if groups is None:
            return super().pass_bytes(n_context, n_trunk, tree)
        return self._batch_bytes(len(groups), max(map(len, groups)), n_context)

    def _batched_hidden(
        self, prefix: Prefix, tree: TokenTree, groups: list[list[int]], queries: list[Query]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """A tree read as a batch of its groups (``packing.batch_groups``): group b is batch row b,
        padded to the widest, over its own broadcast view of the prefix KV and its own tokens only.
        A token in several groups (an ancestor they share) is answered from the first. A group that
        starts with a path the last batch read after the same prefix (an input's request, read again
        in each round: ``pcd_core/planning/batching.py``) takes that path's keys, values and hidden states from
        ``StemMemo`` and reads only the rest; the paths this pass reads replace the memo.
        """
        n_prefix, batch = prefix.n_tokens, len(groups)
        reused = self._reused(prefix, tree, groups)
        rests = [nodes[n:] for nodes, (_, n) in zip(groups, reused)]
        width = max(map(len, rests))
        longest = max(n for _, n in reused)
        n_slots = max(len(nodes) for nodes in groups)  # a row's kept and new keys after the prefix
        pad = self.model.config.pad_token_id or 0
        ancestors = tree.ancestors()
        ids = np.full((batch, width), pad, dtype=np.int64)
        depth = np.zeros((batch, width), dtype=np.int64)
        key_depth = np.zeros((batch, n_slots), dtype=np.int64)
        order = np.zeros((batch, n_slots), dtype=np.int64)  # a slot's index in [kept (longest), new (width)]
        # padding queries see the prefix only (a row of nothing but blocked keys would be NaN)
        allowed = np.zeros((batch, width, n_prefix + n_slots), dtype=bool)
        allowed[:, :, :n_prefix] = True
        slot = np.full(len(tree.tokens), -1, dtype=np.int64)
        kept_hidden: list[torch.Tensor] = []  # the final and middle states of the kept tokens, after the pass's
        kept_middle: list[torch.Tensor] = []
        kept_slot: dict[int, int] = {}
        for b in reversed(range(batch)):
            nodes, rest, (stem, n_kept) = groups[b], rests[b], reused[b]
            n = len(rest)
            ids[b, :n] = [tree.tokens[i] for i in rest]
            depth[b, :n] = [tree.depth[i] for i in rest]
            key_depth[b, :n_kept] = np.arange(n_kept)
            key_depth[b, n_kept : n_kept + n] = depth[b, :n]
            order[b, :n_kept] = np.arange(n_kept)
            order[b, n_kept : n_kept + n] = longest + np.arange(n)
            allowed[b, :n, n_prefix : n_prefix + n_kept] = True  # a kept path is every later token's ancestor
            allowed[b, :n, n_prefix + n_kept : n_prefix + n_kept + n] = ancestors[np.ix_(rest, rest)]
            slot[rest] = b * width + np.arange(n)
            for k, node in enumerate(nodes[:n_kept]):
                assert stem is not None
                kept_slot[node] = batch * width + len(kept_hidden)
                kept_hidden.append(stem.hidden[k])
                kept_middle.append(stem.middle[k])
        q_pos = n_prefix + torch.from_numpy(depth).to(self.device)
        k_pos = torch.cat(
            [
                torch.arange(n_prefix, device=self.device).expand(batch, -1),
                n_prefix + torch.from_numpy(key_depth).to(self.device),
            ],
            1,
        )
        state: TorchState = prefix.state
        picks = torch.from_numpy(order).to(self.device)[:, None, :, None] if longest else None
        layers = [BatchLayer(i, k, v, reused, picks) for i, (k, v) in enumerate(zip(state.keys, state.values))]
        out, middle = self._decode(
            input_ids=torch.from_numpy(ids).to(self.device),
            position_ids=q_pos,
            attention_mask=self._masks(q_pos, k_pos, torch.from_numpy(allowed).to(self.device)),
            cache=Cache(layers=[*layers]),
            use_cache=True,
        )
        hidden = out.last_hidden_state.reshape(batch * width, -1)
        middle = middle.reshape(batch * width, -1)
        states = [layer.new for layer in layers if layer.new is not None]
        self._keep_stems(
            prefix, tree, groups, reused, states, hidden, middle, lambda b, start, stop: (b, list(range(stop - start)))
        )
        nodes_asked = [tree.node_of[q.row][q.position] for q in queries]
        index = [int(slot[node]) if slot[node] >= 0 else kept_slot[node] for node in nodes_asked]
        if kept_hidden:
            hidden, middle = (
                torch.cat([hidden, torch.stack(kept_hidden)]),
                torch.cat([middle, torch.stack(kept_middle)]),
            )
        return hidden, middle, index

    def _keep_stems(
        self,
        prefix: Prefix,
        tree: TokenTree,
        groups: list[list[int]],
        reused: list[tuple[StemKV | None, int]],
        new: list[tuple[torch.Tensor, torch.Tensor]],
        hidden: torch.Tensor,
        middle: torch.Tensor,
        where: Callable[[int, int, int], tuple[int, list[int]]],
    ) -> None:
        """Keep each group's leading path (``packing.leading_chain``: its kept part and what this pass
        read of it) for the next batch after the same prefix, in place of the last batch's; none when
        they would hold more than ``STEM_MEMO_TOKENS`` tokens. ``new`` is each layer's new keys and
        values ([rows, heads, width, dim]), ``hidden`` and ``middle`` the pass's states flattened the
        same way, and ``where(b, start, stop)`` the row and slots of group b's path tokens from
        ``start`` to ``stop`` in them.
        """
        lengths = [leading_chain(tree, nodes) for nodes in groups]
        if not all(lengths) or sum(lengths) > STEM_MEMO_TOKENS:
            self._stems = None
            return
        width = new[0][0].shape[-2]
        stems = []
        for b, (nodes, length, (stem, n_kept)) in enumerate(zip(groups, lengths, reused)):
            tokens = tuple(tree.tokens[node] for node in nodes[:length])
            if stem is not None and length == n_kept:  # the path was kept whole: keep it as it is
                stems.append(stem if len(stem.tokens) == length else _stem_start(stem, length))
                continue
            row, slots = where(b, n_kept, length)
            parts: list[list[torch.Tensor]] = [[], [], [], []]
            for index, pair in enumerate(new):
                for which, states in enumerate(pair):
                    own = _take(states[row], -2, 0, slots)
                    if stem is not None and n_kept:
                        own = torch.cat([(stem.keys, stem.values)[which][index][:, :n_kept], own], dim=-2)
                    parts[which].append(own)
            for which, states in ((2, hidden), (3, middle)):
                own = _take(states, 0, row * width, slots)
                if stem is not None and n_kept:
                    own = torch.cat([(stem.hidden if which == 2 else stem.middle)[:n_kept], own])
                parts[which].append(own)
            stems.append(StemKV(tokens, tuple(parts[0]), tuple(parts[1]), parts[2][0], parts[3][0]))
        self._stems = StemMemo(weakref.ref(prefix.state), tuple(stems))

    def _keep_packed_stems(
        self, prefix: Prefix, tree: TokenTree, cache: Cache, hidden: torch.Tensor, middle: torch.Tensor
    ) -> None:
        """After a packed pass with no trunk: keep the leading path of each input it read, parted as a
        batch would part them where attention is the only price (one group per input behind a shared
        start, ``packing.batch_groups``), so that the batch's next round reads only its rows.
        """
        groups = batch_groups(tree, lambda batch, width: batch * width * width)
        new = [layer.new for layer in cache.layers if isinstance(layer, PrefixLayer) and layer.new is not None]
        self._keep_stems(
            prefix,
            tree,
            groups,
            [(None, 0)] * len(groups),
            new,
            hidden,
            middle,
            lambda b, start, stop: (0, groups[b][start:stop]),  # no trunk: a node's slot is its index
        )

    def _read_batch(
        self, prefix: Prefix, ids: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, allowed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over ``ids`` [batch, width], each batch row over a broadcast view of the prefix KV
        (no copy kept): the final and middle hidden states, flattened to [batch * width, hidden].
        """
        batch, width = ids.shape
        state: TorchState = prefix.state
        cache = Cache(
            layers=[
                PrefixLayer(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), keep=0)
                for k, v in zip(state.keys, state.values)
            ]
        )
        out, middle = self._decode(
            input_ids=ids,
            position_ids=q_pos.expand(batch, -1),
            attention_mask=self._masks(q_pos, k_pos, allowed),
            cache=cache,
            use_cache=True,
        )
        return out.last_hidden_state.reshape(batch * width, -1), middle.reshape(batch * width, -1)

    def _copied_hidden(
        self, prefix: Prefix, rows: list[tuple[int, ...]], queries: list[Query]
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The fallback: rows batched and padded, each on its own broadcast copy of the prefix KV."""
        n_prefix, width, batch = prefix.n_tokens, max(len(row) for row in rows), len(rows)
        pad = self.model.config.pad_token_id or 0
        ids = torch.tensor([list(row) + [pad] * (width - len(row)) for row in rows], device=self.device)
        q_pos = n_prefix + torch.arange(width, device=self.device)
        k_pos = torch.arange(n_prefix + width, device=self.device)
        causal = k_pos[None, :] <= q_pos[:, None]
        hidden, middle = self._read_batch(prefix, ids, q_pos[None], k_pos[None], causal[None].expand(batch, -1, -1))
        return hidden, middle, [q.row * width + q.position for q in queries]

    # -- growing rows (generation) -----------------------------------------------------------
    @torch.inference_mode()
    def _grow(
        self,
        prefix: Prefix,
        rows: Rows | None,
        extended: tuple[tuple[int, ...], ...],
        n_new: list[int],
        trunk: tuple[int, ...] = (),
        room: int = 0,
    ) -> Rows:
        """Read only each row's new tokens, after the prefix (and a trunk) and the rows' kept KV, in one pass.

        The rows' tokens live packed after the prefix in one buffer per layer (``Arena``) that
        every step writes its tokens' keys and values into in place (see ``Arena`` for how the
        prefix KV is joined without a copy). New tokens attend to the whole prefix and trunk, to
        the kept tokens of their own row and to their own row's earlier new tokens; positions
        continue each row's own length. A trunk is read causally before the rows; its keys and
        values go into the same buffers as the prompt's, with room behind them for the rows, and
        become the returned prefix. The given ``Prefix`` itself is never modified.
        """
        if self.row_layout != "packed":
            return super()._grow(prefix, rows, extended, n_new, trunk, room)
        kept: GrownRows | None = rows.state if rows is not None else None
        n_prefix, n_trunk = prefix.n_tokens, len(trunk)
        base = n_prefix + n_trunk  # where the rows' positions start
        step = self._step_rows(extended, n_new, kept, base)
        owner, tokens = step.owner, step.tokens
        self.counter.add(n_trunk + len(tokens))
        device = self.device
        trunk_pos = torch.arange(n_prefix, base, device=device)
        q_pos = torch.cat([trunk_pos, base + step.new_depth])
        k_pos = torch.cat(
            [torch.arange(n_prefix, device=device), trunk_pos, base + step.old_depth, base + step.new_depth]
        )
        n_old, n_rows = len(step.old_owner), len(tokens)
        from_trunk = torch.cat(
            [
                torch.ones(n_trunk, n_prefix, dtype=torch.bool, device=device),
                torch.ones(n_trunk, n_trunk, dtype=torch.bool, device=device).tril(),
                torch.zeros(n_trunk, n_old + n_rows, dtype=torch.bool, device=device),
            ],
            1,
        )
        allowed = torch.cat([from_trunk, step.allowed])
        state: TorchState = prefix.state
        if trunk:  # the prompt's KV, the trunk's and the rows' land in new buffers with room
            cache = self._cache(prefix, keep=None, room=n_rows + room)
        else:
            arena = self._arena_for(prefix, kept, n_rows, extended)
            cache = Cache(layers=[ArenaLayer(arena, i, k, v) for i, (k, v) in enumerate(zip(state.keys, state.values))])
        out, middle = self._decode(
            input_ids=torch.tensor([list(trunk) + tokens], device=device),
            position_ids=q_pos[None],
            attention_mask=self._masks(q_pos[None], k_pos[None], allowed[None]),
            cache=cache,
            use_cache=True,
        )
        hidden_all = out.last_hidden_state[0]
        if trunk:
            ends = (hidden_all[n_trunk - 1], middle[0, n_trunk - 1])
            prefix, arena = self._trunk_prefix(prefix, trunk, cache, ends, n_rows)
        arena.used += n_rows
        grown = step.grown(arena)
        # the last new token of each extended row carries its next-token distribution
        last = {k: n_trunk + index for index, k in enumerate(owner)}
        logp = self._logp(hidden_all[list(last.values())]).double().cpu().numpy()
        by_row: list[np.ndarray | None] = [None] * len(extended)
        for position, k in enumerate(last):
            by_row[k] = logp[position]
        return Rows(prefix, extended, tuple(by_row), grown)

    @torch.inference_mode()
    def _grow_many(self, growths: list[Growth]) -> list[Rows]:
        """Several generations' steps in one pass: each step's new tokens laid out as ``_grow`` lays
        out one step's, the steps side by side. The projections and MLP read them all at once; the
        attention reads each step's queries over that step's own prefix, kept rows and new tokens,
        under that step's own masks (``JoinedPass``), so no step sees another's and no step's keys
        are copied beside another's. Steps whose rows share an arena, the copies layout, and a model
        whose attention is not routed (``_route_attention``) take one pass each.
        """
        kept = [g.rows.state if g.rows is not None else None for g in growths]
        arenas = [k.arena for k in kept if isinstance(k, GrownRows)]
        if not self._joins or self.row_layout != "packed" or len({id(a) for a in arenas}) < len(arenas):
            return super()._grow_many(growths)
        device = self.device
        steps = [self._step_rows(g.extended, g.n_new, k, g.prefix.n_tokens) for g, k in zip(growths, kept)]
        arenas = [self._arena_for(g.prefix, k, len(s.tokens), g.extended) for g, k, s in zip(growths, kept, steps)]
        sizes = [len(step.tokens) for step in steps]
        self.counter.add(sum(sizes))
        cache = Cache(
            layers=[
                JoinedLayer(
                    [
                        ArenaLayer(arena, i, g.prefix.state.keys[i], g.prefix.state.values[i])
                        for arena, g in zip(arenas, growths)
                    ],
                    sizes,
                )
                for i in range(self.n_layers)
            ]
        )
        positions, masks = [], []
        for growth, step in zip(growths, steps):
            base = growth.prefix.n_tokens
            q_pos = base + step.new_depth
            k_pos = torch.cat([torch.arange(base, device=device), base + step.old_depth, q_pos])
            positions.append(q_pos)
            masks.append(self._masks(q_pos[None], k_pos[None], step.allowed[None]))
        out, _ = self._decode(
            input_ids=torch.tensor([[t for step in steps for t in step.tokens]], device=device),
            position_ids=torch.cat(positions)[None],
            attention_mask=masks[0],  # handed to the attention untouched; ``JoinedPass`` reads its own
            cache=cache,
            use_cache=True,
            **{JOINED_KEYWORD: JoinedPass(cache.layers, masks, self.layer_types)},
        )
        # each row's last new token, every step's, through the output head at once (it is a weight
        # read as large as a sixth of SmolLM2's layers)
        ends, start = [], 0
        for step in steps:
            ends.append({k: start + index for index, k in enumerate(step.owner)})
            start += len(step.tokens)
        logp = self._logp(out.last_hidden_state[0][[i for last in ends for i in last.values()]]).double().cpu().numpy()
        results, read = [], 0
        for growth, last, step, arena in zip(growths, ends, steps, arenas):
            arena.used += len(step.tokens)
            by_row: list[np.ndarray | None] = [None] * len(growth.extended)
            for k in last:
                by_row[k], read = logp[read], read + 1
            results.append(Rows(growth.prefix, growth.extended, tuple(by_row), step.grown(arena)))
        return results

    def _step_rows(
        self, extended: tuple[tuple[int, ...], ...], n_new: list[int], kept: GrownRows | None, base: int
    ) -> _StepRows:
        """A step's new tokens (``base.new_tokens``) and the mask rows they get: each sees the ``base``
        tokens before the rows, its own row's kept tokens and its own row's earlier new tokens.
        """
        owner, depth, tokens = new_tokens(extended, n_new)
        device = self.device
        new_owner, new_depth = torch.tensor(owner, device=device), torch.tensor(depth, device=device)
        old_owner = kept.owner if kept is not None else new_owner[:0]
        old_depth = kept.depth if kept is not None else new_depth[:0]
        to_kept = new_owner[:, None] == old_owner[None, :]
        to_new = (new_owner[:, None] == new_owner[None, :]) & (new_depth[None, :] <= new_depth[:, None])
        allowed = torch.cat([torch.ones(len(tokens), base, dtype=torch.bool, device=device), to_kept, to_new], 1)
        return _StepRows(owner, tokens, new_owner, new_depth, old_owner, old_depth, allowed)

    def _trunk_prefix(
        self, prefix: Prefix, trunk: tuple[int, ...], cache: Cache, ends: tuple[torch.Tensor, torch.Tensor], n_rows: int
    ) -> tuple[Prefix, Arena]:
        """After a pass with a trunk: the prefix it extends to (views of the new buffers), and the
        arena of the rows read with it, which owns the room behind that prefix.
        """
        layers = [layer for layer in cache.layers if isinstance(layer, PrefixLayer) and layer.buffers is not None]
        assert len(layers) == self.n_layers, "a pass with a trunk writes every layer into a room"
        n = prefix.n_tokens + len(trunk)
        keys = [layer.buffers[0] for layer in layers if layer.buffers is not None]
        values = [layer.buffers[1] for layer in layers if layer.buffers is not None]
        room = Room(keys, values, n)
        room.claim()
        state = TorchState(
            keys=tuple(k[..., :n, :] for k in keys),
            values=tuple(v[..., :n, :] for v in values),
            last_hidden=ends[0].detach(),
            room=room,
            last_middle=ends[1].detach(),
        )
        return Prefix(ids=prefix.ids + trunk, state=state), Arena(keys, values, offset=n)

    def _arena_for(
        self, prefix: Prefix, kept: GrownRows | None, n_new: int, extended: tuple[tuple[int, ...], ...]
    ) -> Arena:
        """The arena this step writes into: the rows' own, or a fresh one (the first step, or a state
        that is not the arena's latest, whose own row tokens are copied over).
        """
        if kept is not None and kept.used == kept.arena.used:
            kept.arena.reserve(n_new)
            return kept.arena
        state: TorchState = prefix.state
        if kept is None and state.room is not None and state.room.claim():
            arena = Arena(state.room.keys, state.room.values, offset=state.room.n_prefix)
            arena.reserve(n_new)
            return arena
        # room for every row to grow to twice its present length before the buffer must grow
        capacity = max(64, 2 * sum(len(row) for row in extended) + n_new)
        arena = Arena.empty(state.keys[0], self.n_layers, capacity)
        if kept is not None:
            arena.reserve(kept.used + n_new)
            for i in range(self.n_layers):
                rows_k, rows_v = kept.arena.rows_of(i, kept.used)
                arena.keys[i][..., : kept.used, :] = rows_k
                arena.values[i][..., : kept.used, :] = rows_v
            arena.used = kept.used
        return arena

    # -- self-check ---------------------------------------------------------------------------
    def _choose_layout(self, requested: str) -> RowLayout:
        layouts: tuple[RowLayout, ...] = ("packed", "copies")
        candidates = layouts if requested == "auto" else tuple(layout for layout in layouts if layout == requested)
        if not candidates:
            raise ValueError(f"row_layout must be 'auto', 'packed' or 'copies', got {requested!r}")
        tolerance: float | None = None  # measured only when a layout misses the float32 bound
        for layout in candidates:
            self.row_layout = layout
            error = self._self_check()
            if error <= LAYOUT_TOLERANCE:
                return layout
            if tolerance is None:
                tolerance = LAYOUT_TOLERANCE + 2 * self._rounding_floor()
            if error <= tolerance:
                logger.info("row layout %r is within %.2e of a full pass, this dtype's rounding", layout, error)
                return layout
            logger.warning("row layout %r disagrees with a full forward pass by %.2e", layout, error)
        raise BackendError(f"no row layout of {self.model.config.model_type!r} matches its full forward pass")

    def _check_case(self) -> CheckCase:
        """The self-check's text and the model's whole pass over it, read once per backend: every
        layout tried, and the rounding floor, compare with the same whole pass.
        """
        if self._checked is None:
            self._checked = whole_pass_case(self.model, self.device, self._vocab)
        return self._checked

    def _rounding_floor(self) -> float:
        """How far the model's own code disagrees with itself in its dtype (``torch_check.rounding_floor``)."""
        return rounding_floor(self.model, self.device, self._check_case())

    @torch.inference_mode()
    def _self_check(self) -> float:
        """Max |log-prob| difference between scored rows and a plain forward pass over the same text."""
        case = self._check_case()
        saved = self.counter.forward_passes, self.counter.tokens_read
        # the packed layout reads the prompt's end as a trunk, so the check covers trunks too
        cut = 6 if self.packs_trunk else len(case.prompt)
        prefix = self.prefill(case.prompt[:cut])
        queries = [Query(r, len(row) - 1, case.ids) for r, row in enumerate(case.rows)]
        scored, _ = self._score_chunk(prefix, tuple(case.prompt[cut:]), pack_tree(case.rows), queries)
        self.counter.forward_passes, self.counter.tokens_read = saved
        return case.gap(scored)


def _take(states: torch.Tensor, dim: int, offset: int, slots: list[int]) -> torch.Tensor:
    """``states`` at ``offset + slots`` along ``dim``: a view where the slots are a run (held until
    the memo that keeps it is replaced), else a copy.
    """
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return states.narrow(dim, offset + slots[0], len(slots))
    return states.index_select(dim, offset + torch.tensor(slots, dtype=torch.long, device=states.device))


def _stem_start(stem: StemKV, length: int) -> StemKV:
    """The first ``length`` tokens of a kept path, as views."""
    return StemKV(
        stem.tokens[:length],
        tuple(k[:, :length] for k in stem.keys),
        tuple(v[:, :length] for v in stem.values),
        stem.hidden[:length],
        stem.middle[:length],
    )


@dataclass(frozen=True)
class _StepRows:
    """One ``grow`` step's new tokens (their rows, as ids and as tensors, and depths), the rows'
    kept tokens, and the mask rows of the new tokens over base, kept and new keys.
    """

    owner: list[int]
    tokens: list[int]
    new_owner: torch.Tensor
    new_depth: torch.Tensor
    old_owner: torch.Tensor
    old_depth: torch.Tensor
    allowed: torch.Tensor

    def grown(self, arena: Arena) -> GrownRows:
        """The rows' state once this step's tokens are written into ``arena``."""
        return GrownRows(
            arena=arena,
            used=arena.used,
            owner=torch.cat([self.old_owner, self.new_owner]),
            depth=torch.cat([self.old_depth, self.new_depth]),
        )


def _route_attention(model: Any) -> bool:
    """Put the model's attention behind a function that reads a joined pass generation by generation
    (``JoinedPass``, under the ``JOINED_KEYWORD`` keyword) and hands every other call to the model's
    own attention function unchanged, registered with ``transformers``' attention interfaces. False
    where that function is not one ``transformers`` names (``eager`` lives in each model's own
    file) or the model does not take the routed one: then each generation's step takes a pass of
    its own.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    own = model.config._attn_implementation
    if own.startswith(ROUTED_ATTENTION):
        return True  # a second backend over the same model
    # the interfaces' tables are typed as holding ``function``s, which mypy will not call
    attention = cast("Callable[..., Any] | None", AttentionInterface._global_mapping.get(own))
    mask = cast("Callable[..., Any] | None", AttentionMaskInterface._global_mapping.get(own))
    if attention is None or mask is None:
        return False

    def routed(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        joined: JoinedPass | None = kwargs.pop(JOINED_KEYWORD, None)
        if joined is None:
            return attention(module, query, *args, **kwargs)
        return joined.attend(attention, module, query, kwargs), None

    name = f"{ROUTED_ATTENTION}{own}"
    AttentionInterface.register(name, routed)
    AttentionMaskInterface.register(name, mask)
    model.set_attn_implementation(name)
    # a model that does not read its attention through the interface keeps its own, and warns
    return bool(model.config._attn_implementation == name)
