"""The torch backend's KV caches: the ``transformers`` cache layers that read over a prefix's tensors.

A ``TorchState`` is a prefix's keys and values per layer, immutable once made. ``PrefixLayer``
serves a prefill or a packed pass: it returns prefix + new states to attention and keeps only what
the pass asked for, so a read never modifies the prefix it started from. ``Arena`` and
``ArenaLayer`` serve generation (``torch_generation.grow``): the rows' own tokens are written in
place into one buffer per layer, and a ``Room`` lets the first generation after a prefix write right
behind it; ``JoinedLayer`` writes several generations' steps into their arenas in one pass, and
``JoinedPass`` attends each over its own keys. ``StemMemo`` and ``BatchLayer`` serve a batch of
groups (``torch_batched.py``). The torch backend's modules reach this one only through
``torch_backend``, which checks that torch is installed.
``tests/test_torch_backend.py`` (grow against a whole pass, the prefix left unchanged) covers it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch  # reached only through ``torch_backend``, which checks that torch is there
from transformers.cache_utils import DynamicLayer

from pcd_core.backends.packing import shared_start

logger = logging.getLogger(__name__)


class Room:
    """Space reserved after a prefix's KV in the same buffers, which one generation may claim.

    A prefix read with ``room`` keeps its keys and values as views at the start of larger buffers;
    the first ``grow`` after it writes the rows' tokens right behind them, so every step attends
    over one contiguous view instead of joining a copy of the prefix to the rows in each layer.
    Only one generation may own the space: a second one after the same prefix gets the ordinary
    arena. The prefix's own views never reach the room, so nothing written there changes it.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], n_prefix: int) -> None:
        self.keys, self.values, self.n_prefix = keys, values, n_prefix
        self._claimed = False
        self._claim_lock = threading.Lock()

    def claim(self) -> bool:
        with self._claim_lock:
            taken, self._claimed = self._claimed, True
            return not taken


@dataclass(frozen=True)
class TorchState:
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    last_hidden: torch.Tensor
    last_middle: torch.Tensor  # the middle layers' mean at the last token (base.py's middle_layers)
    room: Room | None = None
    #: where the pass that made the state began reading (its trunk, or what a prefill read), and its
    #: final and middle states per token there, from which ``TorchPasses._cut`` takes the last states
    #: of a cut that ends inside (a tenth of the KV's size on SmolLM2)
    trunk_states: tuple[int, torch.Tensor, torch.Tensor] | None = None


class Arena:
    """One buffer per layer for the row tokens of a generation, written in place step by step.

    Two kinds. In a prefix's claimed ``Room`` (``offset`` is the prefix's length) the rows follow
    the prefix in the same buffers, and a layer attends over one view of both: no copy at all. In
    a buffer of its own (``offset`` 0) only the rows live there, and the prefix KV is joined with
    them inside each layer for one attention call, then dropped; either way a generation holds no
    copy of the prefix. ``used`` says how many row tokens are written; a state that does not own
    the buffer's end (an older ``Rows`` grown a second time) gets a fresh buffer.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], offset: int = 0) -> None:
        self.keys, self.values, self.offset = keys, values, offset
        self.used = 0

    @classmethod
    def empty(cls, like: torch.Tensor, n_layers: int, capacity: int) -> Arena:
        shape = (*like.shape[:-2], capacity, like.shape[-1])
        keys = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(n_layers)]
        values = [torch.empty(shape, dtype=like.dtype, device=like.device) for _ in range(n_layers)]
        return cls(keys, values)

    @property
    def end(self) -> int:
        """Where the next row token goes in the buffers."""
        return self.offset + self.used

    def rows_of(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``n`` row tokens' keys and values of one layer."""
        span = slice(self.offset, self.offset + n)
        return self.keys[layer][..., span, :], self.values[layer][..., span, :]

    def reserve(self, n_new: int) -> None:
        needed = self.end + n_new
        if needed > self.keys[0].shape[-2]:
            if self.offset:  # past the reserved room: from here the buffers hold a prefix copy
                logger.debug("a generation outgrew the room after its prefix; its buffers grow")
            size = max(needed, 2 * self.keys[0].shape[-2])
            self.keys = [grown(k, self.end, size) for k in self.keys]
            self.values = [grown(v, self.end, size) for v in self.values]


def grown(buffer: torch.Tensor, used: int, size: int) -> torch.Tensor:
    bigger = torch.empty((*buffer.shape[:-2], size, buffer.shape[-1]), dtype=buffer.dtype, device=buffer.device)
    bigger[..., :used, :] = buffer[..., :used, :]
    return bigger


@dataclass(frozen=True)
class GrownRows:
    """Growing rows packed after a prefix in an ``Arena``: per row token its row and its depth."""

    arena: Arena
    used: int  # the arena is this state's up to here
    owner: torch.Tensor
    depth: torch.Tensor


class ArenaLayer(DynamicLayer):
    """A cache layer that appends the step's keys and values to the rows' arena in place and attends
    over the prefix and the rows written so far (joined for this call only).
    """

    def __init__(self, arena: Arena, index: int, prefix_keys: torch.Tensor, prefix_values: torch.Tensor) -> None:
        super().__init__()
        self.arena, self.index = arena, index
        self.keys, self.values = prefix_keys, prefix_values
        self.device = prefix_keys.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, n = self.arena.end, key_states.shape[-2]
        buffer_k, buffer_v = self.arena.keys[self.index], self.arena.values[self.index]
        buffer_k[..., start : start + n, :] = key_states
        buffer_v[..., start : start + n, :] = value_states
        if self.arena.offset:  # the prefix sits before the rows in the same buffers
            return buffer_k[..., : start + n, :], buffer_v[..., : start + n, :]
        assert self.keys is not None and self.values is not None
        rows_k, rows_v = self.arena.rows_of(self.index, self.arena.used + n)
        return torch.cat([self.keys, rows_k], dim=-2), torch.cat([self.values, rows_v], dim=-2)


class JoinedLayer(DynamicLayer):
    """Several generations' ``ArenaLayer``s in one pass (``torch_generation.grow_many``): the pass's new
    keys and values are split by generation and each part written into its own arena. Each
    generation's keys and values stay in ``parts`` for ``JoinedPass.attend``, which attends each
    generation's queries over its own only; nothing is copied side by side. What ``update`` returns
    (the first generation's) is what the model hands the attention, which does not read it.
    """

    def __init__(self, parts: list[ArenaLayer], sizes: list[int]) -> None:
        super().__init__()
        self.parts, self.sizes = parts, sizes
        self.keys, self.values = parts[0].keys, parts[0].values
        self.device = parts[0].device
        self.is_initialized = True
        self.read: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.read = [
            part.update(k, v)
            for part, k, v in zip(
                self.parts, key_states.split(self.sizes, dim=-2), value_states.split(self.sizes, dim=-2), strict=True
            )
        ]
        return self.read[0]


@dataclass(frozen=True, eq=False)
class JoinedPass:
    """What a joined pass's attention needs (``torch_generation.grow_many``): its ``JoinedLayer``s (each
    knows how many of the pass's tokens each generation has) and each generation's own masks (a
    tensor, or one per attention type). The model passes it to the attention function as a keyword
    argument.
    """

    layers: Sequence[Any]  # the pass's ``JoinedLayer``s
    masks: list[Any]
    layer_types: tuple[str, ...]

    def attend(self, attention: Any, module: Any, query: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """Each generation's queries over its own keys and values, through the model's own attention
        function, the outputs back in pass order ([batch, queries, heads, dim], as it returns them).
        """
        layer = self.layers[module.layer_idx]
        kind = self.layer_types[module.layer_idx]
        outputs = []
        for (keys, values), part, masks in zip(layer.read, query.split(layer.sizes, dim=-2), self.masks, strict=True):
            mask = masks[kind] if isinstance(masks, dict) else masks
            outputs.append(attention(module, part, keys, values, mask, **kwargs)[0])
        return torch.cat(outputs, dim=1)


class PrefixLayer(DynamicLayer):
    """A cache layer over existing tensors. ``update`` returns prefix + new states and keeps the first
    ``keep`` of them (all for a prefill, prefix + trunk for a pass with a trunk, none otherwise); what
    it does not keep lives for one layer, then goes, unless ``record`` asks for the new states. A
    prefill with ``room`` writes prefix + new states into buffers ``room`` tokens longer and keeps
    views of them (``buffers``), for a ``Room``.
    """

    def __init__(
        self,
        keys: torch.Tensor | None,
        values: torch.Tensor | None,
        keep: int | None,
        room: int = 0,
        record: bool = False,
    ) -> None:
        super().__init__()
        self.keep, self.room, self.record = keep, room, record
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None  # with ``record``: the pass's new states
        if keys is not None:
            self.keys, self.values = keys, values
            self.device = keys.device
            self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        if self.record:
            self.new = (key_states, value_states)
        if self.room and self.keep is None:
            return self._into_room(key_states, value_states)
        keys = torch.cat([self.keys, key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        if self.keep is None:
            self.keys, self.values = keys, values
        elif self.keep:
            # a copy, so that the rows' states are not held alive behind a view
            self.keys, self.values = keys[..., : self.keep, :].clone(), values[..., : self.keep, :].clone()
        return keys, values

    def _into_room(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        n_old = self.keys.shape[-2] if self.keys.dim() == key_states.dim() else 0  # lazy init: a 1-D empty
        n = n_old + key_states.shape[-2]
        buffers = []
        for old, new in ((self.keys, key_states), (self.values, value_states)):
            buffer = new.new_empty((*new.shape[:-2], n + self.room, new.shape[-1]))
            if n_old:
                buffer[..., :n_old, :] = old
            buffer[..., n_old:n, :] = new
            buffers.append(buffer)
        self.buffers = (buffers[0], buffers[1])
        self.keys, self.values = buffers[0][..., :n, :], buffers[1][..., :n, :]
        return self.keys, self.values


@dataclass(frozen=True, eq=False)
class StemKV:
    """The keys and values (per layer ``[kv heads, n, dim]``) and hidden states (``[n, hidden]``) of a
    batch group's leading path (``packing.leading_chain``), read after one prefix: an input's request.
    """

    tokens: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    hidden: torch.Tensor
    middle: torch.Tensor


@dataclass(frozen=True, eq=False)
class StemMemo:
    """The leading paths of the last batch of groups a backend read, and the prefix they followed
    (held weakly: an evicted head takes its paths' use with it). A batch reads its inputs' requests in
    front of their rows in every round (``pcd_core/planning/batching.py``); from the second round on, each
    group starts with the path the round before read, and the backend reads those keys from here.
    """

    prefix: weakref.ref[TorchState]
    stems: tuple[StemKV, ...]

    def longest(self, state: TorchState, tokens: tuple[int, ...]) -> tuple[StemKV | None, int]:
        """The kept path that shares the longest start with ``tokens`` after ``state``, and how long."""
        if self.prefix() is not state:
            return None, 0
        best: tuple[StemKV | None, int] = (None, 0)
        for stem in self.stems:
            n = shared_start(stem.tokens, tokens)
            if n > best[1]:
                best = (stem, n)
        return best


class BatchLayer(DynamicLayer):
    """A batch of groups' pass (``torch_batched.batched_hidden``). Batch row b attends over the prefix
    (one tensor, broadcast), then over its slots: the first ``reused[b][1]`` keys of a kept path
    (``StemMemo``), then its new tokens. ``order`` ([batch, 1, slots, 1]) picks each slot from the
    kept keys padded to the longest (first) and the pass's new keys (after). The new keys and values
    are kept in ``new`` for the caller to keep its paths.
    """

    def __init__(
        self,
        index: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        reused: list[tuple[StemKV | None, int]],
        order: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.index, self.reused, self.order = index, reused, order
        self.keys, self.values = keys, values
        self.device = keys.device
        self.is_initialized = True
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.new = (key_states, value_states)
        batch = key_states.shape[0]
        slots = [self._slots(key_states, 0), self._slots(value_states, 1)]
        assert self.keys is not None and self.values is not None
        return (
            torch.cat([self.keys.expand(batch, -1, -1, -1), slots[0]], dim=-2),
            torch.cat([self.values.expand(batch, -1, -1, -1), slots[1]], dim=-2),
        )

    def _slots(self, new: torch.Tensor, which: int) -> torch.Tensor:
        """Each batch row's slots: its kept keys (or values) then its new ones, in ``order``."""
        if self.order is None:
            return new
        longest = max(n for _, n in self.reused)
        kept = new.new_zeros((*new.shape[:-2], longest, new.shape[-1]))
        for b, (stem, n) in enumerate(self.reused):
            if stem is not None and n:
                kept[b, :, :n] = (stem.keys if which == 0 else stem.values)[self.index][:, :n]
        both = torch.cat([kept, new], dim=-2)
        return both.gather(-2, self.order.expand(-1, both.shape[1], -1, both.shape[-1]))
