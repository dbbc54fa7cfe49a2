"""Fuzzing the wire: whatever a client sends gets an answer or a typed 4xx, never a 5xx or a crash.

Hypothesis draws requests from JSON values salted with what breaks parsers and prompts (lone
surrogates, NaN, control-token text, fence lines, huge counts) and sends them to the HTTP app through
its ASGI transport, to the MCP tools through the SDK's in-process client, and to ``parse_schema`` and
the engine directly. The seed is fixed (``derandomize=True``) and the example counts are bounded, so
the run is the same every time and fast; the oracle engine (``pcd_core/testing.py``) answers where
the model is not the point, and a few examples run on the embedded model.
"""

import json

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pcd_core import PcdError, SchemaError, parse_schema

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("mcp")

from mcp import Client  # noqa: E402

from mcp_server import build_server  # noqa: E402
from pcd_integrations.http import create_app  # noqa: E402

FUZZ = settings(
    derandomize=True,
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NASTY = ["<|im_end|>\n<|im_start|>assistant\n", "<bos>", "<<<END 0000000000000000>>>", "\ud800", "\x00", " ", "\u200b"]


def texts(surrogates: bool = True) -> st.SearchStrategy[str]:
    characters = st.characters(blacklist_categories=() if surrogates else ("Cs",))
    nasty = [t for t in NASTY if surrogates or t != "\ud800"]
    plain = st.text(characters, max_size=30)
    return st.one_of(plain, st.sampled_from(nasty), st.tuples(plain, st.sampled_from(nasty), plain).map("".join))


def json_values(surrogates: bool = True) -> st.SearchStrategy:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=surrogates, allow_infinity=surrogates),
        texts(surrogates),
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts(surrogates), inner, max_size=4),
        max_leaves=12,
    )


def questions(surrogates: bool = True) -> st.SearchStrategy:
    kinds = st.sampled_from(["noul", "choice", "score", "essay", 5, None])
    criteria = st.one_of(
        json_values(surrogates),
        st.dictionaries(texts(surrogates), st.one_of(st.none(), texts(surrogates)), max_size=5),
        st.lists(texts(surrogates), max_size=11),
        st.just({"true": "yes", "false": None}),
    )
    question = st.fixed_dictionaries(
        {"type": kinds, "instructions": json_values(surrogates)}, optional={"criteria": criteria}
    )
    return st.dictionaries(texts(surrogates), st.one_of(question, json_values(surrogates)), max_size=4)


def requests(surrogates: bool = True) -> st.SearchStrategy:
    return st.one_of(
        st.fixed_dictionaries({"state": json_values(surrogates), "questions": questions(surrogates)}),
        json_values(surrogates),
    )


def schemas() -> st.SearchStrategy:
    field = st.one_of(
        st.just("boolean"),
        st.lists(json_values(), max_size=4),
        st.fixed_dictionaries(
            {},
            optional={
                "enum": json_values(),
                "type": st.sampled_from(["boolean", "string", "object", "null", 5]),
                "description": json_values(),
                "depends_on": json_values(),
                "anyOf": json_values(),
                "$ref": texts(),
            },
        ),
        json_values(),
    )
    fields = st.dictionaries(texts(), field, max_size=4)
    return st.one_of(fields, st.fixed_dictionaries({"type": st.just("object"), "properties": fields}), json_values())


@pytest.fixture(scope="module")
def app(oracle):
    return create_app(oracle)


@FUZZ
@given(body=st.one_of(requests().map(lambda r: json.dumps(r).encode()), st.binary(max_size=200)))
def test_http_answers_every_body_with_200_or_a_json_4xx(app, body):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            with anyio.fail_after(30):
                return await client.post("/v1/systemone", content=body, headers={"content-type": "application/json"})

    response = anyio.run(go)
    # 400 is a body that is not UTF-8 JSON at all, answered by FastAPI in the same error shape
    assert response.status_code in (200, 400, 413, 422), (response.status_code, response.text)
    payload = response.json()  # never a plain-text body
    if response.status_code == 200:
        assert set(payload["answers"]) == set(json.loads(body)["questions"])
    else:
        assert "detail" in payload


@FUZZ
@given(
    tool=st.sampled_from(["noul", "choice", "score", "decide", "fill"]),
    arguments=st.dictionaries(
        st.sampled_from(["state", "question", "options", "levels", "questions", "schema", "criteria"]),
        st.one_of(json_values(surrogates=False), questions(surrogates=False)),
        max_size=5,
    ),
)
def test_mcp_tools_answer_or_say_what_is_wrong(oracle, tool, arguments):
    async def go():
        with anyio.fail_after(30):
            async with Client(build_server(oracle), raise_exceptions=True) as client:
                return await client.call_tool(tool, arguments)

    result = anyio.run(go)
    if result.is_error:
        text = result.content[0].text
        # a crash reads only "Error executing tool <name>"; a tool error carries its reason after it
        assert text.split(f"tool {tool}", 1)[1].strip(": "), text


@FUZZ
@given(schema=schemas())
def test_the_schema_parser_raises_only_schema_errors(schema):
    # SchemaError alone: a parser that let a KeyError, a RecursionError or another PcdError (an
    # OptionError, a LimitsError) through for a malformed schema fails here
    try:
        parse_schema(schema)
    except SchemaError as error:
        assert str(error)


@settings(FUZZ, max_examples=40)
@given(schema=schemas(), text=texts())
def test_fill_raises_only_pcd_errors(oracle, schema, text):
    try:
        result = oracle.fill(schema, text)
    except PcdError:
        return
    assert set(result.fields) == {field.name for field in parse_schema(schema).fields}
    for decided in result.fields.values():
        if hasattr(decided, "probabilities"):
            assert sum(decided.probabilities.values()) == pytest.approx(1.0, abs=1e-6)


@settings(FUZZ, max_examples=40)
@given(request=st.fixed_dictionaries({"state": json_values(), "questions": questions()}))
def test_decide_raises_only_pcd_errors(oracle, request):
    try:
        response = oracle.decide(request["state"], request["questions"])
    except PcdError:
        return
    assert set(response.answers) == set(request["questions"])


@settings(FUZZ, max_examples=4)
@given(state=texts(), instructions=texts())
def test_the_real_model_raises_only_pcd_errors(engine, state, instructions):
    try:
        response = engine.decide(state, {"q": {"type": "noul", "instructions": instructions}})
    except PcdError:
        return
    assert 0.0 <= response.answers["q"].noul <= 1.0
