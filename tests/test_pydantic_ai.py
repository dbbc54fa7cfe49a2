"""pydantic-ai on the embedded model: ``PCDModel`` in-process, and pydantic-ai's own ``SystemOneModel``
unchanged against a loopback ``pcd serve``.

An agent's output type is filled (the object ``engine.fill`` returns for the same input, with each
field's probability and candidate mass in the response's provider details), a tool is chosen and called
as ``ChatPCD`` chooses it, and a ``str`` reply streams token by token.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from typing import Any, Literal

import pytest

pytest.importorskip("pydantic_ai", reason="the pydantic-ai tests need the 'pydantic-ai' extra")
pytest.importorskip("uvicorn", reason="the System One test needs the 'http' extra")

from loopback import serving
from pydantic import BaseModel, Field
from pydantic_ai import Agent
from pydantic_ai.exceptions import UserError
from pydantic_ai.messages import ModelResponse, ToolCallPart, ToolReturnPart
from pydantic_ai.models.system_one import SystemOneModel
from pydantic_ai.providers.system_one import SystemOneProvider

from pcd_core import Engine
from pcd_integrations.http import create_app
from pcd_integrations.pydantic_ai import PCDModel

PROMPT = "My card was charged twice for order 1182. Refund the duplicate today or I will dispute it."


class Ticket(BaseModel):
    """A support ticket, routed."""

    team: Literal["billing", "shipping", "sales"] = Field(description="Which team handles it?")
    urgent: bool = Field(description="Does it need an answer today?")
    summary: str = Field(description="The request in one short line.")


class Handling(BaseModel):
    """How to handle a support ticket."""

    refund: bool = Field(description="Does the customer ask for money back?")
    team: Literal["billing", "shipping"] = Field(description="Which team should handle this?")


@pytest.fixture(scope="module")
def model(engine: Engine) -> PCDModel:
    return PCDModel(engine)


def _responses(result: Any) -> list[ModelResponse]:
    return [message for message in result.all_messages() if isinstance(message, ModelResponse)]


def test_agent_returns_the_object_fill_returns_with_each_fields_evidence(model: PCDModel, engine: Engine) -> None:
    result = Agent(model, output_type=Ticket).run_sync(PROMPT)
    filled = engine.fill(Ticket, PROMPT)
    assert isinstance(result.output, Ticket) and result.output == filled.value
    response = _responses(result)[-1]
    assert response.model_name == engine.model_name and response.provider_name == "pcd"
    details = response.provider_details
    assert details is not None and set(details["fields"]) == {"team", "urgent", "summary"}
    for name in ("team", "urgent"):
        decided, reference = details["fields"][name], filled.fields[name]
        assert math.isclose(decided["probability"], reference.probability, abs_tol=1e-6)
        assert math.isclose(decided["candidate_mass"], reference.candidate_mass, abs_tol=1e-6)
        assert math.isclose(sum(decided["probabilities"].values()), 1.0, abs_tol=1e-6)
    assert details["fields"]["summary"]["method"] == "generated"
    assert details["cost"]["forward_passes"] > 0 and response.usage.input_tokens == details["cost"]["input_tokens"]


def test_instructions_are_the_fills_task(model: PCDModel, engine: Engine) -> None:
    instructions = "Route tickets for an online shop."
    result = Agent(model, output_type=Ticket, instructions=instructions).run_sync(PROMPT)
    assert result.output == engine.fill(Ticket, PROMPT, task=instructions).value


def test_an_agent_with_a_tool_calls_it_then_answers(model: PCDModel) -> None:
    agent = Agent(model, output_type=Handling)
    looked_up: list[int] = []

    @agent.tool_plain
    def lookup_order(order: int) -> str:
        """Look up an order by its number: its status, payments and refunds."""
        looked_up.append(order)
        return f"order {order}: paid twice, 19.99 each"

    result = agent.run_sync(PROMPT)
    assert looked_up == [1182]  # chosen by PCD, its argument filled from the prompt; called once per turn
    first, last = _responses(result)[0], _responses(result)[-1]
    call = first.parts[0]
    assert isinstance(call, ToolCallPart) and call.tool_name == "lookup_order" and call.args == {"order": 1182}
    choice = (first.provider_details or {})["tool_choice"]
    assert choice["choice"] == "lookup_order" and set(choice["offered"]) == {"lookup_order", "answer_directly"}
    assert math.isclose(sum(choice["probabilities"].values()), 1.0, abs_tol=1e-6)
    assert any(isinstance(p, ToolReturnPart) for m in result.all_messages() for p in getattr(m, "parts", []))
    # the tool is not offered again this turn, so the answer is the only option left: nothing is read
    assert isinstance(result.output, Handling) and "tool_choice" not in (last.provider_details or {})


def test_text_streams_token_by_token_as_the_plain_run_writes_it(model: PCDModel) -> None:
    agent = Agent(model)
    settings = {"max_tokens": 12}
    whole = agent.run_sync("Say hello in three words.", model_settings=settings).output

    async def streamed() -> list[str]:
        async with agent.run_stream("Say hello in three words.", model_settings=settings) as stream:
            return [delta async for delta in stream.stream_text(delta=True)]

    deltas = asyncio.run(streamed())
    assert len(deltas) > 1 and "".join(deltas) == whole


def test_a_streamed_structured_output_equals_the_plain_run(model: PCDModel) -> None:
    agent = Agent(model, output_type=Ticket)

    async def streamed() -> Ticket:
        async with agent.run_stream(PROMPT) as stream:
            return await stream.get_output()

    assert asyncio.run(streamed()) == agent.run_sync(PROMPT).output


class Thread(BaseModel):
    """A recursive type: a schema with a cycle, which no finite fill plan covers."""

    subject: str
    replies: list[Thread] = Field(description="The replies, each a thread.")


def test_an_output_type_the_engine_cannot_fill_is_a_clear_error(model: PCDModel, engine: Engine) -> None:
    passes = engine.backend.forward_passes
    with pytest.raises(UserError, match="PCDModel cannot fill the output type 'final_result'") as caught:
        Agent(model, output_type=Thread).run_sync(PROMPT)
    assert "$defs" in str(caught.value)  # the engine's own reason, with the offending part
    assert engine.backend.forward_passes == passes  # refused before the model read anything


def test_pydantic_ais_system_one_model_works_unchanged_against_pcd_serve(engine: Engine) -> None:
    with serving(create_app(engine)) as url:
        for name in (engine.model_name, "jev-latest"):
            model = SystemOneModel(name, provider=SystemOneProvider(base_url=url))
            result = Agent(model, output_type=Handling).run_sync(PROMPT)
            assert isinstance(result.output, Handling)
            response = _responses(result)[-1]
            details = response.provider_details or {}
            probabilities = details["probabilities"]["team"]
            assert set(probabilities) == {"billing", "shipping"}
            assert result.output.team == max(probabilities, key=probabilities.get)
            assert response.model_name == engine.model_name


def test_import_without_the_extra_names_the_pip_command() -> None:
    blocked = "import sys; sys.modules['pydantic_ai'] = None; import pcd_integrations.pydantic_ai"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "BackendUnavailableError" in result.stderr
    assert "pip install 'pcd-engine[pydantic-ai]'" in result.stderr
