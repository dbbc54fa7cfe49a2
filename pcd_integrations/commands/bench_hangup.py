"""``pcd bench --hangup N``: how long a short request waits behind a long pass whose client hung up.

The loaded engine is served on a loopback port in this process (``pcd_integrations/serving/loopback.py``).
A client posts a decide of ``N`` questions (``long_questions``: generated, the same every run) on
``/v1/decisions``: one forward pass of N rows on a warm head. Once that pass has started (the backend counts a pass before it runs) and ``settle_s`` more
have gone by, the client hangs up, and another client sends a one-question decide at once; its
``x_queue_ms`` is how long it waited for the model, and the wall time around its request what its
caller saw. Each drop is made twice in the same run, on the same served engine: with the in-pass
check off (``pcd_core/backends/pass_stop.py``'s ``set_stopping_inside(False)``, what
``PCD_STOP_INSIDE_PASSES=0`` does: the request stops only at the boundary after its pass), then on.

The check's own cost is measured on the same engine: the short decide, called directly under a
``Cancellation`` nobody sets, with the check off and on in turn (the layers' hooks installed only
when on), ``repeat`` x 5 times each; medians. One record per check setting; docs/operations.md ("Short
turns after a dropped long pass") reports them.
"""

from __future__ import annotations

import http.client
import json
import statistics
import time
from typing import Any
from urllib.parse import urlsplit

from pcd_core import Cancellation, PcdError
from pcd_core.bench.measure import weights_dtype
from pcd_core.concurrency.model_lock import run_cancellable, set_stopping_inside

LONG_STATE = (
    "Hi, I ordered a blender (order 5521) three weeks ago. It arrived with a cracked jug, the refund I was "
    "promised has not come, and your chat bot keeps closing my ticket. I want this fixed this week."
)
SHORT_STATE = "The app crashes when I open the camera."
SHORT_QUESTION = {"type": "predicate", "name": "bug", "instructions": "Does the message report a software bug?"}
#: seconds between the long pass's start and the hang-up, so that the pass is well under way
SETTLE_S = 1.0
#: how long a phase may wait for the long pass to start before it is called broken
START_TIMEOUT_S = 300.0


def long_questions(n: int) -> list[dict[str, Any]]:
    """``n`` predicates, each its own row: "Is the message about topic K?"."""
    return [
        {"type": "predicate", "name": f"q{k}", "instructions": f"Is the message about topic {k}?"} for k in range(n)
    ]


def bench_hangup(engine: Any, n_questions: int, repeat: int, settle_s: float = SETTLE_S) -> list[dict[str, Any]]:
    """Two records, the in-pass check off then on: ``repeat`` drops each, the short request's waits."""
    from pcd_integrations.http.app import create_app
    from pcd_integrations.serving.loopback import serving

    model = engine.model_name
    long_body = {"model": model, "input": LONG_STATE, "questions": long_questions(n_questions)}
    short_body = {"model": model, "input": SHORT_STATE, "questions": [SHORT_QUESTION]}
    before = set_stopping_inside(False)
    records = []
    try:
        with serving(create_app(engine, playground=False)) as base:
            # the heads read and cached, so that the long request is one pass over its rows
            _post(base, {**long_body, "questions": long_body["questions"][:1]})
            _post(base, short_body)
            hook_ms = _hook_cost(engine, 5 * repeat)
            for inside in (False, True):
                set_stopping_inside(inside)
                drops = [_drop(engine, base, long_body, short_body, settle_s) for _ in range(repeat)]
                records.append(
                    {
                        "mode": "hangup",
                        "backend": engine.backend.name,
                        "dtype": weights_dtype(engine.backend),
                        "model": model,
                        "questions": n_questions,
                        "stop_inside": inside,
                        "repeat": repeat,
                        "settle_s": settle_s,
                        "drops": drops,
                        "long_tokens": drops[0]["long_tokens"],
                        "median_short_queue_ms": statistics.median(d["short_queue_ms"] for d in drops),
                        "median_short_wall_ms": statistics.median(d["short_wall_ms"] for d in drops),
                        "short_decide_ms": hook_ms[inside],
                    }
                )
    finally:
        set_stopping_inside(before)
    return records


def _post(base: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    reply = httpx.post(f"{base}/v1/decisions", json=body, timeout=600.0)
    if reply.status_code != 200:
        raise PcdError(f"pcd bench --hangup: a request failed: HTTP {reply.status_code} {reply.text[:200]}")
    answered: dict[str, Any] = reply.json()
    return answered


def _drop(
    engine: Any, base: str, long_body: dict[str, Any], short_body: dict[str, Any], settle_s: float
) -> dict[str, Any]:
    """One drop: the long decide sent, its pass started, the client gone ``settle_s`` later, the short
    decide sent at once; what the short one waited and what the long one read.
    """
    counter = engine.backend.counter
    passes, tokens = counter.forward_passes, counter.tokens_read
    where = urlsplit(base)
    connection = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=600)
    sent = time.perf_counter()
    connection.request("POST", "/v1/decisions", json.dumps(long_body).encode(), {"Content-Type": "application/json"})
    deadline = time.monotonic() + START_TIMEOUT_S
    while counter.forward_passes == passes:  # counted before it runs: the long pass has started
        if time.monotonic() > deadline:
            raise PcdError("pcd bench --hangup: the long request's pass never started")
        time.sleep(0.005)
    started = time.perf_counter()
    long_tokens = counter.tokens_read - tokens
    time.sleep(settle_s)
    connection.close()  # the client hangs up
    dropped = time.perf_counter()
    short = _post(base, short_body)
    answered = time.perf_counter()
    return {
        "pass_started_after_ms": (started - sent) * 1000.0,
        "dropped_after_ms": (dropped - sent) * 1000.0,
        "short_queue_ms": short["x_queue_ms"],
        "short_wall_ms": (answered - dropped) * 1000.0,
        "long_tokens": long_tokens,
        "passes": counter.forward_passes - passes,
    }


def _hook_cost(engine: Any, times: int) -> dict[bool, float]:
    """The short decide's median ms with the in-pass check off and on, alternated ``times`` times each,
    under a ``Cancellation`` that is never set (so that the check's hooks are installed when on).
    """
    spent: dict[bool, list[float]] = {False: [], True: []}
    token = Cancellation()
    questions = {"bug": {"type": "noul", "instructions": SHORT_QUESTION["instructions"]}}
    for _ in range(times):
        for inside in (False, True):
            set_stopping_inside(inside)
            clock = time.perf_counter()
            run_cancellable(token, lambda: engine.decide(SHORT_STATE, questions))
            spent[inside].append((time.perf_counter() - clock) * 1000.0)
    return {inside: statistics.median(ms) for inside, ms in spent.items()}
