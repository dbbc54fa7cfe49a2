"""The same question through every slot gives the same probabilities, to 1e-6: one engine path.

Slots: the Python API (``engine.decide``), ``POST /v1/systemone`` and ``POST /v1/decisions`` over a
loopback ``pcd serve`` (the latter with the real ``openai`` client), and the MCP tools in process. Each
slot function below asks one question in its own protocol and returns ``{label: probability}``; a new
slot is one more function in ``SLOTS``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the Decisions slot needs the 'openai' package (dev extra)")
pytest.importorskip("mcp", reason="the MCP slot needs the 'mcp' extra")

from loopback import serving  # noqa: E402
from mcp import Client  # noqa: E402

from mcp_server import build_server  # noqa: E402
from pcd_core import Engine  # noqa: E402
from pcd_integrations.http import create_app  # noqa: E402

STATE = "The blender arrived with a cracked jar and smells of burning plastic. I want my money back."
INSTRUCTIONS = {
    "noul": "Does the customer ask for a refund?",
    "choice": "Which team should handle this?",
    "score": "How angry is the customer?",
}
OPTIONS = {"returns": "refunds and replacements", "shipping": "late or lost parcels", "sales": None}
LEVELS = ["calm", "annoyed", "furious"]


def system_one_question(kind: str) -> dict[str, Any]:
    question: dict[str, Any] = {"type": kind, "instructions": INSTRUCTIONS[kind]}
    if kind == "choice":
        question["criteria"] = OPTIONS
    elif kind == "score":
        question["criteria"] = LEVELS
    return question


def distribution(answer: dict[str, Any]) -> dict[str, float]:
    """A System One answer as {label: probability}; a noul as {"true": P(yes)}."""
    return {"true": answer["noul"]} if answer["type"] == "noul" else answer["probabilities"]


def python_api(servers: dict[str, Any], kind: str) -> dict[str, float]:
    response = servers["engine"].decide(STATE, {"q": system_one_question(kind)})
    return distribution(response.answers["q"].model_dump())


def systemone(servers: dict[str, Any], kind: str) -> dict[str, float]:
    body = {"state": STATE, "questions": {"q": system_one_question(kind)}}
    response = httpx.post(f"{servers['url']}/v1/systemone", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return distribution(response.json()["answers"]["q"])


def decisions(servers: dict[str, Any], kind: str) -> dict[str, float]:
    question: dict[str, Any] = {"type": "predicate" if kind == "noul" else kind, "instructions": INSTRUCTIONS[kind]}
    if kind == "choice":
        question["choices"] = [{"value": k, **({"description": v} if v else {})} for k, v in OPTIONS.items()]
    elif kind == "score":
        question["levels"] = [{"label": level} for level in LEVELS]
    (answer,) = servers["openai"].decisions.create(model="smollm2-135m", input=STATE, questions=[question]).answers
    if kind == "noul":
        return {"true": answer.probability}
    return {str(p.value): p.probability for p in answer.probabilities}


def mcp_tools(servers: dict[str, Any], kind: str) -> dict[str, float]:
    arguments: dict[str, Any] = {"state": STATE, "question": INSTRUCTIONS[kind]}
    if kind == "choice":
        arguments["options"] = OPTIONS
    elif kind == "score":
        arguments["levels"] = LEVELS

    async def call() -> Any:
        async with Client(servers["mcp"], raise_exceptions=True) as client:
            return await client.call_tool(kind, arguments)

    result = asyncio.run(call())
    assert not result.is_error, result.content
    content = result.structured_content
    return {"true": content["noul"]} if kind == "noul" else content["probabilities"]


def langchain_model(servers: dict[str, Any], kind: str) -> dict[str, float]:
    from langchain_core.decisions import Choice, Noul, Score

    from pcd_integrations.langchain import PCDDecisionModel

    question: Any = {
        "noul": lambda: Noul(instructions=INSTRUCTIONS["noul"]),
        "choice": lambda: Choice(instructions=INSTRUCTIONS["choice"], criteria=OPTIONS),
        "score": lambda: Score(instructions=INSTRUCTIONS["score"], criteria=LEVELS),
    }[kind]()
    response = PCDDecisionModel(engine=servers["engine"]).invoke({"state": STATE, "questions": {"q": question}})
    answer = response.answers["q"]
    if kind == "noul":
        return {"true": answer.noul}
    return {str(label): p for label, p in answer.probabilities.items()}


# Each slot asks one question in its own protocol.
SLOTS: dict[str, Callable[[dict[str, Any], str], dict[str, float]]] = {
    "python": python_api,
    "systemone": systemone,
    "decisions": decisions,
    "mcp": mcp_tools,
    "langchain": langchain_model,
}


@pytest.fixture(scope="module")
def servers(engine: Engine) -> Any:
    with serving(create_app(engine)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield {"engine": engine, "url": url, "openai": client, "mcp": build_server(engine)}


@pytest.mark.parametrize("kind", ["noul", "choice", "score"])
def test_every_slot_gives_the_same_probabilities(servers: dict[str, Any], kind: str) -> None:
    got = {slot: ask(servers, kind) for slot, ask in SLOTS.items()}
    reference = got["python"]
    expected_labels = {"noul": ["true"], "choice": list(OPTIONS), "score": ["0", "1", "2"]}[kind]
    assert list(reference) == expected_labels
    for slot, probabilities in got.items():
        assert list(probabilities) == list(reference), slot
        for label, p in probabilities.items():
            assert math.isclose(p, reference[label], rel_tol=0.0, abs_tol=1e-6), (slot, label, p, reference[label])
