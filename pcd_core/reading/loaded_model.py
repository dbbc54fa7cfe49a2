"""``LoadedModel``: what every read needs of the model, built once per engine and passed as one.

A fill, a decide, a batch, a session's append and a chat reply all read the same model the same way:
through its backend, its tokenizer, the head cache (the instructions' KV, kept between requests),
the FIFO model lock that hands the model over at each pass boundary (``model_lock.py``), and the
join that reads concurrent generation steps in shared passes (``pass_join.py``). Those travel
together here instead of as five parameters of every read function, so a read cannot be handed the
lock of one engine and the head cache of another. The grammar engine's view of the tokenizer is
built on first use, since it reads the whole vocabulary and only open fields need it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from pcd_core.backends.base import Backend, Prefix, Rows
from pcd_core.concurrency.lru import Lru
from pcd_core.concurrency.model_lock import ModelLock
from pcd_core.concurrency.pass_join import StepJoin, joined_grow, step_join
from pcd_core.prompting.grammar import GrammarTokenizer
from pcd_core.tokenizer import TextTokenizer

#: a later step of a wave's open rows, at a pass boundary: (prefix, rows, each row's new tokens) ->
#: the rows grown; read alone (``generation.solo_steps``) or with other callers' steps (``joined_steps``)
LaterStep = Callable[[Prefix, Rows, Sequence[Sequence[int]]], Rows]


@dataclass(frozen=True, eq=False)
class LoadedModel:
    """One engine's model side: the backend, its tokenizer, the head cache, the lock, the step join."""

    backend: Backend
    tokenizer: TextTokenizer
    heads: Lru = field(repr=False)
    lock: ModelLock = field(repr=False)
    steps: StepJoin = field(repr=False)

    @classmethod
    def build(cls, backend: Backend, tokenizer: TextTokenizer, head_cache_size: int) -> LoadedModel:
        """The model side of a new engine; a backend that batches concurrent calls itself (vLLM)
        gets a lock that does not serialise.
        """
        return cls(
            backend, tokenizer, Lru(head_cache_size), ModelLock(serialise=backend.serialises), step_join(backend)
        )

    def head(self, head_ids: tuple[int, ...], use_cache: bool) -> tuple[Prefix, bool, bool]:
        """The head's prefix, whether it came from the cache, and whether the cache holds it now (a
        miss that is kept was written for later requests); the caller holds the model lock.
        """
        if not use_cache:
            return self.backend.prefill(head_ids), False, False
        head, hit = self.heads.get_or(head_ids, lambda: self.backend.prefill(head_ids))
        return head, hit, self.heads.size > 0

    @cached_property
    def grammar(self) -> GrammarTokenizer:
        """The grammar engine's view of the tokenizer, built on first use (it reads the vocabulary)."""
        return GrammarTokenizer(self.tokenizer.hf, self.tokenizer.eos_ids)

    def joined_steps(self, pause: Callable[[Callable[[], bool]], None]) -> LaterStep:
        """A fill's later open-row steps, each read with other callers' steps waiting then
        (``pass_join.joined_grow``); ``pause`` is the fill's turn's.
        """
        return joined_grow(self.backend, self.steps, pause)
