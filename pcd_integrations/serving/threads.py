"""Blocking engine work stepped from async code without holding up the event loop.

The engine is synchronous: one call reads the model under its lock. Async entry points (the
adapters' ``astream`` forms, the HTTP route's server-sent events) step its iterators here, one item
per worker-thread call, so other requests and the server's own tasks keep running between tokens.
``tests/test_langchain.py``, ``tests/test_llama_index_llm.py`` and ``tests/test_chat_completions.py``
check that the loop keeps turning and that the streams equal their blocking forms.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterator
from typing import TypeVar

from pcd_core.concurrency.model_lock import in_thread

__all__ = ["iterate_in_thread"]

_T = TypeVar("_T")


async def iterate_in_thread(items: Iterator[_T]) -> AsyncGenerator[_T, None]:
    """A blocking iterator as an async generator: each step runs in a worker thread; an exception
    raised by a step is raised here, where the caller iterates.
    """
    done = object()
    while (item := await in_thread(next, items, done)) is not done:
        yield item
