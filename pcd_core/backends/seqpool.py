"""The llama.cpp backend's sequence ids: which are free, which prefixes hold theirs, which the running
call reads, and which prefix is evicted when none is free.

llama.cpp bounds sequence ids (``llama_max_parallel_sequences``). A prefix or a group of growing rows
holds an id through a ``Seq``, whose ``id`` becomes None once the id is evicted or freed; the owner's
finalizer queues it (``release_later``) and the next ``take`` or ``drain`` frees it, under the
backend's lock, never inside another call. At most ``max_live_prefixes`` prefixes keep their ids;
beyond that, and when no id is free, the least recently used prefix not pinned by the running call
is evicted (its owner reads it again when used: ``LlamaCppBackend._prefix_seq``). The pool knows no
llama.cpp: ``remove`` takes a sequence's cells out of the KV cache. ``tests/test_llamacpp_backend.py``
checks eviction, re-reading and that every freed sequence leaves no cell behind.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any
from weakref import finalize

from pcd_core.errors import BackendError


class Seq:
    """A sequence id held by a prefix or by growing rows: None once evicted or freed."""

    __slots__ = ("id",)

    def __init__(self, seq: int | None) -> None:
        self.id = seq


class SeqPool:
    """The ids ``0 .. n_seq_max - 1``: free ones, live prefixes (least recently used first), the ids
    pinned by the running call, and those whose owners were collected.
    """

    def __init__(self, n_seq_max: int, max_live_prefixes: int, remove: Callable[[int], None]) -> None:
        self.n_seq_max, self.max_live_prefixes = n_seq_max, max_live_prefixes
        self._remove = remove
        self._free = list(range(n_seq_max - 1, -1, -1))
        self._prefixes: OrderedDict[int, Seq] = OrderedDict()
        self._released: deque[Seq] = deque()
        self._pinned: set[int] = set()

    def release_later(self, owner: Any, holder: Seq) -> None:
        """Free ``holder``'s id once ``owner`` is garbage-collected (at the next ``take`` or ``drain``)."""
        finalize(owner, self._released.append, holder)

    def drain(self) -> None:
        """Free the sequences of collected prefixes and rows (queued by their finalizers)."""
        while self._released:
            holder = self._released.popleft()
            if holder.id is not None:
                self._prefixes.pop(holder.id, None)
                self.drop(holder.id)
                holder.id = None

    def drop(self, seq: int) -> None:
        """Remove ``seq``'s cells and make the id free."""
        self._remove(seq)
        self._free.append(seq)

    def take(self) -> int:
        """A free sequence id, evicting the least recently used unpinned prefix when none is free."""
        self.drain()
        if not self._free and not self.evict_one():
            raise BackendError(
                f"all {self.n_seq_max} llama.cpp sequences are held by rows being generated; "
                "finish or drop some generations first"
            )
        return self._free.pop()

    def evict_one(self) -> bool:
        """Evict the least recently used prefix the running call does not read; False if none can go."""
        for seq, holder in self._prefixes.items():
            if seq not in self._pinned:
                del self._prefixes[seq]
                holder.id = None
                self.drop(seq)
                return True
        return False

    def hold(self, holder: Seq) -> int:
        """A live prefix's sequence, marked most recently used and pinned for this call."""
        seq = holder.id
        if seq is None:
            raise BackendError("internal: hold needs a live sequence; read an evicted prefix again first")
        self._prefixes.move_to_end(seq)
        self._pinned.add(seq)
        return seq

    def register(self, holder: Seq) -> None:
        """Count ``holder`` as a live prefix, evicting the oldest beyond ``max_live_prefixes``."""
        assert holder.id is not None
        self._prefixes[holder.id] = holder
        while len(self._prefixes) > self.max_live_prefixes and self.evict_one():
            pass

    def forget_all(self) -> None:
        """The KV cache was replaced by an empty one: every prefix is evicted (its owner reads it again
        when used) and every id is free. The owners of other ids (growing rows) are told by the backend.
        """
        for holder in self._prefixes.values():
            holder.id = None
        self._prefixes.clear()
        self._pinned.clear()
        self._free = list(range(self.n_seq_max - 1, -1, -1))

    def pin(self, seq: int) -> None:
        """Keep ``seq`` from eviction until the running call ends (``unpin_all``)."""
        self._pinned.add(seq)

    def unpin_all(self) -> None:
        """The running call has ended: every sequence may be evicted again."""
        self._pinned.clear()
