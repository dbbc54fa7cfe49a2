"""`PCDLLM` as a full LlamaIndex LLM on the embedded model: generation, tool calls, an agent, programs
with open fields, and the structured-predict instrumentation seen by real LlamaIndex handlers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from conftest import LoopTicks
from llama_index.core.agent.workflow import AgentOutput, FunctionAgent, ToolCallResult
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.llm import (
    LLMStructuredPredictEndEvent,
    LLMStructuredPredictInProgressEvent,
    LLMStructuredPredictStartEvent,
)
from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from pydantic import BaseModel, Field

from pcd_core import Engine
from pcd_integrations.llama_index import ANSWER_DIRECTLY, PCDLLM, PCDProgram

USER = [ChatMessage(role=MessageRole.USER, content="Name one colour of the sky.")]


class Report(BaseModel):
    """A customer message, triaged and summarised."""

    urgent: bool = Field(description="Does the customer need an answer today?")
    sentiment: Literal["positive", "negative", "neutral"] = Field(description="The customer's mood")
    summary: str = Field(description="The message in a few words")


REPORT_PROMPT = "Customer message:\n{message}"
MESSAGE = "My card was charged twice and nobody answers the phone. This is unacceptable!"


@pytest.fixture
def llm(engine: Engine) -> PCDLLM:
    return PCDLLM(engine=engine, max_new_tokens=12)


def weather_tool(calls: list[str]) -> FunctionTool:
    def get_weather(city: str) -> str:
        """Look up today's weather in a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    return FunctionTool.from_defaults(get_weather)


def test_construction_loads_no_weights_and_names_the_model() -> None:
    llm = PCDLLM(model="smollm2-135m")
    assert llm.engine is None
    metadata = llm.metadata
    assert llm.engine is None, "reading metadata must not load the model"
    assert (metadata.model_name, metadata.is_function_calling_model, metadata.is_chat_model) == (
        "smollm2-135m",
        True,
        True,
    )


def test_positional_and_keyword_engine_are_the_same_llm(engine: Engine) -> None:
    assert PCDLLM(engine).engine is PCDLLM(engine=engine).engine is engine
    assert PCDLLM(engine).metadata.context_window == engine.context_length


def test_complete_is_the_engines_generation_with_its_usage(llm: PCDLLM, engine: Engine) -> None:
    response = llm.complete("Name one colour of the sky.")
    expected = engine.generate("Name one colour of the sky.", max_new_tokens=12)

    assert response.text == expected.text and expected.text
    assert response.additional_kwargs == {
        "prompt_tokens": expected.input_tokens,
        "completion_tokens": expected.output_tokens,
        "total_tokens": expected.input_tokens + expected.output_tokens,
    }
    assert response.raw["finish_reason"] == expected.finish_reason


def test_stream_complete_yields_token_deltas_that_add_up(llm: PCDLLM) -> None:
    chunks = list(llm.stream_complete("Name one colour of the sky."))
    whole = llm.complete("Name one colour of the sky.")

    assert len(chunks) > 2, "one chunk per token, then the closing one with the final counts"
    assert "".join(chunk.delta or "" for chunk in chunks) == whole.text == chunks[-1].text
    assert chunks[-1].additional_kwargs == whole.additional_kwargs
    counts = [chunk.additional_kwargs["completion_tokens"] for chunk in chunks]
    assert counts == sorted(counts) and counts[0] < counts[-1]


def test_chat_and_stream_chat_agree(llm: PCDLLM) -> None:
    reply = llm.chat(USER)
    chunks = list(llm.stream_chat(USER))

    assert reply.message.role == MessageRole.ASSISTANT and reply.message.content
    assert "".join(chunk.delta or "" for chunk in chunks) == reply.message.content
    assert chunks[-1].message.content == reply.message.content
    assert reply.additional_kwargs["completion_tokens"] > 0


@pytest.mark.asyncio
async def test_async_forms_agree_without_blocking_the_loop(llm: PCDLLM) -> None:
    async with LoopTicks() as ticks:
        reply = await llm.achat(USER)
        streamed = [chunk.delta async for chunk in await llm.astream_chat(USER)]
        completion = await llm.acomplete(USER[0].content or "")
        completed = [chunk.delta async for chunk in await llm.astream_complete(USER[0].content or "")]

    assert ticks.count >= 3, "the event loop stalled while the engine was generating"
    assert "".join(d or "" for d in streamed) == reply.message.content == llm.chat(USER).message.content
    assert "".join(d or "" for d in completed) == completion.text


def test_tool_choice_is_a_pcd_choice_with_probabilities(llm: PCDLLM) -> None:
    calls: list[str] = []
    tool = weather_tool(calls)
    response = llm.chat_with_tools([tool], user_msg="What is the weather in Paris today?")
    choice = response.additional_kwargs["pcd_tool_choice"]

    assert set(choice["probabilities"]) == {"get_weather", ANSWER_DIRECTLY}
    assert sum(choice["probabilities"].values()) == pytest.approx(1.0, abs=1e-4)
    assert choice["choice"] == max(choice["probabilities"], key=choice["probabilities"].get)
    selections = llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
    assert [s.tool_name for s in selections] == (["get_weather"] if choice["choice"] == "get_weather" else [])
    assert calls == [], "choosing a tool does not run it"


def test_required_tool_is_called_with_filled_arguments(llm: PCDLLM) -> None:
    response = llm.chat_with_tools([weather_tool([])], user_msg="What is the weather in Paris?", tool_required=True)
    [selection] = llm.get_tool_calls_from_response(response)

    assert selection.tool_name == "get_weather"
    assert isinstance(selection.tool_kwargs["city"], str) and selection.tool_kwargs["city"]
    assert response.additional_kwargs["pcd_arguments"]["city"]["method"] == "generated"
    # one option left (no "answer directly" when a tool is required): nothing to decide
    assert response.additional_kwargs["pcd_tool_choice"]["forced"] is True


def test_tool_choice_none_answers_in_words(llm: PCDLLM) -> None:
    response = llm.chat_with_tools([weather_tool([])], user_msg="Hello!", tool_choice="none")
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    assert response.message.content
    with pytest.raises(ValueError, match="expected a tool call"):
        llm.get_tool_calls_from_response(response)


@pytest.mark.asyncio
async def test_function_agent_calls_the_tool_and_finishes(engine: Engine) -> None:
    calls: list[str] = []
    agent = FunctionAgent(tools=[weather_tool(calls)], llm=PCDLLM(engine=engine, max_new_tokens=24))
    handler = agent.run(user_msg="What is the weather in Paris today?")
    tool_results: list[ToolCallResult] = []
    outputs: list[AgentOutput] = []
    async for event in handler.stream_events():
        if isinstance(event, ToolCallResult):
            tool_results.append(event)
        elif isinstance(event, AgentOutput):
            outputs.append(event)
    final = await asyncio.wait_for(handler, timeout=120)

    assert [r.tool_name for r in tool_results] == ["get_weather"] and calls == [tool_results[0].tool_kwargs["city"]]
    assert "sunny" in tool_results[0].tool_output.content
    # the last turn is a written reply, not another call (the final output lists the run's tool results)
    assert final.response.content and not final.response.additional_kwargs.get("tool_calls")
    # the first turn's tool was a PCD choice; after the result, that tool is spent for this turn
    assert outputs[0].tool_calls[0].tool_name == "get_weather"


def test_program_from_llm_fills_open_fields(llm: PCDLLM) -> None:
    program = PCDProgram.from_defaults(output_cls=Report, prompt_template_str=REPORT_PROMPT, llm=llm)
    report = program(message=MESSAGE)

    assert isinstance(report, Report) and report.summary.strip()
    methods = {name: result.method for name, result in program.last_decisions.items()}
    assert methods["summary"] == "generated" and methods["urgent"] != "generated"
    assert program.engine is llm.engine


def test_program_on_a_lazy_llm_loads_on_first_call() -> None:
    llm = PCDLLM(model="smollm2-135m")
    PCDProgram.from_defaults(output_cls=Report, prompt_template_str=REPORT_PROMPT, llm=llm)
    assert llm.engine is None
    with pytest.raises(ValueError, match="takes a PCDLLM"):
        PCDProgram.from_defaults(output_cls=Report, prompt_template_str=REPORT_PROMPT, llm=object())


class _Events(BaseEventHandler):
    events: list[BaseEvent] = []

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        self.events.append(event)


@pytest.fixture
def observed() -> Iterator[tuple[SimpleSpanHandler, _Events]]:
    root = get_dispatcher()
    spans, events = SimpleSpanHandler(), _Events(events=[])
    root.add_span_handler(spans)
    root.add_event_handler(events)
    yield spans, events
    root.span_handlers.remove(spans)
    root.event_handlers.remove(events)


def test_structured_predict_runs_in_a_span_with_its_events(
    llm: PCDLLM, observed: tuple[SimpleSpanHandler, _Events]
) -> None:
    spans, events = observed
    report = llm.structured_predict(Report, PromptTemplate(REPORT_PROMPT), message=MESSAGE)

    [span] = [s for s in spans.completed_spans if s.id_.startswith("PCDLLM.structured_predict")]
    mine = [e for e in events.events if e.span_id == span.id_]
    assert [type(e) for e in mine] == [LLMStructuredPredictStartEvent, LLMStructuredPredictEndEvent]
    assert mine[0].output_cls is Report and mine[0].template_args == {"message": MESSAGE}
    assert mine[1].output == report


def test_stream_structured_predict_yields_partials_then_the_valid_object(
    llm: PCDLLM, observed: tuple[SimpleSpanHandler, _Events]
) -> None:
    _, events = observed
    items = list(llm.stream_structured_predict(Report, PromptTemplate(REPORT_PROMPT), message=MESSAGE))

    assert len(items) >= 2
    *partials, report = items
    assert Report.model_validate(report.model_dump()) == report
    assert all(partial.summary is None for partial in partials), "the open field comes after the decided ones"
    assert partials[-1].urgent == report.urgent and partials[-1].sentiment == report.sentiment
    progress = [e.output for e in events.events if isinstance(e, LLMStructuredPredictInProgressEvent)]
    assert progress == items
