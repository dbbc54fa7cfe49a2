"""Requests per second of ``POST /v1/systemone`` and ``POST /v1/decisions`` on the embedded model,
in process (no socket).

    python examples/http_throughput.py [--requests 24]

Prints, for each route, for 1 and 16 questions per request and for 1 and 8 concurrent clients:
requests and answers per second, the median latency, and the forward passes one request costs. Both
routes ask the same questions (a noul is a predicate, criteria are choices and levels), so the gap
between them is the cost of the OpenAI translation.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from pcd_core import Engine
from pcd_integrations.http import create_app

STATE = (
    "Order #55120. The customer writes: 'The blender arrived with a cracked jar and the motor smells like "
    "burning plastic. I want my money back, not a replacement.' Order value: $129.00."
)
KINDS = (
    {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    {
        "type": "choice",
        "instructions": "Which team owns this?",
        "criteria": {"returns": "refunds", "safety": "hazards", "logistics": "shipping", "sales": None},
    },
    {
        "type": "score",
        "instructions": "How frustrated is the customer?",
        "criteria": ["calm", "annoyed", "frustrated", "angry", "furious"],
    },
    {"type": "noul", "instructions": "Is there a safety hazard?"},
)


def questions(n: int) -> dict:
    """``n`` distinct questions, cycling through the four kinds with a numbered aspect."""
    return {f"q{i}": dict(KINDS[i % 4], instructions=f"{KINDS[i % 4]['instructions']} (aspect {i})") for i in range(n)}


def as_decision(name: str, question: dict) -> dict:
    """The same System One question in the OpenAI Decisions shape."""
    asked = {"name": name, "instructions": question["instructions"]}
    if question["type"] == "noul":
        return {**asked, "type": "predicate"}
    if question["type"] == "choice":
        choices = [
            {"value": value, **({"description": text} if text else {})} for value, text in question["criteria"].items()
        ]
        return {**asked, "type": "choice", "choices": choices}
    return {**asked, "type": "score", "levels": [{"label": level} for level in question["criteria"]]}


def body_for(route: str, n_questions: int) -> dict:
    asked = questions(n_questions)
    if route == "/v1/systemone":
        return {"state": STATE, "questions": asked}
    return {"model": "smollm2-135m", "input": STATE, "questions": [as_decision(k, q) for k, q in asked.items()]}


async def measure(app, engine: Engine, route: str, n_questions: int, n_requests: int, clients: int) -> str:
    body = body_for(route, n_questions)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pcd", timeout=600) as http:
        (await http.post(route, json=body)).raise_for_status()  # warm the head
        passes = engine.backend.forward_passes
        (await http.post(route, json=body)).raise_for_status()
        per_request = engine.backend.forward_passes - passes
        latencies: list[float] = []

        async def client() -> None:
            for _ in range(n_requests // clients):
                started = time.perf_counter()
                (await http.post(route, json=body)).raise_for_status()
                latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - started
    return (
        f"{route:<14} {n_questions:>2} questions, {clients} client(s): {len(latencies) / wall:5.2f} req/s, "
        f"{len(latencies) * n_questions / wall:5.1f} answers/s, median latency "
        f"{statistics.median(latencies) * 1000:7.1f} ms, {per_request} forward passes per request"
    )


async def main(n_requests: int) -> None:
    engine = Engine.load()
    app = create_app(engine)
    for n_questions, clients in ((1, 1), (16, 1), (1, 8), (16, 8)):
        for route in ("/v1/systemone", "/v1/decisions"):
            print(await measure(app, engine, route, n_questions, n_requests, clients), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24, help="requests per setting (default: 24)")
    asyncio.run(main(parser.parse_args().requests))
