"""The Jev specification's model aliases on every decision route, with real clients against a loopback
``pcd serve`` on the embedded model: ``httpx`` for ``POST /v1/systemone`` and the ``openai`` SDK for
``POST /v1/decisions``. A request that names ``jev-latest`` or ``jev-preview`` is answered by the served
model, exactly as one that names it; a pinned Jev release and the chat route still get 404.
"""

from __future__ import annotations

from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the alias tests need the 'openai' package (dev extra)")
pytest.importorskip("uvicorn", reason="the HTTP server needs the 'http' extra")
httpx = pytest.importorskip("httpx", reason="the HTTP tests need httpx")

from loopback import serving  # noqa: E402

from pcd_core import Engine  # noqa: E402
from pcd_integrations.http import create_app  # noqa: E402
from pcd_integrations.wire import JEV_ALIASES, accepts_model  # noqa: E402

STATE = "My card was charged twice for order 1182. Refund the duplicate today or I will dispute it."
SYSTEM_ONE = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
    "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": "money", "shipping": None}},
}
PREDICATE = {"type": "predicate", "instructions": "Does the customer ask for money back?"}


@pytest.fixture(scope="module")
def base_url(engine: Engine) -> Any:
    with serving(create_app(engine)) as url:
        yield url


def test_the_aliases_are_the_jev_ones_and_only_for_the_decision_routes() -> None:
    assert JEV_ALIASES == {"jev-latest", "jev-preview"}
    assert accepts_model("JEV-Latest", "smollm2-135m", JEV_ALIASES)
    assert not accepts_model("jev-latest", "smollm2-135m")  # without the decision routes' aliases
    assert not accepts_model("jev-1.13.0", "smollm2-135m", JEV_ALIASES)


def test_systemone_answers_jev_latest_as_the_served_model(base_url: str, engine: Engine) -> None:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        asked = {"state": STATE, "questions": SYSTEM_ONE}
        served = client.post("/v1/systemone", json={**asked, "model": engine.model_name})
        assert served.status_code == 200, served.text
        for alias in ("jev-latest", "jev-preview"):
            response = client.post("/v1/systemone", json={**asked, "model": alias})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["model"] == engine.model_name
            assert body["answers"] == served.json()["answers"]
        pinned = client.post("/v1/systemone", json={**asked, "model": "jev-1.13.0"})
        assert pinned.status_code == 404 and pinned.json()["detail"]["error_type"] == "model_not_found"


def test_decisions_answers_jev_latest_through_the_openai_sdk(base_url: str, engine: Engine) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    served = client.decisions.create(model=engine.model_name, input=STATE, questions=[PREDICATE])
    aliased = client.decisions.create(model="jev-latest", input=STATE, questions=[PREDICATE])
    assert aliased.model == engine.model_name
    assert aliased.answers[0].probability == served.answers[0].probability
    with pytest.raises(openai.NotFoundError):
        client.decisions.create(model="jev-1.13.0", input=STATE, questions=[PREDICATE])


def test_chat_completions_does_not_take_the_decision_aliases(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="jev-latest", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
