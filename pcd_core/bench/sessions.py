"""``pcd bench --session FILE``: a session's appends against reading the whole conversation each turn.

A conversation file holds a ``schema`` and ``turns`` (``examples/support_conversation.json``, 45
turns). At each turn the same engine, in the same run, does both: the session's ``append`` (the new
turn, the closing line, the tail and the rows, after the KV it kept), then a ``fill`` of the whole
conversation so far with the session's nonce (the head from the cache, every turn read again). The
two are interleaved turn by turn so that both see the same machine. The open fields are not
generated (``generate=False``): their steps cost the same either way and would only hide the reads.

Each turn's record gives the tokens the backend's pass counter saw each call read (not estimated),
the turn's own tokens, both times and the largest probability gap between the two results.
``speedup`` is the re-reading's total time over the session's; ``late_over_early`` is the median
append time of turns 38-42 over that of turns 3-7 (one turn alone is a single noisy sample, so both
windows are reported with the single turns 5 and 40 too).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pcd_core.bench.measure import weights_dtype
from pcd_core.errors import PcdError
from pcd_core.sessions.session import SessionTurn

EARLY, LATE = range(3, 8), range(38, 43)  # 1-based turns of the two windows


def load_conversation(path: str | Path) -> tuple[Any, list[tuple[str, str]]]:
    """The schema and the (role, text) turns of a conversation file; checked before any load."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        turns = [(turn["role"], turn["text"]) for turn in doc["turns"]]
        schema = doc["schema"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise PcdError(f"--session {str(path)!r}: {error!r}; give a JSON file with 'schema' and 'turns'") from error
    if not turns:
        raise PcdError(f"--session {str(path)!r}: the conversation has no turns")
    for role, text in turns:
        SessionTurn(role, text)  # a bad role or a blank turn fails here, before the model loads
    return schema, turns


def bench_session(
    engine: Any,
    schema: Any,
    turns: list[tuple[str, str]],
    name: str = "",
    on_turn: Callable[[dict[str, Any]], None] | None = None,
    questions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One pass over the conversation: per turn, the append and the re-read, timed and counted;
    ``on_turn`` gets the summary so far after each turn (``partial``: True), so a long run that is
    stopped still leaves its turns. With ``questions`` (a question set as ``decide`` takes it), the
    session and the re-read ask them instead of filling ``schema``: each question's row carries its
    text after the conversation, where a schema's catalog sits in the cached head.
    """
    backend = engine.backend
    if questions is None:
        engine.warmup(schema)  # both methods start from the cached head
        session = engine.session(schema, generate=False)
    else:
        engine.decide(turns[0][1], questions)  # a decide of any text caches the question prompt's head
        session = engine.session(questions)

    def reread() -> Any:
        if questions is None:
            return engine.fill(schema, session.text, fence_nonce=session.nonce, generate=False)
        return engine.decide(session.text, questions, fence_nonce=session.nonce)

    rows: list[dict[str, Any]] = []
    for index, (role, text) in enumerate(turns, start=1):
        before = backend.counter.mine().tokens_read
        clock = time.perf_counter()
        mine = session.append(text, role=role)
        append_ms = (time.perf_counter() - clock) * 1000.0
        append_tokens = backend.counter.mine().tokens_read - before
        before = backend.counter.mine().tokens_read
        clock = time.perf_counter()
        fresh = reread()
        reread_ms = (time.perf_counter() - clock) * 1000.0
        reread_tokens = backend.counter.mine().tokens_read - before
        gap = probability_gap(mine, fresh)
        turn_tokens = len(engine.tokenizer.encode_head("\n" + SessionTurn(role, text).line))
        rows.append(
            {
                "turn": index,
                "turn_tokens": turn_tokens,
                "append_tokens": append_tokens,
                "append_row_tokens": mine.stats.row_tokens,
                "append_passes": mine.stats.forward_passes,
                "append_ms": append_ms,
                "reread_tokens": reread_tokens,
                "reread_ms": reread_ms,
                "conversation_tokens": mine.stats.cached_tokens + mine.stats.prompt_tokens,
                "max_probability_gap": gap,
                "same_values": _values(mine) == _values(fresh),
            }
        )
        if on_turn is not None:
            on_turn({**_summary(engine, name, rows, questions), "partial": True})
    session.close()
    return _summary(engine, name, rows, questions)


def _probabilities(result: Any) -> dict[tuple[str, str], float]:
    """Every label probability of a fill's fields or a decide's answers, keyed by (name, label)."""
    if hasattr(result, "answers"):  # a DecideResponse: a yes/no answer carries its noul
        return {
            (key, label): p
            for key, answer in result.answers.items()
            for label, p in (
                answer.probabilities.items()
                if hasattr(answer, "probabilities")
                else [("true", answer.noul), ("false", 1.0 - answer.noul)]
            )
        }
    return {
        (key, label): p
        for key, field in result.fields.items()
        if hasattr(field, "probabilities")
        for label, p in field.probabilities.items()
    }


def _values(result: Any) -> Any:
    """What a result decided: a fill's values, a decide's likeliest label per question."""
    if not hasattr(result, "answers"):
        return result.values
    probabilities = _probabilities(result)
    return {
        key: max((p, label) for (name, label), p in probabilities.items() if name == key)[1]
        if key in {name for name, _ in probabilities}
        else None
        for key in result.answers
    }


def probability_gap(mine: Any, fresh: Any) -> float:
    """The largest gap between two results' label probabilities (0.0 when none has any)."""
    ours = _probabilities(mine)
    return max((abs(p - ours[key]) for key, p in _probabilities(fresh).items()), default=0.0)


def _summary(engine: Any, name: str, rows: list[dict[str, Any]], questions: dict[str, Any] | None) -> dict[str, Any]:
    session_ms = sum(r["append_ms"] for r in rows)
    reread_ms = sum(r["reread_ms"] for r in rows)

    def window(turns: range) -> float | None:
        picked = [r["append_ms"] for r in rows if r["turn"] in turns]
        return statistics.median(picked) if len(picked) == len(turns) else None

    def at(turn: int) -> float | None:
        return rows[turn - 1]["append_ms"] if len(rows) >= turn else None

    early, late = window(EARLY), window(LATE)
    return {
        "mode": "session",
        "backend": engine.backend.name,
        "dtype": weights_dtype(engine.backend),
        "conversation": name,
        "asks": "schema" if questions is None else "questions",
        "turns": len(rows),
        "session_ms": session_ms,
        "reread_ms": reread_ms,
        "speedup": reread_ms / session_ms,
        "session_tokens": sum(r["append_tokens"] for r in rows),
        "reread_tokens": sum(r["reread_tokens"] for r in rows),
        "median_turn_tokens": statistics.median(r["turn_tokens"] for r in rows),
        "median_append_tokens": statistics.median(r["append_tokens"] for r in rows),
        "median_append_other_tokens": statistics.median(
            r["append_tokens"] - r["turn_tokens"] - r["append_row_tokens"] for r in rows
        ),
        "median_row_tokens": statistics.median(r["append_row_tokens"] for r in rows),
        "turn5_ms": at(5),
        "turn40_ms": at(40),
        "early_ms": early,
        "late_ms": late,
        "late_over_early": late / early if late is not None and early else None,
        "max_probability_gap": max(r["max_probability_gap"] for r in rows),
        "same_values": all(r["same_values"] for r in rows),
        "per_turn": rows,
    }
