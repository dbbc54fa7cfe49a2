"""The LangChain adapter on the embedded model: structured output in every schema form, raw decisions,
batch and async, callbacks, clear errors, the install hint and the triage example. The decision model
(``PCDDecisionModel``) has its own module, ``tests/test_langchain_decisions.py``.

Fills are few and share one small schema, so that the head cache keeps them cheap.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal
from uuid import UUID

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.outputs import LLMResult
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.utils.function_calling import convert_to_json_schema
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from pcd_core import Engine, PromptError, SchemaError
from pcd_integrations.langchain import ChatPCD, PlainChatError, render_messages

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "langchain_triage.py"

REFUND = "I was charged twice this month. Refund the duplicate payment today, please!"
CRASH = "The app crashes whenever I press save. Not urgent, I can use the website meanwhile."


class Ticket(BaseModel):
    """A customer support ticket, triaged."""

    urgent: bool = Field(description="Does the customer need an answer today?")
    category: Literal["billing", "bug", "other"] = Field(description="What the ticket is about")


class TicketDict(TypedDict):
    """A customer support ticket, triaged."""

    urgent: bool
    category: Literal["billing", "bug", "other"]


class FreeText(BaseModel):
    urgent: bool
    summary: str


ALLOWED = {"urgent": {True, False}, "category": {"billing", "bug", "other"}}


@pytest.fixture
def llm(engine: Engine) -> ChatPCD:
    return ChatPCD(engine=engine)


def assert_allowed(value: dict[str, Any]) -> None:
    assert set(value) == set(ALLOWED)
    for name, allowed in ALLOWED.items():
        assert value[name] in allowed


class RunRecorder(BaseCallbackHandler):
    """Records the chat-model and chain runs LangChain reports."""

    def __init__(self) -> None:
        self.chat_starts: list[dict[str, Any]] = []
        self.llm_ends: list[LLMResult] = []
        self.chain_starts: list[dict[str, Any]] = []
        self.chain_ends: list[Any] = []

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.chat_starts.append(kwargs)

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        self.llm_ends.append(response)

    def on_chain_start(self, serialized: Any, inputs: Any, **kwargs: Any) -> None:
        self.chain_starts.append({"inputs": inputs, **kwargs})

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self.chain_ends.append(outputs)


# -- structured output ------------------------------------------------------------------------


def test_prompt_chain_returns_a_pydantic_instance(llm: ChatPCD) -> None:
    prompt = ChatPromptTemplate.from_messages([("human", "Support ticket:\n{ticket}")])
    ticket = (prompt | llm.with_structured_output(Ticket)).invoke({"ticket": REFUND})
    assert isinstance(ticket, Ticket)
    assert_allowed(ticket.model_dump())


def test_schema_form_does_not_change_the_decisions(llm: ChatPCD) -> None:
    # the same fields as a pydantic class, its JSON Schema and a TypedDict: a dict for the latter two
    from_pydantic = llm.with_structured_output(Ticket).invoke(REFUND).model_dump()
    from_json_schema = llm.with_structured_output(Ticket.model_json_schema()).invoke(REFUND)
    from_typeddict = llm.with_structured_output(TicketDict).invoke(REFUND)
    assert type(from_json_schema) is dict and type(from_typeddict) is dict
    assert from_json_schema == from_pydantic
    assert_allowed(from_typeddict)


def test_include_raw_carries_the_decisions(llm: ChatPCD, engine: Engine) -> None:
    result = llm.with_structured_output(Ticket, include_raw=True).invoke(REFUND)
    assert set(result) == {"raw", "parsed", "parsing_error"}
    assert result["parsing_error"] is None
    raw, parsed = result["raw"], result["parsed"]
    assert isinstance(raw, AIMessage) and isinstance(parsed, Ticket)
    assert json.loads(raw.content) == parsed.model_dump()
    decisions = raw.response_metadata["pcd"]
    assert list(decisions) == ["urgent", "category"]
    # the metadata is the engine's own fill of the same text, field by field
    expected = engine.fill(Ticket, REFUND).fields
    for name, decision in decisions.items():
        assert decision["value"] == getattr(parsed, name) == expected[name].value
        assert decision["probabilities"] == pytest.approx(expected[name].probabilities, abs=1e-6)
        assert sum(decision["probabilities"].values()) == pytest.approx(1.0, abs=1e-9)
        assert decision["probability"] == max(decision["probabilities"].values())
        assert decision["candidate_mass"] == pytest.approx(expected[name].candidate_mass, abs=1e-6)
        assert decision["confidence"] == pytest.approx(expected[name].confidence, abs=1e-6)
    assert raw.response_metadata["model_name"] == engine.model_name
    assert raw.response_metadata["forward_passes"] > 0
    assert isinstance(raw.response_metadata["pcd_warnings"], list)
    usage = raw.usage_metadata
    assert usage is not None and usage["output_tokens"] == 0
    assert usage["input_tokens"] == usage["total_tokens"] > 0


def test_every_method_and_strict_value_is_accepted(llm: ChatPCD) -> None:
    for method in (None, "json_schema", "function_calling", "json_mode"):
        for strict in (None, False, True):
            assert llm.with_structured_output(Ticket, method=method, strict=strict) is not None
    with pytest.raises(ValueError, match="method='xml'"):
        llm.with_structured_output(Ticket, method="xml")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unsupported arguments"):
        llm.with_structured_output(Ticket, tools=[])


def test_batch_stream_and_async_agree_with_invoke(llm: ChatPCD) -> None:
    structured = llm.with_structured_output(Ticket)
    refund = structured.invoke(REFUND)
    batch = structured.batch([REFUND, CRASH])
    assert batch[0] == refund and isinstance(batch[1], Ticket)
    assert list(structured.stream(REFUND)) == [refund]

    async def run_async() -> tuple[list[Any], list[Any]]:
        return await structured.abatch([REFUND, CRASH]), [c async for c in structured.astream(CRASH)]

    abatch, chunks = asyncio.run(run_async())
    assert abatch == batch
    assert chunks == batch[1:]


def test_async_fill_leaves_the_event_loop_free(llm: ChatPCD) -> None:
    structured = llm.with_structured_output(Ticket)

    async def run() -> int:
        ticks = 0
        task = asyncio.ensure_future(structured.ainvoke(CRASH))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.005)
        await task
        return ticks

    assert asyncio.run(run()) > 1


def test_callbacks_receive_the_chat_model_run(llm: ChatPCD) -> None:
    recorder = RunRecorder()
    structured = llm.with_structured_output(Ticket)
    structured.invoke(REFUND, config={"callbacks": [recorder], "tags": ["triage"]})
    assert len(recorder.chat_starts) == 1 and len(recorder.llm_ends) == 1
    start = recorder.chat_starts[0]
    assert "triage" in start["tags"]
    assert start["options"]["ls_structured_output_format"]["schema"] == convert_to_json_schema(Ticket)
    message = recorder.llm_ends[0].generations[0][0].message
    assert list(message.response_metadata["pcd"]) == ["urgent", "category"]


# -- errors -----------------------------------------------------------------------------------


def test_free_text_field_is_a_schema_error_naming_it(llm: ChatPCD) -> None:
    for structured in (
        llm.with_structured_output(FreeText),
        llm.with_structured_output(FreeText, include_raw=True),
    ):
        with pytest.raises(SchemaError, match="summary"):
            structured.invoke(REFUND)


def test_plain_chat_raises_and_points_to_structured_output(llm: ChatPCD) -> None:
    with pytest.raises(PlainChatError, match="with_structured_output"):
        llm.invoke("Hello")
    with pytest.raises(PlainChatError):
        list(llm.stream("Hello"))
    with pytest.raises(PlainChatError):
        asyncio.run(llm.ainvoke("Hello"))


def test_non_text_content_is_a_prompt_error() -> None:
    image = {"type": "image", "url": "https://example.com/cat.png"}
    with pytest.raises(PromptError, match="'image'"):
        render_messages([HumanMessage(content=[{"type": "text", "text": "look"}, image])])


def test_a_lone_message_is_the_input_and_a_conversation_keeps_roles() -> None:
    assert render_messages([HumanMessage(REFUND)]) == REFUND
    conversation = render_messages([SystemMessage("Be brief."), HumanMessage(REFUND), AIMessage("On it.")])
    assert conversation == f"System: Be brief.\nHuman: {REFUND}\nAI: On it."


# -- construction -----------------------------------------------------------------------------


def test_weights_load_on_first_use_only() -> None:
    llm = ChatPCD(model="smollm2-135m")
    llm.with_structured_output(Ticket)
    assert llm.engine is None


def test_model_name_follows_a_shared_engine(engine: Engine) -> None:
    assert ChatPCD(engine=engine).model == engine.model_name
    with pytest.raises(ValueError, match="engine runs"):
        ChatPCD(model="some-other-model", engine=engine)
    llm = ChatPCD(engine=engine)
    with pytest.raises(ValueError, match="does not switch models"):
        llm.with_structured_output(Ticket).invoke(REFUND, model="some-other-model")


# -- the example ------------------------------------------------------------------------------


def test_triage_example_runs_and_prints_every_decision(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("langchain_triage", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    # pydantic resolves the example's annotations through sys.modules, as for an imported module
    monkeypatch.setitem(sys.modules, spec.name, example)
    spec.loader.exec_module(example)

    tickets = example.main(engine)

    assert len(tickets) == len(example.TICKETS) == 5
    assert all(isinstance(ticket, example.Ticket) for ticket in tickets)
    printed = capsys.readouterr().out
    assert all(text in printed for text in example.TICKETS)
    decision_lines = [line for line in printed.splitlines() if "confidence" in line]
    assert len(decision_lines) == 5 * 4
    assert all("candidate mass" in line for line in decision_lines)


def test_import_without_the_extra_names_the_pip_command() -> None:
    blocked = "import sys; sys.modules['langchain_core'] = None; import pcd_integrations.langchain"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "BackendUnavailableError" in result.stderr
    assert "pip install 'pcd-engine[langchain]'" in result.stderr
