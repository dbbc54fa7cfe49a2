"""A small LRU with its own lock: the engine's caches (compiled schemas, head KV, priors).

Each cache keeps its own lock so that it stays consistent when the model lock is off: compiling needs
no model, and a backend that batches concurrent calls itself (vLLM) runs with no model lock.
``tests/test_engine.py`` checks hits, misses and eviction through ``Stats.head_cache``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class Lru(OrderedDict):
    """A small LRU with its own lock; ``size`` 0 keeps nothing (every lookup is a miss)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self._guard = threading.RLock()

    def get_or(self, key: Any, make: Callable[[], Any]) -> tuple[Any, bool]:
        """The value under ``key`` and True, or ``make()``'s (kept, the oldest evicted) and False."""
        with self._guard:
            if key in self:
                self.move_to_end(key)
                return self[key], True
            value = make()
            if self.size > 0:
                self[key] = value
                while len(self) > self.size:
                    self.popitem(last=False)
            return value, False
