"""``POST /v1/chat/completions`` with real clients against a loopback ``pcd serve`` on the embedded model.

The ``openai`` SDK parses every reply into its own ``ChatCompletion`` / ``ChatCompletionChunk`` models
and raises its own typed errors, so a shape that drifts from OpenAI's fails here; LangChain's
``ChatOpenAI``, instructor and LlamaIndex's ``OpenAILike`` then run unchanged against the same server.
Clients are built with ``max_retries=0``: a 5xx would otherwise be retried quietly, and a 5xx is
exactly what must never happen. One server for the module, small ``max_tokens``: CI has two cores.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai", reason="the chat tests need the 'openai' package (dev extra)")
pytest.importorskip("uvicorn", reason="the HTTP server needs the 'http' extra")
httpx = pytest.importorskip("httpx", reason="the HTTP tests need httpx")

from loopback import assert_openai_bad_request, serving  # noqa: E402

from pcd_core import Engine  # noqa: E402
from pcd_core.request.limits import Limits  # noqa: E402
from pcd_core.tools import NO_TOOL  # noqa: E402
from pcd_integrations.http import create_app  # noqa: E402

MODEL = "smollm2-135m"
MAX_BODY_BYTES = 64 << 10
STATE = "My card was charged twice for order 1182. Refund the duplicate today or I will dispute it."
ASK = [{"role": "user", "content": STATE}]
HELLO = [{"role": "system", "content": "Answer in one short sentence."}, {"role": "user", "content": "Say hello."}]


class Ticket(BaseModel):
    """A support ticket, triaged."""

    urgent: bool = Field(description="Does the customer need an answer today?")
    team: Literal["billing", "shipping", "sales"]
    summary: str = Field(description="The request in a few words", max_length=40)


TICKET_FORMAT = {"type": "json_schema", "json_schema": {"name": "Ticket", "schema": Ticket.model_json_schema()}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    },
}
REFUND = {
    "type": "function",
    "function": {
        "name": "refund_payment",
        "description": "Refund a duplicate payment to the customer.",
        "parameters": {"type": "object", "properties": {"urgent": {"type": "boolean"}}, "required": ["urgent"]},
    },
}


@pytest.fixture(scope="module")
def base_url(engine: Engine) -> Any:
    with serving(create_app(engine, limits=Limits(max_body_bytes=MAX_BODY_BYTES))) as url:
        yield f"{url}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def chat(client: Any, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(**{"model": MODEL, "messages": messages, **kwargs})


# -- structured output: a fill ----------------------------------------------------------------------
def test_json_schema_content_is_the_engines_fill_with_its_decisions(client: Any, engine: Engine) -> None:
    reply = chat(client, ASK, response_format=TICKET_FORMAT)
    (choice,) = reply.choices
    assert choice.finish_reason == "stop" and choice.message.role == "assistant" and not choice.message.tool_calls
    ticket = Ticket.model_validate_json(choice.message.content)
    expected = engine.fill(Ticket.model_json_schema(), STATE)
    assert ticket.model_dump() == expected.values
    pcd = reply.x_pcd
    assert pcd["method"] == "filled" and list(pcd["fields"]) == ["urgent", "team", "summary"]
    for name in ("urgent", "team"):  # closed fields are decided, each with its distribution
        decided = pcd["fields"][name]
        assert decided["method"] != "generated" and sum(decided["probabilities"].values()) == pytest.approx(1.0)
        assert decided["value"] == getattr(ticket, name)
    assert pcd["fields"]["summary"]["method"] == "generated"
    usage = reply.usage
    assert usage.completion_tokens == pcd["fields"]["summary"]["n_tokens"] > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    again = chat(client, ASK, response_format=TICKET_FORMAT).usage  # the head is cached by now
    assert again.prompt_tokens == usage.prompt_tokens and 0 < again.prompt_tokens_details.cached_tokens


def test_concurrent_structured_requests_share_their_summaries_steps_and_read_as_alone(
    client: Any, engine: Engine
) -> None:
    states = [
        STATE,
        "The blender I ordered arrived cracked. Please send a new one.",
        "Do you sell gift cards for the spring sale?",
        "My parcel has been stuck in transit for two weeks.",
    ]
    schema = Ticket.model_json_schema()
    engine.fill(schema, STATE)  # the head cached, as every fill below finds it
    alone = [engine.fill(schema, state) for state in states]
    replies: list[Any] = [None] * len(states)
    start = threading.Barrier(len(states))

    def ask(k: int) -> None:
        start.wait()
        replies[k] = chat(client, [{"role": "user", "content": states[k]}], response_format=TICKET_FORMAT)

    passes = engine.backend.forward_passes
    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(states))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spent = engine.backend.forward_passes - passes
    for solo, reply in zip(alone, replies, strict=True):
        assert json.loads(reply.choices[0].message.content) == solo.values
        for name in ("urgent", "team"):
            got = reply.x_pcd["fields"][name]["probabilities"]
            assert got == pytest.approx(solo.fields[name].probabilities, abs=1e-5)
        # each step is one pass to its request, whether it ran it or shared another's
        assert reply.x_pcd["forward_passes"] == solo.stats.forward_passes
    # the summaries' steps joined (pcd_core/concurrency/pass_join.py): fewer passes than the fills one by one
    assert spent < sum(solo.stats.forward_passes for solo in alone)


def test_sdk_parse_with_a_pydantic_model_returns_the_instance(client: Any) -> None:
    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Ticket)
    ticket = parsed.choices[0].message.parsed
    assert isinstance(ticket, Ticket) and ticket.team in ("billing", "shipping", "sales")
    team = parsed.x_pcd["fields"]["team"]  # the extension survives the SDK's parsing, as docs/http.md shows
    assert team["value"] == ticket.team == max(team["probabilities"], key=team["probabilities"].get)


def test_a_reply_behind_a_busy_model_says_how_long_it_waited(client: Any, engine: Engine) -> None:
    assert chat(client, HELLO, max_tokens=2).x_pcd["queue_ms"] == 0.0  # the model was free
    replies: list[Any] = []
    with engine.model.lock:  # the test thread holds the model, so the server's worker queues behind it
        caller = threading.Thread(target=lambda: replies.append(chat(client, HELLO, max_tokens=2)))
        caller.start()
        deadline = time.monotonic() + 120
        while engine.model.lock.waiting < 1:
            assert time.monotonic() < deadline, "the request never queued for the model"
            time.sleep(0.005)
        time.sleep(0.2)
    caller.join(120)
    assert len(replies) == 1 and replies[0].x_pcd["queue_ms"] >= 200.0


# -- tools: a PCD choice, then a fill of the arguments -----------------------------------------------
def test_required_tool_call_comes_back_in_openai_shape_with_its_probabilities(client: Any) -> None:
    reply = chat(client, ASK, tools=[WEATHER, REFUND], tool_choice="required")
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    decision = reply.x_pcd["tool_choice"]
    assert decision["forced"] is False and set(decision["probabilities"]) == {"get_weather", "refund_payment"}
    assert sum(decision["probabilities"].values()) == pytest.approx(1.0, abs=1e-6)
    assert call.function.name == decision["choice"] == max(decision["probabilities"], key=decision["probabilities"].get)
    tool = {"get_weather": WEATHER, "refund_payment": REFUND}[call.function.name]
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == set(tool["function"]["parameters"]["properties"]) == set(reply.x_pcd["fields"])


def test_a_named_tool_is_called_without_a_choice_and_a_closed_argument_is_decided(client: Any) -> None:
    named = {"type": "function", "function": {"name": "refund_payment"}}
    reply = chat(client, ASK, tools=[WEATHER, REFUND], tool_choice=named)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "refund_payment" and isinstance(json.loads(call.function.arguments)["urgent"], bool)
    assert reply.x_pcd["tool_choice"]["forced"] is True and "probabilities" not in reply.x_pcd["tool_choice"]
    assert reply.x_pcd["fields"]["urgent"]["method"] != "generated" and reply.usage.completion_tokens == 0


def test_auto_offers_answering_directly_and_replies_by_what_it_chose(client: Any) -> None:
    reply = chat(client, ASK, tools=[WEATHER, REFUND], max_tokens=8)
    decision = reply.x_pcd["tool_choice"]
    assert set(decision["probabilities"]) == {"get_weather", "refund_payment", NO_TOOL}
    choice = reply.choices[0]
    if decision["choice"] == NO_TOOL:
        assert choice.finish_reason in ("stop", "length") and choice.message.content
        assert reply.x_pcd["method"] == "generated" and not choice.message.tool_calls
    else:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == decision["choice"]


def test_after_a_tool_result_that_tool_is_not_offered_again(client: Any) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    alone = chat(client, history, tools=[WEATHER], max_tokens=8)
    assert not alone.choices[0].message.tool_calls and alone.choices[0].message.content
    assert alone.x_pcd["method"] == "generated" and alone.x_pcd["tool_choice"] is None  # nothing left to decide
    two = chat(client, history, tools=[WEATHER, REFUND], max_tokens=8).x_pcd["tool_choice"]
    assert set(two["probabilities"]) == {"refund_payment", NO_TOOL} and two["called_this_turn"] == ["get_weather"]


# -- plain text, and streams ---------------------------------------------------------------------------
def test_streamed_deltas_join_to_the_same_greedy_reply_with_usage(client: Any) -> None:
    whole = chat(client, HELLO, max_tokens=12)
    assert whole.x_pcd["method"] == "generated" and whole.choices[0].message.content
    events = list(chat(client, HELLO, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert all(event.object == "chat.completion.chunk" and event.id == events[0].id for event in events)
    assert events[0].choices[0].delta.role == "assistant"
    with_choices = [event for event in events if event.choices]
    text = "".join(event.choices[0].delta.content or "" for event in with_choices)
    assert text == whole.choices[0].message.content
    assert [e.choices[0].finish_reason for e in with_choices][-1] == whole.choices[0].finish_reason
    assert all(e.choices[0].finish_reason is None for e in with_choices[:-1])
    (usage_event,) = [event for event in events if not event.choices]
    assert usage_event is events[-1] and usage_event.usage.completion_tokens == whole.usage.completion_tokens <= 12


def test_a_failure_mid_stream_is_an_error_event_the_sdk_raises_not_a_cut_stream(
    client: Any, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = engine.stream

    def fails_after_one_token(*args: Any, **kwargs: Any) -> Any:
        tokens = real(*args, **kwargs)
        yield next(tokens)
        tokens.close()
        raise RuntimeError("the backend fell over")

    monkeypatch.setattr(engine, "stream", fails_after_one_token)
    received = []
    with pytest.raises(openai.APIError, match="the backend fell over") as caught:
        for event in chat(client, HELLO, max_tokens=12, stream=True):
            received.append(event)
    # the status line (200) was out before the failure, so the SDK raises the event, not a status error
    assert not isinstance(caught.value, openai.APIStatusError)
    assert received[0].choices[0].delta.role == "assistant" and received[1].choices[0].delta.content
    monkeypatch.undo()
    assert chat(client, HELLO, max_tokens=2).choices[0].message.content  # the engine serves on


def test_max_tokens_and_stop_bound_the_text_and_temperature_changes_nothing(client: Any) -> None:
    short = chat(client, HELLO, max_completion_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
    full = chat(client, HELLO, max_tokens=12).choices[0].message.content
    warm = chat(client, HELLO, max_tokens=12, temperature=0.7)  # accepted, and said to change nothing
    assert warm.choices[0].message.content == full and "temperature=0.7 is ignored" in warm.x_pcd["warnings"][0]
    cut = chat(client, HELLO, max_tokens=12, stop=[full[3:6]]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.index(full[3:6])]


def test_a_streamed_fill_and_a_streamed_tool_call_each_come_as_one_chunk(client: Any) -> None:
    filled = [e for e in chat(client, ASK, response_format=TICKET_FORMAT, stream=True) if e.choices]
    contents = [e.choices[0].delta.content for e in filled if e.choices[0].delta.content]
    assert (
        len(contents) == 1
        and contents[0] == chat(client, ASK, response_format=TICKET_FORMAT).choices[0].message.content
    )
    called = list(chat(client, ASK, tools=[REFUND], tool_choice="required", stream=True))
    deltas = [d for e in called for d in e.choices[0].delta.tool_calls or ()]
    (delta,) = deltas
    assert (
        delta.index == 0
        and delta.function.name == "refund_payment"
        and called[-1].choices[0].finish_reason == "tool_calls"
    )
    assert called[-1].x_pcd["tool_choice"]["choice"] == "refund_payment"


def test_models_list_the_served_model_and_another_name_is_not_found(client: Any, engine: Engine) -> None:
    (card,) = client.models.list().data
    assert card.id == engine.model_name and card.object == "model" and card.created > 0 and card.owned_by
    with pytest.raises(openai.NotFoundError) as caught:
        chat(client, ASK, model="gpt-6-luna")
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")
    assert card.id in caught.value.message


# -- other clients, unchanged ---------------------------------------------------------------------------
def test_langchain_chat_openai_invokes_structures_and_calls_tools(client: Any, base_url: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai", reason="needs langchain-openai (dev extra)")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=base_url, api_key="unused", max_retries=0, max_tokens=12)
    reply = llm.invoke([("system", HELLO[0]["content"]), ("user", HELLO[1]["content"])])
    assert reply.content == chat(client, HELLO, max_tokens=12).choices[0].message.content
    for method in ("json_schema", "function_calling"):
        ticket = llm.with_structured_output(Ticket, method=method).invoke(STATE)
        assert isinstance(ticket, Ticket), method
    message = llm.bind_tools([REFUND], tool_choice="refund_payment").invoke(STATE)
    (call,) = message.tool_calls
    assert call["name"] == "refund_payment" and isinstance(call["args"]["urgent"], bool)


def test_instructor_json_schema_mode_gets_the_same_object_as_a_direct_request(client: Any) -> None:
    instructor = pytest.importorskip("instructor", reason="needs instructor (the openai-clients extra)")
    patched = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    ticket = patched.chat.completions.create(model=MODEL, messages=ASK, response_model=Ticket, max_retries=0)
    direct = chat(client, ASK, response_format=TICKET_FORMAT).choices[0].message.content
    # instructor may hand back its own subclass of Ticket, so the values are compared
    assert isinstance(ticket, Ticket) and ticket.model_dump() == json.loads(direct)


def test_llama_index_openai_like_chats_and_predicts_structure(client: Any, base_url: str) -> None:
    openai_like = pytest.importorskip("llama_index.llms.openai_like", reason="needs llama-index-llms-openai-like")
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.prompts import PromptTemplate

    llm = openai_like.OpenAILike(
        model=MODEL,
        api_base=base_url,
        api_key="unused",
        is_chat_model=True,
        is_function_calling_model=True,
        context_window=8192,
        max_tokens=12,
        max_retries=0,
    )
    reply = llm.chat([ChatMessage(role=m["role"], content=m["content"]) for m in HELLO])
    assert reply.message.content == chat(client, HELLO, max_tokens=12).choices[0].message.content
    ticket = llm.structured_predict(Ticket, PromptTemplate("Triage this ticket: {text}"), text=STATE)
    assert isinstance(ticket, Ticket)


# -- refusals: 4xx in OpenAI's shape, before any model work ---------------------------------------------
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
BAD = {
    "an image part": (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, IMAGE]}]},
        "messages[0].content[1]",
        "image",
    ),
    "an audio part": (
        {
            "messages": [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}
            ]
        },
        "messages[0].content[0]",
        "audio",
    ),
    "two choices": ({"n": 2}, "n", "greedy"),
    "logprobs": ({"logprobs": True}, "logprobs", "x_pcd"),
    "a function role": ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages[0]", "role"),
    "json_object": ({"response_format": {"type": "json_object"}}, "response_format", "json_schema"),
    "a reserved tool name": (
        {"tools": [{"type": "function", "function": {"name": NO_TOOL}}]},
        "tools",
        "call no tool",
    ),
    "a choice of an absent tool": (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "send_email"}}},
        "tool_choice",
        "send_email",
    ),
    "required without tools": ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    "messages over the context": (
        {"messages": [{"role": "user", "content": "the customer is unhappy " * 2000}]},
        "messages",
        "context",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_request_is_an_sdk_bad_request_error_before_any_pass(client: Any, engine: Engine, case: str) -> None:
    changes, param, words = BAD[case]
    passes = engine.backend.forward_passes
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": MODEL, "messages": ASK, **changes})
    assert_openai_bad_request(caught.value, param, words)
    assert engine.backend.forward_passes == passes, "refused before the model was asked"


JSON = {"content-type": "application/json"}
RAW = {
    "not json": (b'{"model": "smollm2-135m", "messages": ', 400, "json_invalid"),
    "a repeated key": (b'{"model": "smollm2-135m", "model": "x", "messages": []}', 400, "json_duplicate_key"),
    "no messages": (b'{"model": "smollm2-135m", "messages": []}', 400, "too_short"),
    "over the bound": (
        b'{"model": "smollm2-135m", "messages": "' + b"x" * MAX_BODY_BYTES + b'"}',
        413,
        "payload_too_large",
    ),
}


@pytest.mark.parametrize("case", sorted(RAW))
def test_a_raw_body_that_is_no_request_gets_its_status_in_openai_shape(base_url: str, case: str) -> None:
    body, status, code = RAW[case]
    response = httpx.post(f"{base_url}/chat/completions", content=body, headers=JSON)
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["type"]) == (status, code, "invalid_request_error"), error
    assert set(error) == {"message", "type", "param", "code"}


def test_a_body_over_the_bound_is_413_in_openai_shape_on_both_openai_routes(client: Any) -> None:
    big = "x" * MAX_BODY_BYTES
    predicate = {"type": "predicate", "instructions": "Is it long?"}
    for send in (
        lambda: chat(client, [{"role": "user", "content": big}]),
        lambda: client.decisions.create(model=MODEL, input=big, questions=[predicate]),
    ):
        with pytest.raises(openai.APIStatusError) as caught:  # the SDK reads it as its own error
            send()
        error = caught.value
        assert (error.status_code, error.code, error.type) == (413, "payload_too_large", "invalid_request_error")
        assert "max_body_bytes" in error.message


# -- a client that hangs up -------------------------------------------------------------------------
COUNT = [{"role": "user", "content": "Count from 1 to 500, separated by commas."}]


def _post_and_keep_open(base_url: str, body: dict[str, Any]) -> Any:
    """Send a chat request with the standard library's HTTP client and leave it unread: the caller
    hangs up by closing the returned connection.
    """
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(base_url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=600)
    payload = json.dumps(body).encode()
    connection.request("POST", f"{where.path}/chat/completions", payload, {"Content-Type": "application/json"})
    return connection


def test_a_client_that_hangs_up_stops_its_request_and_the_next_one_does_not_wait(engine, base_url):
    """A 400-token chat whose client hangs up stops within a few passes: a follow-up that ran while the
    long one was alive waited for the model at each of its steps, one sent after the hang-up does not
    wait (its ``x_pcd.queue_ms``), and no pass runs once it is done.
    """
    follow = {"model": MODEL, "messages": COUNT, "max_tokens": 32}
    answered = httpx.post(f"{base_url}/chat/completions", json=follow, timeout=600).json()  # the head cached
    assert answered["choices"][0]["finish_reason"] == "length", answered
    before = engine.backend.forward_passes
    connection = _post_and_keep_open(base_url, {"model": MODEL, "messages": COUNT, "max_tokens": 400})
    deadline = time.monotonic() + 120
    while engine.backend.forward_passes < before + 3:  # the long reply is being generated
        assert time.monotonic() < deadline, "the long request never started"
        time.sleep(0.01)
    busy = httpx.post(f"{base_url}/chat/completions", json=follow, timeout=600).json()
    connection.close()  # the client hangs up; the long reply has at most 400 - 32 steps to go
    hung_up_at = engine.backend.forward_passes
    after = httpx.post(f"{base_url}/chat/completions", json=follow, timeout=600).json()
    done = engine.backend.forward_passes
    time.sleep(1.0)
    assert engine.backend.forward_passes == done, "a pass ran after the last answer: the long request goes on"
    long_passes = done - before - busy["x_pcd"]["forward_passes"] - after["x_pcd"]["forward_passes"]
    print(
        f"hung-up request: {long_passes} passes of up to 401, {done - hung_up_at - after['x_pcd']['forward_passes']}"
        f" after the hang-up; queue_ms of a 32-token follow-up: {busy['x_pcd']['queue_ms']:.0f} while it ran, "
        f"{after['x_pcd']['queue_ms']:.0f} after the hang-up"
    )
    assert busy["choices"][0]["message"] == after["choices"][0]["message"] == answered["choices"][0]["message"]
    assert long_passes < 401 // 2
    assert after["x_pcd"]["queue_ms"] < busy["x_pcd"]["queue_ms"] / 4


# -- the protocol's own words for its mistakes -----------------------------------------------------
@pytest.mark.parametrize("param", ["max_tokens", "max_completion_tokens"])
def test_a_reply_cap_over_the_context_names_the_parameter_and_its_room(client, engine, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=HELLO, **{param: engine.context_length})
    assert_openai_bad_request(raised.value, param, f"set {param} to at most")
    room = int(raised.value.message.rsplit(" ", 1)[1])
    assert 0 < room < engine.context_length and "max_new_tokens" not in raised.value.message
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, **{param: 1})  # within the room: served
    assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_gets_415_saying_so_in_each_protocol(base_url, content_type):
    headers = {"content-type": content_type} if content_type else {}
    chat_body = json.dumps({"model": MODEL, "messages": HELLO, "max_tokens": 1})
    refused = httpx.post(f"{base_url}/chat/completions", content=chat_body, headers=headers)
    assert refused.status_code == 415, refused.text
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_media_type"
    assert "Content-Type: application/json" in error["message"]
    system_one = json.dumps({"state": STATE, "questions": {"q": {"type": "noul", "instructions": "Is it urgent?"}}})
    refused = httpx.post(f"{base_url}/systemone", content=system_one, headers=headers)
    assert refused.status_code == 415 and refused.json()["detail"]["error_type"] == "unsupported_media_type"
    json_type = {"content-type": "application/json; charset=utf-8"}
    assert httpx.post(f"{base_url}/chat/completions", content=chat_body, headers=json_type).status_code == 200
