"""``pcd bench --session FILE --session-memory N``: the resident memory of N open sessions.

Each session holds the KV of the conversation it has read (``pcd_core/sessions/session.py``), and
the engine's ``SessionMemory`` (``pcd_core/concurrency/session_memory.py``) keeps at most
``max_sessions`` of them, evicting the least recently used. This bench opens N sessions one after the
other, each a conversation of about T tokens (the file's turns taken in a cycle, the first one
numbered so that no two sessions read the same text), recorded with ``add`` and read by ONE ``append``
of the next turn, and samples the process's RSS (``measure.rss_bytes``) after each.

The bound it states and checks::

    baseline + min(N, max_sessions + 1) * longest_session_tokens * bytes_per_token

``baseline`` is the RSS after the load and one warm fill of a conversation of the same size, so that
it holds the working set of one such pass (the model lock lets one read at a time);
``longest_session_tokens`` the most tokens one session's KV held (the conversation and the prompt's
head before it); ``bytes_per_token`` the backend's ``kv_bytes_per_token``, or the bytes a session's
state was measured to hold per token (every tensor or array it keeps: KV, kept hidden states),
whichever is more. One session more than ``max_sessions``: the append that evicts the oldest reads
its own KV before the oldest drops its.

Then the first session, evicted when N > max_sessions, appends one more turn: it reads its
conversation again (its warnings say so) and its answers are compared with a fresh ``fill`` of the same
text and nonce. Last, every session is closed and the RSS taken again.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from pcd_core.bench.measure import PeakSampler, release_free_memory, rss_bytes, weights_dtype
from pcd_core.bench.sessions import probability_gap
from pcd_core.errors import PcdError
from pcd_core.sessions.session import SessionTurn, conversation_text

MIB = 2**20
#: what an append's warnings say when the session's KV had been evicted (``Session._base``)
EVICTED_NOTE = "evicted"


def state_bytes(state: Any) -> int:
    """The bytes of every tensor storage or array a prefix's state keeps (each torch storage counted
    once, whole, so that a view into a larger buffer counts the buffer); 0 for a state with neither.
    """
    seen: set[int] = set()  # storages counted
    visited: set[int] = set()  # objects walked: a state whose parts refer to each other ends
    total = 0
    pending: list[Any] = [state]
    while pending:
        item = pending.pop()
        if item is None or isinstance(item, (str, int, float, bool)) or id(item) in visited:
            continue
        visited.add(id(item))
        storage = getattr(item, "untyped_storage", None)
        if callable(storage):
            held = storage()
            if held.data_ptr() not in seen:
                seen.add(held.data_ptr())
                total += int(held.nbytes())
            continue
        nbytes = getattr(item, "nbytes", None)  # a numpy array
        if isinstance(nbytes, int):
            total += nbytes
        elif isinstance(item, (bytes, bytearray)):
            total += len(item)
        elif isinstance(item, (tuple, list)):
            pending.extend(item)
        elif hasattr(item, "__dict__"):
            pending.extend(vars(item).values())
    return total


def bench_session_memory(
    engine: Any,
    schema: Any,
    turns: list[tuple[str, str]],
    n_sessions: int = 100,
    tokens: int = 2000,
    on_session: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Open ``n_sessions`` sessions of about ``tokens`` tokens each and record the memory they hold;
    ``on_session`` gets the record so far after each (``partial``: True), so a stopped run leaves it.
    """
    if n_sessions < 1 or tokens < 1:
        raise PcdError(f"a memory bench needs at least 1 session of at least 1 token, not {n_sessions} of {tokens}")
    backend, memory, tokenizer = engine.backend, engine.sessions, engine.tokenizer
    engine.warmup(schema)
    # the warm fill reads a conversation of the same size, so the baseline holds one pass's working set
    warm = _conversation(turns, 0, tokens, tokenizer)
    engine.fill(schema, _text(warm), generate=False)
    baseline = rss_bytes()
    evictions_before = memory.evictions
    sessions: list[Any] = []
    rows: list[dict[str, Any]] = []
    record: dict[str, Any] = {
        "mode": "session_memory",
        "backend": backend.name,
        "dtype": weights_dtype(backend),
        "sessions": n_sessions,
        "target_tokens": tokens,
        "max_sessions": memory.max_sessions,
        "max_session_tokens": memory.max_session_tokens,
        "kv_bytes_per_token": int(backend.kv_bytes_per_token),
        "baseline_rss_bytes": baseline,
        "baseline_rss_mb": baseline / MIB,
    }
    for index in range(n_sessions):
        session = engine.session(schema, generate=False)
        sessions.append(session)
        *unread, (role, text) = _conversation(turns, index + 1, tokens, tokenizer)
        for unread_role, unread_text in unread:
            session.add(unread_text, role=unread_role)
        before = backend.counter.mine().tokens_read
        with PeakSampler() as sampler:
            clock = time.perf_counter()
            session.append(text, role=role)
            append_ms = (time.perf_counter() - clock) * 1000.0
        rows.append(
            {
                "session": index + 1,
                "turns": len(session.turns),
                "conversation_tokens": len(tokenizer.encode_head(session.text)),
                "session_kv_tokens": session.kv_tokens,
                "state_bytes": state_bytes(session.prefix.state) if session.prefix is not None else 0,
                "append_ms": append_ms,
                "append_tokens": backend.counter.mine().tokens_read - before,
                "rss_bytes": rss_bytes(),
                "append_peak_rss_bytes": sampler.peak,
                "sessions_holding_kv": memory.n_sessions,
                "kv_tokens_held": memory.kv_tokens,
                "evictions": memory.evictions - evictions_before,
            }
        )
        if on_session is not None:
            on_session({**record, **_summary(record, rows), "partial": True})
    record.update(_summary(record, rows))
    record["reread"] = reread = _reread(engine, schema, sessions[0], turns)
    record["reread_max_probability_gap"] = reread["max_probability_gap"]
    for session in sessions:
        session.close()
    release_free_memory()
    record["rss_after_close_bytes"] = after = rss_bytes()
    record["rss_after_close_mb"] = after / MIB
    record["sessions_holding_kv_after_close"] = memory.n_sessions
    return record


def _conversation(turns: list[tuple[str, str]], number: int, tokens: int, tokenizer: Any) -> list[tuple[str, str]]:
    """Session ``number``'s turns: the file's turns in a cycle, the first one numbered so that each
    session reads its own text, until the conversation reaches ``tokens`` tokens.
    """
    rest = turns[1:] or turns
    chosen = [(turns[0][0], f"Ticket {number}: {turns[0][1]}")]
    while len(tokenizer.encode_head(_text(chosen))) < tokens:
        chosen.append(rest[(len(chosen) - 1) % len(rest)])
    return chosen


def _text(turns: list[tuple[str, str]]) -> str:
    return conversation_text(tuple(SessionTurn(role, text) for role, text in turns))


def _summary(record: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The stated bound (the module's docstring gives it) and the peaks measured against it."""
    longest = max(r["session_kv_tokens"] for r in rows)
    measured = max((r["state_bytes"] / r["session_kv_tokens"] for r in rows if r["session_kv_tokens"]), default=0.0)
    per_token = max(float(record["kv_bytes_per_token"]), measured)
    held = min(len(rows), record["max_sessions"] + 1)
    bound = int(record["baseline_rss_bytes"] + held * longest * per_token)
    peak = max(r["rss_bytes"] for r in rows)
    peak_during = max(r["append_peak_rss_bytes"] for r in rows)
    return {
        "longest_session_tokens": longest,
        "state_bytes_per_token": measured,
        "bytes_per_token": per_token,
        "bound_sessions": held,
        "bound_bytes": bound,
        "peak_rss_bytes": peak,
        "peak_rss_during_appends_bytes": peak_during,
        "bound_mb": bound / MIB,
        "peak_rss_mb": peak / MIB,
        "within_bound": peak <= bound,
        "within_bound_during_appends": peak_during <= bound,
        "max_sessions_holding_kv": max(r["sessions_holding_kv"] for r in rows),
        "max_kv_tokens_held": max(r["kv_tokens_held"] for r in rows),
        "evictions": rows[-1]["evictions"],
        "median_append_ms": statistics.median(r["append_ms"] for r in rows),
        "per_session": list(rows),
    }


def _reread(engine: Any, schema: Any, first: Any, turns: list[tuple[str, str]]) -> dict[str, Any]:
    """The first session appends one more turn: whether it read its conversation again, and the
    gap between its answers and a fresh fill of the same text and nonce.
    """
    held_before = first.kv_tokens
    role, text = turns[len(first.turns) % len(turns)]
    before = engine.backend.counter.mine().tokens_read
    clock = time.perf_counter()
    mine = first.append(text, role=role)
    append_ms = (time.perf_counter() - clock) * 1000.0
    append_tokens = engine.backend.counter.mine().tokens_read - before
    fresh = engine.fill(schema, first.text, fence_nonce=first.nonce, generate=False)
    return {
        "kv_tokens_before": held_before,
        "read_again": any(EVICTED_NOTE in warning for warning in mine.warnings),
        "warnings": list(mine.warnings),
        "append_ms": append_ms,
        "append_tokens": append_tokens,
        "conversation_tokens": len(engine.tokenizer.encode_head(first.text)),
        "same_values": mine.values == fresh.values,
        "max_probability_gap": probability_gap(mine, fresh),
    }
