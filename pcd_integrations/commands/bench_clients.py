"""``pcd bench --clients N``: the HTTP server under N concurrent clients against one client, in one run.

The loaded engine is served on a loopback port in this process (``pcd_integrations/serving/loopback.py``),
and real HTTP clients (httpx, one connection each) send their requests one after another: first one
client alone, then N at once, each sending ``requests`` requests. Three routes are measured:

- ``/v1/chat/completions`` with a plain reply of up to ``max_tokens`` tokens: concurrent replies'
  steps share passes (``pcd_core/concurrency/pass_join.py``), so generated tokens per second is the figure;
- ``/v1/decisions`` with one predicate over a state of its own: requests per second;
- ``/v1/chat/completions`` with a ``json_schema`` response format whose fields are all closed
  (``structured``): a fill each, concurrent fills of the schema joined; requests per second.

Each client's messages and states differ from the others', so no reply can be served from another's
pass by accident. A record per route says each phase's rate, their ratio, the passes the engine ran,
the median latency and the process's peak RSS after the phase; ``docs/benchmarks.md`` reports them.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

from pcd_core import PcdError
from pcd_core.bench.measure import peak_rss_mb, weights_dtype

ROUTES = ("chat", "decisions", "structured")
HAZARD = {"type": "predicate", "instructions": "Does the customer report a safety hazard?"}
#: the ``structured`` route's schema: three closed fields, so a fill generates nothing
TRIAGE = {
    "type": "object",
    "properties": {
        "hazard": {"type": "boolean", "description": "Does the customer report a safety hazard?"},
        "team": {"type": "string", "enum": ["safety", "billing", "shipping", "accounts"]},
        "mood": {"type": "string", "enum": ["calm", "annoyed", "angry"]},
    },
    "required": ["hazard", "team", "mood"],
    "additionalProperties": False,
}
ITEMS = ("kettle", "blender", "heater", "lamp", "toaster", "drill", "fan", "scooter", "charger", "iron")


def request_body(route: str, model: str, client: int, turn: int, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """The path and body of one client's ``turn``-th request: its own words, so no two are the same."""
    item = ITEMS[(client + turn) % len(ITEMS)]
    if route == "chat":
        content = f"Write a short, friendly note to customer {client}-{turn} about their {item} order."
        return "/v1/chat/completions", {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
        }
    state = f"Order {1000 * client + turn}: my {item} sparks when I plug it in and the cable got hot. Help!"
    if route == "structured":
        return "/v1/chat/completions", {
            "model": model,
            "messages": [{"role": "user", "content": state}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "Triage", "schema": TRIAGE}},
        }
    return "/v1/decisions", {"model": model, "input": state, "questions": [HAZARD]}


def bench_clients(engine: Any, clients: int, requests: int, max_tokens: int) -> list[dict[str, Any]]:
    """One record per route: one client, then ``clients`` at once, ``requests`` requests each."""
    from pcd_integrations.http.app import create_app
    from pcd_integrations.serving.loopback import serving

    records = []
    with serving(create_app(engine, playground=False)) as base:
        for route in ROUTES:
            _phase(engine, base, route, 1, 1, max_tokens)  # the route's head read and cached
            one = _phase(engine, base, route, 1, requests, max_tokens)
            many = _phase(engine, base, route, clients, requests, max_tokens)
            if route != "chat":  # a decision or a closed fill generates no tokens: requests/s alone
                for phase in (one, many):
                    phase.update(tokens=None, tokens_per_s=None)
            records.append(
                {
                    "mode": "clients",
                    "route": route,
                    "backend": engine.backend.name,
                    "dtype": weights_dtype(engine.backend),
                    "model": engine.model_name,
                    "clients": clients,
                    "requests_per_client": requests,
                    "max_tokens": max_tokens if route == "chat" else None,
                    **{f"one_{key}": value for key, value in one.items()},
                    **{f"many_{key}": value for key, value in many.items()},
                    "requests_ratio": many["requests_per_s"] / one["requests_per_s"],
                    "tokens_ratio": many["tokens_per_s"] / one["tokens_per_s"] if route == "chat" else None,
                }
            )
    return records


def _phase(engine: Any, base: str, route: str, clients: int, requests: int, max_tokens: int) -> dict[str, Any]:
    """``clients`` threads, released together, each sending ``requests`` requests in turn."""
    import httpx

    latencies: list[float] = []
    tokens: list[int] = []
    failures: list[str] = []
    guard = threading.Lock()
    start = threading.Barrier(clients)

    def client(number: int) -> None:
        with httpx.Client(base_url=base, timeout=600.0) as http:
            start.wait()
            for turn in range(requests):
                path, body = request_body(route, engine.model_name, number, turn, max_tokens)
                sent = time.perf_counter()
                reply = http.post(path, json=body)
                with guard:
                    if reply.status_code != 200:
                        failures.append(f"{path}: HTTP {reply.status_code} {reply.text[:200]}")
                        return
                    latencies.append(time.perf_counter() - sent)
                    usage = reply.json().get("usage") or {}
                    tokens.append(int(usage.get("completion_tokens") or 0))

    passes = engine.backend.forward_passes
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    if failures:
        raise PcdError(f"pcd bench --clients: a request failed: {failures[0]}")
    return {
        "requests": len(latencies),
        "seconds": seconds,
        "requests_per_s": len(latencies) / seconds,
        "tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / seconds,
        "p50_ms": statistics.median(latencies) * 1000.0,
        "forward_passes": engine.backend.forward_passes - passes,
        "peak_rss_mb": peak_rss_mb(),
    }
