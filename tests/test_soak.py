"""A bounded soak on loopback: concurrent clients mixing valid, invalid and oversized requests.

``pcd serve``'s app runs under uvicorn on 127.0.0.1 with the embedded model; 8 clients send 25
requests each, a third of them valid, the rest malformed or over a bound. Then 4 MCP sessions over
streamable HTTP make 10 calls each. No response may be a 5xx, every valid answer must equal the
answer the same request gets alone (its probabilities to 1e-5: concurrent decides share passes,
``pcd_core/concurrency/pass_join.py``, and a pass's float sums follow its width), and the process's resident
memory afterwards must be within 100 MB of what it was before (rejected requests leave nothing behind).
"""

import gc
import json

import anyio
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("mcp")

from mcp import Client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

from mcp_server import build_server  # noqa: E402
from mcp_server.http_transport import http_app  # noqa: E402
from pcd_core.request.limits import Limits  # noqa: E402
from pcd_integrations.http import create_app  # noqa: E402
from pcd_integrations.serving.loopback import serving  # noqa: E402

LIMITS = Limits(max_body_bytes=64 << 10)
N_CLIENTS, N_REQUESTS = 8, 25
N_SESSIONS, N_CALLS = 4, 10
NOUL = {"type": "noul", "instructions": "Is the customer angry?"}
VALID = [
    {"state": "I was charged twice and nobody answers my emails!", "questions": {"angry": NOUL}},
    {
        "state": "Thanks, the parcel arrived early and works great.",
        "questions": {
            "topic": {"type": "choice", "instructions": "Topic?", "criteria": {"billing": None, "praise": None}}
        },
    },
    {"state": {"order": 55, "status": "late", "note": "third time"}, "questions": {"angry": NOUL}},
]
INVALID = [
    b'{"state": "a \\ud800 b", "questions": {"q": {"type": "noul", "instructions": "x?"}}}',
    b'{"state": {"x": NaN}, "questions": {"q": {"type": "noul", "instructions": "x?"}}}',
    b'{"state": "s", "questions": {"q": {"type": "essay"}}}',
    b"not json at all",
]
OVERSIZED = [
    json.dumps({"state": "word " * 20_000, "questions": {"q": NOUL}}).encode(),  # 100 KB body: 413
    json.dumps({"state": "s", "questions": {f"q{i}": NOUL for i in range(401)}}).encode(),  # 401 questions: 422
]


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def request_for(client_index: int, number: int) -> tuple[bytes, int | None]:
    """The body and, for a valid one, which VALID request it is."""
    kind = (client_index + number) % 3
    if kind == 0:
        which = (client_index * 7 + number) % len(VALID)
        return json.dumps(VALID[which]).encode(), which
    pool = INVALID if kind == 1 else OVERSIZED
    return pool[(client_index + number) % len(pool)], None


def same_answers(got, want) -> bool:
    """Equal answers: the same keys, labels and flags, every number within 1e-5."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(same_answers(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(map(same_answers, got, want))
    if isinstance(want, float) and isinstance(got, float):
        return got == pytest.approx(want, abs=1e-5)
    return got == want


@pytest.mark.slow
def test_concurrent_mixed_traffic_gets_no_5xx_the_sequential_answers_and_no_leak(engine):
    app = create_app(engine, limits=LIMITS)
    mcp_app = http_app(build_server(engine, limits=LIMITS), "127.0.0.1", None, LIMITS)
    with serving(app, lifespan="on") as url, serving(mcp_app, lifespan="on") as mcp_url:

        async def post(client, body: bytes):
            return await client.post(f"{url}/v1/systemone", content=body, headers={"content-type": "application/json"})

        async def sequential():
            async with httpx.AsyncClient(timeout=120) as client:
                return [(await post(client, json.dumps(r).encode())).json()["answers"] for r in VALID]

        alone = anyio.run(sequential)
        for body in INVALID + OVERSIZED:  # warm every error path once, so that "before" is steady
            anyio.run(lambda body=body: _one(post, body))
        mcp_alone: dict = {}
        failures: list[str] = []

        async def client_run(index: int, client) -> None:
            for number in range(N_REQUESTS):
                body, which = request_for(index, number)
                response = await post(client, body)
                if response.status_code >= 500:
                    failures.append(f"{response.status_code}: {response.text[:200]}")
                elif which is not None and not same_answers(response.json()["answers"], alone[which]):
                    failures.append(f"request {which} answered {response.json()['answers']} != {alone[which]}")
                elif which is None and response.status_code not in (400, 413, 422):
                    failures.append(f"an invalid request got {response.status_code}")

        async def soak():
            with anyio.fail_after(600):
                async with httpx.AsyncClient(timeout=300) as client, anyio.create_task_group() as group:
                    for index in range(N_CLIENTS):
                        group.start_soon(client_run, index, client)

        async def session(index: int) -> None:
            async with Client(streamable_http_client(f"{mcp_url}/mcp")) as client:
                for number in range(N_CALLS):
                    state = VALID[(index + number) % 2]["state"]
                    if number % 3 == 2:  # invalid: a level list too short
                        result = await client.call_tool("score", {"state": state, "question": "How?", "levels": ["x"]})
                        if not result.is_error:
                            failures.append("a one-level score was accepted")
                        continue
                    result = await client.call_tool("noul", {"state": state, "question": "Is the customer angry?"})
                    noul = result.structured_content["noul"]
                    if not same_answers(mcp_alone.setdefault(state, noul), noul):
                        failures.append(f"MCP noul {noul} != {mcp_alone[state]}")

        anyio.run(session, 0)  # one warm-up session: the SDK's first session allocates for good

        async def sessions():
            with anyio.fail_after(300):
                async with anyio.create_task_group() as group:
                    for index in range(N_SESSIONS):
                        group.start_soon(session, index)

        # The first full round warms what is allocated for good under concurrency (the allocator's
        # per-thread arenas, the worker threads, the caches up to their bounds); a leak is what an
        # identical second round adds on top of it.
        anyio.run(soak)
        anyio.run(sessions)
        gc.collect()
        before = rss_mb()
        anyio.run(soak)
        middle = rss_mb()
        anyio.run(sessions)
        gc.collect()
        after = rss_mb()
    for state, noul in mcp_alone.items():
        assert engine.decide(state, {"q": NOUL}).answers["q"].noul == pytest.approx(noul, abs=1e-9)
    print(f"RSS before the soak {before:.0f} MB, after HTTP {middle:.0f} MB, after MCP {after:.0f} MB")
    assert not failures, failures[:5]
    assert after - before < 100, (before, after)


async def _one(post, body: bytes):
    async with httpx.AsyncClient(timeout=120) as client:
        return await post(client, body)
