"""The one read path: a cached head, then the request read after it, filling one ``Stats`` (``cost.py``).

``fill``, ``decide`` and plain generation (``generate``/``stream``) all read a prompt the same way.
The head (instructions, or every chat turn but the last) comes from the engine's head cache or is
prefilled; the rest of the prompt, tokenized with the head in one piece, is the *trunk* read after
it. When the request's first token merged with the head's last one, the cached head cannot be
extended: nothing of it is used, and the whole prompt is the trunk (``BYPASSED``). What each read
cost is counted by the backend's per-thread pass counter, never by hand: a request hands the model
over between passes (``model_lock.py``) and other threads' passes run in between; a reply's steps,
which a consumer may pull from any thread, are counted one by one (``read_step``).
``tests/test_engine.py`` checks the pass counts and every ``Stats`` field on the real model;
``tests/test_chatting.py`` checks a reply's cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from pcd_core.backends.base import Backend, Prefix
from pcd_core.concurrency.model_lock import no_pause
from pcd_core.cost import HeadCache, Meter
from pcd_core.reading.loaded_model import LoadedModel
from pcd_core.reading.rounds import DecisionTask, Decoded, RoundStats, decode

#: the warning of a request whose input merged with the head's last token
BYPASSED = "the input merged with the cached head's last token; the whole prompt was read anew"

#: a head lookup as ``LoadedModel.head`` makes one: (head ids, use the cache) -> (the head's prefix,
#: whether it was cached, whether it is kept in the cache now)
HeadLookup = Callable[[tuple[int, ...], bool], tuple[Prefix, bool, bool]]


def after_head(whole: Sequence[int], head_ids: Sequence[int]) -> tuple[int, ...] | None:
    """The ids after ``head_ids`` when ``whole`` starts with them. None when the text after the head
    merged with the head's last token: the cached head cannot be extended, so all is read anew.
    """
    n_head = len(head_ids)
    if tuple(whole[:n_head]) != tuple(head_ids):
        return None
    return tuple(whole[n_head:])


def ms_since(clock: float) -> float:
    """Milliseconds since ``clock`` (a ``time.perf_counter()`` reading): every ``*_ms`` of ``Stats``."""
    return (time.perf_counter() - clock) * 1000.0


@dataclass(frozen=True)
class HeadRead:
    """Where the trunk hangs from: the head's prefix (None when bypassed) and the ids read after it."""

    head: Prefix | None
    trunk: tuple[int, ...]
    warnings: tuple[str, ...]


def read_head(
    model: LoadedModel,
    head_ids: tuple[int, ...],
    whole: tuple[int, ...],
    meter: Meter,
    use_cache: bool = True,
    lookup: HeadLookup | None = None,
) -> HeadRead:
    """The head of ``whole`` from the cache (or prefilled), or none of it when the request merged
    with it. Fills ``row_layout``, ``head_cache``, ``cached_tokens``, ``cache_write_tokens``,
    ``head_ms`` and ``prompt_tokens`` (the trunk's length) of ``meter``; the caller holds the lock.
    ``lookup`` replaces ``model.head`` where a batch looks its shared head up once for every input.
    """
    clock = time.perf_counter()
    backend = model.backend
    rest = after_head(whole, head_ids)
    written = 0
    cache: HeadCache
    if rest is None:
        cache, cached = "bypassed", 0
        read = HeadRead(None, whole, (BYPASSED,))
    else:
        head, hit, kept = (lookup or model.head)(head_ids, use_cache)
        cache, cached = ("hit", len(head_ids)) if hit else ("miss", 0)
        if not hit and kept:  # prefilled now and kept for the next request
            written = len(head_ids)
        read = HeadRead(head, rest, ())
    meter.stats = replace(
        meter.stats,
        row_layout=backend.row_layout,
        backend=backend.name,
        dtype=backend.compute_dtype,
        head_cache=cache,
        cached_tokens=cached,
        cache_write_tokens=written,
        head_ms=ms_since(clock),
        prompt_tokens=len(read.trunk),
    )
    return read


def read_request(
    model: LoadedModel,
    head_ids: tuple[int, ...],
    whole: tuple[int, ...],
    tasks: list[DecisionTask],
    meter: Meter,
    rounds: RoundStats,
    use_cache: bool = True,
    pause: Callable[[], None] = no_pause,
    hidden: bool = False,
    lookup: HeadLookup | None = None,
) -> tuple[Decoded, list[str]]:
    """Read a head and a request, with the first ``tasks``' rows in the request's pass: the trunk
    is read in the same ``score`` call as the rows (``fill`` and ``decide``). The caller holds the
    lock, whose ``pause`` it passes on, and calls ``count_request`` when its passes are done.
    ``hidden`` keeps each task's hidden state at its first decision point (``rounds.decode``);
    ``lookup`` replaces ``model.head`` where a session reads after the KV it keeps.
    """
    read = read_head(model, head_ids, whole, meter, use_cache, lookup)
    clock = time.perf_counter()
    decoded = decode(model.backend, read.head, tasks, rounds, trunk=read.trunk, pause=pause, hidden=hidden)
    meter.stats = replace(meter.stats, prefill_ms=ms_since(clock))
    return decoded, list(read.warnings)


def read_prompt(
    model: LoadedModel, head_ids: tuple[int, ...], whole: tuple[int, ...], meter: Meter, room: int
) -> Prefix:
    """Read a chat prompt for a reply, with ``room`` for the reply behind its KV so that the steps
    write there instead of copying it (a longer reply outgrows it and the backend's buffers grow).
    Fills and counts ``meter`` as a request with no rows; the caller holds the lock.
    """
    backend = model.backend
    passes_before = backend.counter.mine().forward_passes
    read = read_head(model, head_ids, whole, meter)
    clock = time.perf_counter()
    prefix = backend.prefill(read.trunk, parent=read.head, room=room)
    meter.stats = replace(meter.stats, prefill_ms=ms_since(clock))
    count_request(backend, meter, RoundStats(), passes_before, len(head_ids))
    return prefix


Read = TypeVar("Read")


def read_step(backend: Backend, meter: Meter, step: Callable[[], Read], queue_ms: float = 0.0) -> Read:
    """One step of a reply (read its last token, give the next one's log-probs), counted into
    ``meter``: the passes the backend counted in this thread while it ran (``forward_passes`` and
    ``open_steps``; the first token's log-probs come from the prompt's pass, so its step runs none),
    its time in ``generate_ms`` and the ``queue_ms`` it waited for the model. The caller holds the
    lock for the step; a consumer may pull each step from another thread, which is why a reply is
    counted step by step and not once, as ``count_request`` counts a fill.
    """
    passes_before = backend.counter.mine().forward_passes
    clock = time.perf_counter()
    read = step()
    passes = backend.counter.mine().forward_passes - passes_before
    spent = meter.stats
    meter.stats = replace(
        spent,
        forward_passes=spent.forward_passes + passes,
        open_steps=spent.open_steps + passes,
        generate_ms=spent.generate_ms + ms_since(clock),
        queue_ms=spent.queue_ms + queue_ms,
    )
    return read


def count_request(backend: Backend, meter: Meter, rounds: RoundStats, passes_before: int, n_head: int) -> None:
    """The totals of a request, once its last pass is read (under the lock). ``passes_before`` is
    ``backend.counter.mine().forward_passes`` when the request took the model; the open rows' tokens
    read by ``grow`` are in ``meter``'s ``row_tokens`` already (``generation.generate_open_fields``),
    and the decision rounds' are added here.
    """
    spent = meter.stats
    row_tokens = rounds.row_tokens + spent.row_tokens
    # a bypassed head was read as part of the prompt, so it is in prompt_tokens already
    head_tokens = 0 if spent.head_cache == "bypassed" else n_head
    meter.stats = replace(
        spent,
        forward_passes=backend.counter.mine().forward_passes - passes_before,
        n_rows=rounds.n_rows,
        rounds=rounds.rounds,
        row_tokens=row_tokens,
        input_tokens=head_tokens + spent.prompt_tokens + row_tokens,
    )
