"""Generation: rows that grow a few tokens a step, each step reading only the new tokens.

``grow`` keeps the rows' own KV in an arena (``torch_cache.Arena``). After a prefix read with
``room``, the arena is that room, right behind the prefix in the same buffers, so a step copies
nothing. Several generations' steps share one pass (``grow_many``): the projections and MLP read
every step's tokens at once, and the model's attention, routed through a function registered with
``transformers`` (``route_attention``), attends each step's queries over that step's own keys
(``JoinedPass``), so a joined step attends over what its steps would alone and copies no step's
keys beside another's. The copies layout generates through the base class's ``_grow`` instead
(``TorchBackend`` dispatches). ``tests/test_generation.py`` checks a step against prefills and a
joined step against each generation's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch  # reached only through ``torch_backend``, which checks that torch is there
from transformers.cache_utils import Cache

from pcd_core.backends.base import Growth, Prefix, Rows, new_tokens
from pcd_core.backends.torch_cache import (
    Arena,
    ArenaLayer,
    GrownRows,
    JoinedLayer,
    JoinedPass,
    PrefixLayer,
    Room,
    TorchState,
)
from pcd_core.backends.torch_passes import TorchPasses

#: the keyword a joined pass of steps hands its ``JoinedPass`` to the attention under (``route_attention``)
JOINED_KEYWORD = "pcd_joined"

#: the name the routed attention is registered under, before the model's own implementation's
ROUTED_ATTENTION = "pcd_routed_"


def joins(growths: list[Growth]) -> bool:
    """Whether ``grow_many`` can read these steps in one pass: no two continue rows in one arena
    (each step writes its arena in place). The backend also needs the packed layout and a routed
    attention (``route_attention``); otherwise each step takes a pass of its own.
    """
    kept = [g.rows.state if g.rows is not None else None for g in growths]
    arenas = [k.arena for k in kept if isinstance(k, GrownRows)]
    return len({id(a) for a in arenas}) == len(arenas)


@torch.inference_mode()
def grow(
    backend: TorchPasses,
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
    kept: GrownRows | None = rows.state if rows is not None else None
    n_prefix, n_trunk = prefix.n_tokens, len(trunk)
    base = n_prefix + n_trunk  # where the rows' positions start
    step = _step_rows(backend, extended, n_new, kept, base)
    owner, tokens = step.owner, step.tokens
    backend.counter.add(n_trunk + len(tokens))
    device = backend.device
    trunk_pos = torch.arange(n_prefix, base, device=device)
    q_pos = torch.cat([trunk_pos, base + step.new_depth])
    k_pos = torch.cat([torch.arange(n_prefix, device=device), trunk_pos, base + step.old_depth, base + step.new_depth])
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
        cache = backend._cache(prefix, keep=None, room=n_rows + room)
    else:
        arena = _arena_for(backend, prefix, kept, n_rows, extended)
        cache = Cache(layers=[ArenaLayer(arena, i, k, v) for i, (k, v) in enumerate(zip(state.keys, state.values))])
    out, middle = backend._decode(
        input_ids=torch.tensor([list(trunk) + tokens], device=device),
        position_ids=q_pos[None],
        attention_mask=backend._masks(q_pos[None], k_pos[None], allowed[None]),
        cache=cache,
        use_cache=True,
    )
    hidden_all = out.last_hidden_state[0]
    if trunk:
        ends = (hidden_all[n_trunk - 1], middle[0, n_trunk - 1])
        prefix, arena = _trunk_prefix(backend, prefix, trunk, cache, ends, n_rows)
    arena.used += n_rows
    grown = step.grown(arena)
    # the last new token of each extended row carries its next-token distribution
    last = {k: n_trunk + index for index, k in enumerate(owner)}
    logp = backend._logp(hidden_all[list(last.values())]).double().cpu().numpy()
    by_row: list[np.ndarray | None] = [None] * len(extended)
    for position, k in enumerate(last):
        by_row[k] = logp[position]
    return Rows(prefix, extended, tuple(by_row), grown)


@torch.inference_mode()
def grow_many(backend: TorchPasses, growths: list[Growth]) -> list[Rows]:
    """Several generations' steps in one pass: each step's new tokens laid out as ``grow`` lays
    out one step's, the steps side by side. The projections and MLP read them all at once; the
    attention reads each step's queries over that step's own prefix, kept rows and new tokens,
    under that step's own masks (``JoinedPass``), so no step sees another's and no step's keys
    are copied beside another's. ``TorchBackend`` calls it only in the packed layout, with the
    attention routed (``route_attention``), for steps that ``joins`` admits.
    """
    kept = [g.rows.state if g.rows is not None else None for g in growths]
    device = backend.device
    steps = [_step_rows(backend, g.extended, g.n_new, k, g.prefix.n_tokens) for g, k in zip(growths, kept)]
    arenas = [_arena_for(backend, g.prefix, k, len(s.tokens), g.extended) for g, k, s in zip(growths, kept, steps)]
    sizes = [len(step.tokens) for step in steps]
    backend.counter.add(sum(sizes))
    cache = Cache(
        layers=[
            JoinedLayer(
                [
                    ArenaLayer(arena, i, g.prefix.state.keys[i], g.prefix.state.values[i])
                    for arena, g in zip(arenas, growths)
                ],
                sizes,
            )
            for i in range(backend.n_layers)
        ]
    )
    positions, masks = [], []
    for growth, step in zip(growths, steps):
        base = growth.prefix.n_tokens
        q_pos = base + step.new_depth
        k_pos = torch.cat([torch.arange(base, device=device), base + step.old_depth, q_pos])
        positions.append(q_pos)
        masks.append(backend._masks(q_pos[None], k_pos[None], step.allowed[None]))
    out, _ = backend._decode(
        input_ids=torch.tensor([[t for step in steps for t in step.tokens]], device=device),
        position_ids=torch.cat(positions)[None],
        attention_mask=masks[0],  # handed to the attention untouched; ``JoinedPass`` reads its own
        cache=cache,
        use_cache=True,
        **{JOINED_KEYWORD: JoinedPass(cache.layers, masks, backend.layer_types)},
    )
    # each row's last new token, every step's, through the output head at once (it is a weight
    # read as large as a sixth of SmolLM2's layers)
    ends, start = [], 0
    for step in steps:
        ends.append({k: start + index for index, k in enumerate(step.owner)})
        start += len(step.tokens)
    logp = backend._logp(out.last_hidden_state[0][[i for last in ends for i in last.values()]]).double().cpu().numpy()
    results, read = [], 0
    for growth, last, step, arena in zip(growths, ends, steps, arenas):
        arena.used += len(step.tokens)
        by_row: list[np.ndarray | None] = [None] * len(growth.extended)
        for k in last:
            by_row[k], read = logp[read], read + 1
        results.append(Rows(growth.prefix, growth.extended, tuple(by_row), step.grown(arena)))
    return results


def _step_rows(
    backend: TorchPasses, extended: tuple[tuple[int, ...], ...], n_new: list[int], kept: GrownRows | None, base: int
) -> _StepRows:
    """A step's new tokens (``base.new_tokens``) and the mask rows they get: each sees the ``base``
    tokens before the rows, its own row's kept tokens and its own row's earlier new tokens.
    """
    owner, depth, tokens = new_tokens(extended, n_new)
    device = backend.device
    new_owner, new_depth = torch.tensor(owner, device=device), torch.tensor(depth, device=device)
    old_owner = kept.owner if kept is not None else new_owner[:0]
    old_depth = kept.depth if kept is not None else new_depth[:0]
    to_kept = new_owner[:, None] == old_owner[None, :]
    to_new = (new_owner[:, None] == new_owner[None, :]) & (new_depth[None, :] <= new_depth[:, None])
    allowed = torch.cat([torch.ones(len(tokens), base, dtype=torch.bool, device=device), to_kept, to_new], 1)
    return _StepRows(owner, tokens, new_owner, new_depth, old_owner, old_depth, allowed)


def _trunk_prefix(
    backend: TorchPasses,
    prefix: Prefix,
    trunk: tuple[int, ...],
    cache: Cache,
    ends: tuple[torch.Tensor, torch.Tensor],
    n_rows: int,
) -> tuple[Prefix, Arena]:
    """After a pass with a trunk: the prefix it extends to (views of the new buffers), and the
    arena of the rows read with it, which owns the room behind that prefix.
    """
    layers = [layer for layer in cache.layers if isinstance(layer, PrefixLayer) and layer.buffers is not None]
    assert len(layers) == backend.n_layers, "a pass with a trunk writes every layer into a room"
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
    backend: TorchPasses, prefix: Prefix, kept: GrownRows | None, n_new: int, extended: tuple[tuple[int, ...], ...]
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
    arena = Arena.empty(state.keys[0], backend.n_layers, capacity)
    if kept is not None:
        arena.reserve(kept.used + n_new)
        for i in range(backend.n_layers):
            rows_k, rows_v = kept.arena.rows_of(i, kept.used)
            arena.keys[i][..., : kept.used, :] = rows_k
            arena.values[i][..., : kept.used, :] = rows_v
        arena.used = kept.used
    return arena


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


def route_attention(model: Any) -> bool:
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
