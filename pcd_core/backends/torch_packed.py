"""Rows read packed: one sequence after the prefix under a tree-shaped mask, sharing the prefix KV.

Rows share the prefix KV without a copy per row. A pass packs the trunk and then every row into one
sequence after the prefix, under a tree-shaped 4D mask: the trunk is causal, each row token sees the
whole prefix, the whole trunk and the earlier tokens of its own row, and each row's positions restart
at the trunk's end. The trunk's keys and values are kept, so the pass also returns the extended
prefix. Where the rows part into groups that read for less as a batch, the pass is read that way
instead (``torch_batched.py``); the ``copies`` layout reads every row as a batch of its own. The
output head runs only at queried positions: on this CPU the head over every row token cost as much
as the whole input prefill. ``tests/test_torch_backend.py`` reads packed rows against whole passes.
"""

from __future__ import annotations

import numpy as np
import torch  # reached only through ``torch_backend``, which checks that torch is there

from pcd_core.backends.base import Prefix, Query
from pcd_core.backends.packing import TokenTree
from pcd_core.backends.torch_batched import batched_hidden, copied_hidden, keep_packed_stems, pass_groups
from pcd_core.backends.torch_cache import TorchState
from pcd_core.backends.torch_passes import TorchPasses


@torch.inference_mode()
def read_chunk(
    backend: TorchPasses,
    prefix: Prefix | None,
    trunk: tuple[int, ...],
    tree: TokenTree,
    queries: list[Query],
    keep_hidden: bool,
) -> tuple[list[np.ndarray], TorchState | None, list[np.ndarray]]:
    """One pass over a chunk of rows in the backend's layout: the queried log-probs, the prefix a
    trunk extends to (packed only), and with ``keep_hidden`` each query's final and middle states.
    """
    state = None
    if backend.row_layout == "packed":
        hidden, middle, index, state = packed_hidden(backend, prefix, trunk, tree, queries)
    else:
        assert prefix is not None and not trunk  # packs_trunk is false: score prefilled the trunk
        hidden, middle, index = copied_hidden(backend, prefix, tree.rows, queries)
    read = hidden[index]
    logp = backend._logp(read)
    values = [logp[k, list(q.ids)].double().cpu().numpy() for k, q in enumerate(queries)]
    if not keep_hidden:
        return values, state, []
    return values, state, list(torch.cat([read, middle[index]], -1).float().cpu().numpy())


def packed_hidden(
    backend: TorchPasses, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
) -> tuple[torch.Tensor, torch.Tensor, list[int], TorchState | None]:
    """The trunk and the tree in one sequence after the prefix, or a batch of the tree's groups
    where ``torch_batched.pass_groups`` finds one: every position's final and middle states, each
    query's index among them, and the prefix state a trunk extends to.
    """
    device = backend.device
    n_prefix, n_trunk = (prefix.n_tokens if prefix is not None else 0), len(trunk)
    groups = pass_groups(backend, n_prefix, n_trunk, tree, prefix)
    if groups is not None:
        assert prefix is not None  # pass_groups batches only a pass after a prefix
        hidden, middle, index = batched_hidden(backend, prefix, tree, groups, queries)
        return hidden, middle, index, None
    depth = torch.tensor(tree.depth, device=device, dtype=torch.long)
    q_pos = torch.cat([torch.arange(n_trunk, device=device), n_trunk + depth]) + n_prefix
    k_pos = torch.cat([torch.arange(n_prefix, device=device), q_pos])
    allowed = torch.cat(
        [
            torch.ones(len(q_pos), n_prefix, dtype=torch.bool, device=device),
            torch.from_numpy(tree.with_trunk(n_trunk)).to(device),
        ],
        1,
    )
    record = prefix is not None and not trunk  # a batch's first round, packed: its requests are kept
    cache = backend._cache(prefix, keep=n_prefix + n_trunk if trunk else 0, record=record)
    out, middle = backend._decode(
        input_ids=torch.tensor([list(trunk) + tree.tokens], device=device),
        position_ids=q_pos[None],
        attention_mask=backend._masks(q_pos[None], k_pos[None], allowed[None]),
        cache=cache,
        use_cache=True,
    )
    hidden, middle = out.last_hidden_state[0], middle[0]
    if record:
        assert prefix is not None
        keep_packed_stems(backend, prefix, tree, cache, hidden, middle)
    index = [n_trunk + tree.node_of[q.row][q.position] for q in queries]
    kept = None
    if trunk:  # the trunk's states are kept for a ``cut`` inside it; rows' states are not
        states = (n_prefix, hidden[:n_trunk].clone(), middle[:n_trunk].clone())
        kept = backend._kept(cache, hidden[n_trunk - 1], middle[n_trunk - 1], states)
    return hidden, middle, index, kept
