"""The LlamaIndex adapter on the embedded model: programs, structured LLM calls, async, the Workflow."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from conftest import LoopTicks
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock
from llama_index.core.prompts import ChatPromptTemplate, PromptTemplate
from pydantic import BaseModel, Field

from pcd_core import Engine, PromptError, SchemaError
from pcd_integrations.llama_index import PCDLLM, PCDProgram, prompt_to_text

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "llama_index_workflow.py"

MESSAGE = "My card was charged twice and nobody answers the phone. This is unacceptable!"


class Ticket(BaseModel):
    """A customer message, triaged."""

    urgent: bool = Field(description="Does the customer need an answer today?")
    sentiment: Literal["positive", "negative", "neutral"] = Field(description="The customer's mood")


@pytest.fixture
def program(engine: Engine) -> PCDProgram[Ticket]:
    return PCDProgram.from_defaults(
        output_cls=Ticket, prompt_template_str="Customer message:\n{message}", engine=engine
    )


@pytest.fixture
def llm(engine: Engine) -> PCDLLM:
    return PCDLLM(engine)


def _ticket_prompt() -> PromptTemplate:
    return PromptTemplate("Customer message:\n{message}")


def test_program_returns_output_cls_with_its_decisions(program: PCDProgram[Ticket], engine: Engine) -> None:
    assert program.last_decisions == {}
    ticket = program(message=MESSAGE)

    assert isinstance(ticket, Ticket)
    decisions = program.last_decisions
    assert list(decisions) == ["urgent", "sentiment"]
    # the program's decisions are the engine's own fill of the formatted prompt
    expected = engine.fill(Ticket, f"Customer message:\n{MESSAGE}").fields
    for name, result in decisions.items():
        assert result.value == getattr(ticket, name) == expected[name].value
        assert result.probabilities == pytest.approx(expected[name].probabilities, abs=1e-6)
        assert result.probability == max(result.probabilities.values())
        assert sum(result.probabilities.values()) == pytest.approx(1.0, abs=1e-9)
        assert result.candidate_mass == pytest.approx(expected[name].candidate_mass, abs=1e-6)
        assert result.confidence == pytest.approx(expected[name].confidence, abs=1e-6)
    assert set(decisions["urgent"].probabilities) == {"true", "false"}
    assert set(decisions["sentiment"].probabilities) == {"positive", "negative", "neutral"}
    assert program.last_extraction is not None
    assert program.last_extraction.value == ticket


def test_complaint_reads_negative_and_praise_positive(program: PCDProgram[Ticket]) -> None:
    complaint = program(message="I hate this app. It is terrible and broken.")
    praise = program(message="Thank you so much, the support team was wonderful and fixed everything!")
    assert (complaint.sentiment, praise.sentiment) == ("negative", "positive")


def test_stream_call_yields_each_decided_wave_then_the_object(program: PCDProgram[Ticket]) -> None:
    items = list(program.stream_call(message=MESSAGE))
    waves = sorted({result.wave for result in program.last_decisions.values()})
    assert len(items) == len(waves) >= 2, "Ticket's two fields are decided in two waves"
    *partials, ticket = items
    assert isinstance(ticket, Ticket)
    first_wave = [name for name, result in program.last_decisions.items() if result.wave == waves[0]]
    assert {k: v for k, v in partials[0].model_dump().items() if v is not None} == {
        name: getattr(ticket, name) for name in first_wave
    }


@pytest.mark.asyncio
async def test_acall_matches_call_without_blocking_the_loop(program: PCDProgram[Ticket]) -> None:
    async with LoopTicks() as ticks:
        ticket = await program.acall(message=MESSAGE)
    async_decisions = program.last_decisions

    assert ticks.count >= 3, "the event loop stalled while the engine was deciding"
    sync = program.extract(message=MESSAGE)
    assert ticket == sync.value
    for name, result in async_decisions.items():
        assert result.probabilities == pytest.approx(sync.fields[name].probabilities, abs=1e-5)


def test_structured_predict_goes_through_the_engine(llm: PCDLLM, program: PCDProgram[Ticket], engine: Engine) -> None:
    passes_before = engine.backend.forward_passes
    ticket = llm.structured_predict(Ticket, _ticket_prompt(), message=MESSAGE)

    assert isinstance(ticket, Ticket)
    assert engine.backend.forward_passes > passes_before
    assert ticket == program(message=MESSAGE)


def test_stream_structured_predict_ends_with_the_complete_object(llm: PCDLLM) -> None:
    items = list(llm.stream_structured_predict(Ticket, _ticket_prompt(), message=MESSAGE))
    assert len(items) >= 2
    assert isinstance(items[-1], Ticket)
    assert not any(isinstance(item, Ticket) for item in items[:-1])


@pytest.mark.asyncio
async def test_async_structured_predict_and_its_stream_agree(llm: PCDLLM) -> None:
    ticket = await llm.astructured_predict(Ticket, _ticket_prompt(), message=MESSAGE)
    # the same object as the synchronous call: an async path that formatted the prompt differently fails
    assert ticket == llm.structured_predict(Ticket, _ticket_prompt(), message=MESSAGE)
    stream = await llm.astream_structured_predict(Ticket, _ticket_prompt(), message=MESSAGE)
    assert [item async for item in stream][-1] == ticket


def test_as_structured_llm_returns_engine_objects(llm: PCDLLM, engine: Engine) -> None:
    structured = llm.as_structured_llm(Ticket)
    passes_before = engine.backend.forward_passes

    response = structured.chat([ChatMessage(role=MessageRole.USER, content=MESSAGE)])
    assert isinstance(response.raw, Ticket)
    assert engine.backend.forward_passes > passes_before
    assert Ticket.model_validate(json.loads(response.message.content)) == response.raw
    # a lone user message is the engine's input as it is, whichever way it arrives
    assert structured.complete(MESSAGE).raw == response.raw


@pytest.mark.asyncio
async def test_as_structured_llm_async_chat(llm: PCDLLM, engine: Engine) -> None:
    structured = llm.as_structured_llm(Ticket)
    response = await structured.achat([ChatMessage(role=MessageRole.USER, content=MESSAGE)])
    assert isinstance(response.raw, Ticket)
    assert response.raw == engine.fill(Ticket, MESSAGE).value  # the sync path's reading, awaited
    assert Ticket.model_validate(json.loads(response.message.content)) == response.raw


def test_output_cls_must_be_a_pydantic_class(engine: Engine) -> None:
    with pytest.raises(SchemaError, match="pydantic BaseModel"):
        PCDProgram.from_defaults(output_cls={"type": "object"}, prompt_template_str="{x}", engine=engine)


def test_from_defaults_rejects_ambiguous_arguments(engine: Engine) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        PCDProgram.from_defaults(output_cls=Ticket, engine=engine)
    with pytest.raises(ValueError, match="exactly one"):
        PCDProgram.from_defaults(
            output_cls=Ticket, prompt_template_str="{x}", prompt=PromptTemplate("{x}"), engine=engine
        )
    with pytest.raises(ValueError, match="either llm=, engine= or model="):
        PCDProgram.from_defaults(output_cls=Ticket, prompt_template_str="{x}", engine=engine, model="smollm2-135m")


def test_metadata_describes_the_engine(llm: PCDLLM, engine: Engine) -> None:
    metadata = llm.metadata
    assert metadata.model_name == engine.model_name == llm.model_name
    assert metadata.context_window == engine.context_length
    assert metadata.num_output == llm.max_new_tokens
    assert metadata.is_function_calling_model and metadata.is_chat_model


def test_one_message_is_passed_as_it_is() -> None:
    assert prompt_to_text(PromptTemplate("Message: {m}"), {"m": "hello"}) == "Message: hello"


def test_several_messages_keep_their_roles() -> None:
    prompt = ChatPromptTemplate(message_templates=[ChatMessage(role=MessageRole.USER, content="Message: {m}")])
    text = prompt_to_text(prompt, {"m": "hello"}, system_prompt="Be strict.")
    assert text == "system: Be strict.\n\nuser: Message: hello"


def test_non_text_blocks_are_a_prompt_error() -> None:
    image = ChatMessage(role=MessageRole.USER, blocks=[TextBlock(text="see"), ImageBlock(url="http://x/y.png")])
    with pytest.raises(PromptError, match="ImageBlock"):
        prompt_to_text(ChatPromptTemplate(message_templates=[image]), {})


def test_workflow_example_routes_every_document(
    engine: Engine, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("llama_index_workflow", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    # pydantic resolves the example's annotations through sys.modules, as for an imported module
    monkeypatch.setitem(sys.modules, spec.name, example)
    spec.loader.exec_module(example)

    report = example.main(engine)

    decisions = report.accepted + report.review
    assert sorted(d.source for d in decisions) == sorted(example.MESSAGES)
    assert all(isinstance(d.triage, example.Triage) for d in decisions)
    assert all(d.weakest_confidence >= example.CONFIDENCE_THRESHOLD for d in report.accepted)
    assert all(d.weakest_confidence < example.CONFIDENCE_THRESHOLD for d in report.review)
    printed = capsys.readouterr().out
    assert all(source in printed for source in example.MESSAGES)
    assert "review:" in printed


def test_import_without_the_extra_names_the_pip_command() -> None:
    blocked = "import sys; sys.modules['llama_index.core'] = None; import pcd_integrations.llama_index"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "BackendUnavailableError" in result.stderr
    assert "pip install 'pcd-engine[llama-index]'" in result.stderr
