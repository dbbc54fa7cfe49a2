"""Rows read as a batch, each batch row over its own broadcast view of the prefix KV.

A pass after a prefix whose rows part into groups of their own (the requests of many inputs in a
batch, ``pcd_core/planning/batching.py``) is read as a batch of those groups instead of one packed
sequence when that costs less (``packing.batch_groups``): a packed mask is dense, so packed inputs
cost attention in the square of their summed length, and a batch only in each one's. Such a pass
keeps the keys and states of each input's request (``StemMemo``, in the backend's ``_stems``), and
the next pass after the same prefix whose groups start with them (the batch's next round, which asks
for every request again in front of its rows) takes them from there and reads only what follows.
The ``copies`` layout, the fallback for a model whose attention ignores custom masks, is a batch too:
one row per batch row, padded. ``tests/test_batch_groups.py`` reads the same values batched, packed
and input by input, with the memo and without.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch  # reached only through ``torch_backend``, which checks that torch is there
from transformers.cache_utils import Cache

from pcd_core.backends.base import Prefix, Query
from pcd_core.backends.packing import TokenTree, batch_groups, leading_chain
from pcd_core.backends.torch_cache import BatchLayer, PrefixLayer, StemKV, StemMemo, TorchState
from pcd_core.backends.torch_passes import TorchPasses

#: what one token's projections and MLP cost, in keys of its attention: a pass after a prefix reads
#: its rows packed as one sequence (a dense mask: each token attends over all of them) or as a batch
#: of groups padded to the widest (``packing.batch_groups``), whichever costs fewer key-equivalents.
#: In arithmetic SmolLM2-135M's token is about 2,800 keys (0.19 GFLOP against 69 kFLOP a key over 30
#: layers), but masked attention runs at a lower rate than the matrix products, so a key costs more
#: time than its arithmetic. The figure decides only where the layouts' costs are close, and there
#: either reads about as fast; many inputs' requests are far from close (docs/benchmarks.md).
TOKEN_COST_IN_KEYS = 1000

#: the most tokens of leading paths a backend keeps from its last pass after a prefix (``StemMemo``):
#: a batch group's requests sum to at most ``batching.BATCH_STEM_TOKENS``, so this holds a group's with
#: room to spare; kept until the next such pass, it costs SmolLM2-135M at most 90 MiB in float32
STEM_MEMO_TOKENS = 2048


def pass_groups(
    backend: TorchPasses, n_prefix: int, n_trunk: int, tree: TokenTree, prefix: Prefix | None = None
) -> list[list[int]] | None:
    """The groups a pass reads side by side as a batch (``packing.batch_groups``), or None where
    one packed sequence costs less or the batch's copies of the prefix would not fit in
    ``max_pass_bytes``: a pass with a trunk (whose KV it keeps) and the copies layout always
    read their own way. A tree that stays one group is read as a batch of one when ``prefix``
    is given and the last batch kept the start of its path (``StemMemo``): a later round that
    only one input of a batch needed.
    """
    if backend.row_layout != "packed" or n_trunk or not n_prefix:
        return None
    groups = batch_groups(tree, lambda batch, width: batch * width * (TOKEN_COST_IN_KEYS + n_prefix + width))
    if len(groups) < 2:
        whole = [list(range(len(tree.tokens)))]
        kept = (
            prefix is not None and backend._stems is not None and reused_stems(backend, prefix, tree, whole)[0][1] > 0
        )
        return whole if kept else None
    fits = backend.max_pass_bytes is None or (
        backend._batch_bytes(len(groups), max(map(len, groups)), n_prefix) <= backend.max_pass_bytes
    )
    return groups if fits else None


def reused_stems(
    backend: TorchPasses, prefix: Prefix, tree: TokenTree, groups: list[list[int]]
) -> list[tuple[StemKV | None, int]]:
    """Per group, the kept path it starts with (``StemMemo``) and how many of its first tokens that
    path gives: the tokens it shares with the group's leading path, and never the group's last token
    (a pass reads at least one token a row). A path that gives less than half the group's leading
    path is not taken: another batch's inputs share the opening of their template with these, and
    taking a few tokens costs more in copies than reading them.
    """
    memo = backend._stems
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


def batched_hidden(
    backend: TorchPasses, prefix: Prefix, tree: TokenTree, groups: list[list[int]], queries: list[Query]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A tree read as a batch of its groups (``packing.batch_groups``): group b is batch row b,
    padded to the widest, over its own broadcast view of the prefix KV and its own tokens only.
    A token in several groups (an ancestor they share) is answered from the first. A group that
    starts with a path the last batch read after the same prefix (an input's request, read again
    in each round: ``pcd_core/planning/batching.py``) takes that path's keys, values and hidden states from
    ``StemMemo`` and reads only the rest; the paths this pass reads replace the memo.
    """
    device = backend.device
    n_prefix, batch = prefix.n_tokens, len(groups)
    reused = reused_stems(backend, prefix, tree, groups)
    rests = [nodes[n:] for nodes, (_, n) in zip(groups, reused)]
    width = max(map(len, rests))
    longest = max(n for _, n in reused)
    n_slots = max(len(nodes) for nodes in groups)  # a row's kept and new keys after the prefix
    pad = backend.model.config.pad_token_id or 0
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
    q_pos = n_prefix + torch.from_numpy(depth).to(device)
    k_pos = torch.cat(
        [torch.arange(n_prefix, device=device).expand(batch, -1), n_prefix + torch.from_numpy(key_depth).to(device)],
        1,
    )
    state: TorchState = prefix.state
    picks = torch.from_numpy(order).to(device)[:, None, :, None] if longest else None
    layers = [BatchLayer(i, k, v, reused, picks) for i, (k, v) in enumerate(zip(state.keys, state.values))]
    out, middle = backend._decode(
        input_ids=torch.from_numpy(ids).to(device),
        position_ids=q_pos,
        attention_mask=backend._masks(q_pos, k_pos, torch.from_numpy(allowed).to(device)),
        cache=Cache(layers=[*layers]),
        use_cache=True,
    )
    hidden = out.last_hidden_state.reshape(batch * width, -1)
    middle = middle.reshape(batch * width, -1)
    states = [layer.new for layer in layers if layer.new is not None]
    _keep_stems(
        backend,
        prefix,
        tree,
        groups,
        reused,
        states,
        hidden,
        middle,
        lambda b, start, stop: (b, list(range(stop - start))),
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
    backend: TorchPasses,
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
        backend._stems = None
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
    backend._stems = StemMemo(weakref.ref(prefix.state), tuple(stems))


def keep_packed_stems(
    backend: TorchPasses, prefix: Prefix, tree: TokenTree, cache: Cache, hidden: torch.Tensor, middle: torch.Tensor
) -> None:
    """After a packed pass with no trunk: keep the leading path of each input it read, parted as a
    batch would part them where attention is the only price (one group per input behind a shared
    start, ``packing.batch_groups``), so that the batch's next round reads only its rows.
    """
    groups = batch_groups(tree, lambda batch, width: batch * width * width)
    new = [layer.new for layer in cache.layers if isinstance(layer, PrefixLayer) and layer.new is not None]
    _keep_stems(
        backend,
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
    backend: TorchPasses,
    prefix: Prefix,
    ids: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    allowed: torch.Tensor,
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
    out, middle = backend._decode(
        input_ids=ids,
        position_ids=q_pos.expand(batch, -1),
        attention_mask=backend._masks(q_pos, k_pos, allowed),
        cache=cache,
        use_cache=True,
    )
    return out.last_hidden_state.reshape(batch * width, -1), middle.reshape(batch * width, -1)


def copied_hidden(
    backend: TorchPasses, prefix: Prefix, rows: list[tuple[int, ...]], queries: list[Query]
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The fallback: rows batched and padded, each on its own broadcast copy of the prefix KV."""
    device = backend.device
    n_prefix, width, batch = prefix.n_tokens, max(len(row) for row in rows), len(rows)
    pad = backend.model.config.pad_token_id or 0
    ids = torch.tensor([list(row) + [pad] * (width - len(row)) for row in rows], device=device)
    q_pos = n_prefix + torch.arange(width, device=device)
    k_pos = torch.arange(n_prefix + width, device=device)
    causal = k_pos[None, :] <= q_pos[:, None]
    hidden, middle = _read_batch(backend, prefix, ids, q_pos[None], k_pos[None], causal[None].expand(batch, -1, -1))
    return hidden, middle, [q.row * width + q.position for q in queries]


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
