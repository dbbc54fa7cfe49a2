"""The vLLM backend against a loopback stub that answers in vLLM's shapes, with the oracle's log-probs.

The stub is a FastAPI app on a real socket: ``/v1/models``, ``/tokenize``, ``/v1/completions`` and
``/metrics`` as vLLM 0.32 shapes them (``choices[i].index``, ``top_logprobs[0]`` keyed
``"token_id:N"`` with the sampled token added, the 400s on a missing ``logprobs`` and on more than
128 ids). Its log-probs come from ``OracleBackend``, so every decision made through it must equal
the local oracle engine's exactly; ``tests/test_vllm_real.py`` holds the same backend against real
vLLM, and checks there that the 400 shapes used here are vLLM's.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from conftest import DATA_DIR, load_case, schema_cases  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402

from pcd_core.backends.base import Query  # noqa: E402
from pcd_core.backends.vllm_backend import VllmBackend, plan_id_chunks  # noqa: E402
from pcd_core.engine import Engine  # noqa: E402
from pcd_core.errors import BackendError, HiddenStatesUnavailableError  # noqa: E402
from pcd_core.testing import ByteTokenizer, OracleBackend, check_backend  # noqa: E402

VOCAB = 300
MAX_IDS = 128  # vLLM's MAX_LOGPROB_TOKEN_IDS
CONTEXT = 16384  # byte tokens: the bundled inputs run to about 5 000


@dataclass
class StubState:
    """What a test can set on the stub, and what the stub saw."""

    mode: str = "raw_logprobs"  # or processed_logprobs, raw_logits
    tokenize_shift: int = 0  # added to every id /tokenize returns: a different tokenizer
    fail_next: list[int] = field(default_factory=list)  # statuses to answer before serving again
    completions: list[dict[str, Any]] = field(default_factory=list)
    oracle: OracleBackend = field(default_factory=lambda: OracleBackend(VOCAB))


def _error(status: int, message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def _log_softmax(values: np.ndarray) -> np.ndarray:
    top = values.max()
    return values - top - np.log(np.exp(values - top).sum())


def build_stub(state: StubState) -> Any:
    app = fastapi.FastAPI()

    @app.middleware("http")
    async def inject_failures(request: Any, call_next: Any) -> Any:
        if state.fail_next:
            status = state.fail_next.pop(0)
            return JSONResponse({"error": {"message": "busy", "code": status}}, status_code=status, headers={})
        return await call_next(request)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        card = {"id": "stub", "object": "model", "owned_by": "vllm", "root": "stub", "max_model_len": CONTEXT}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        ids = [(i + state.tokenize_shift) % VOCAB for i in ByteTokenizer().encode(body["prompt"])]
        return {"count": len(ids), "max_model_len": CONTEXT, "tokens": ids}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        return (
            '# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{engine="0"} 96.0\n'
            'vllm:prefix_cache_hits_total{engine="1"} 32.0\nvllm:prefix_cache_queries_total{engine="0"} 200.0\n'
        )

    @app.post("/v1/completions")
    def completions(body: dict[str, Any]) -> Any:
        state.completions.append(body)
        ids = body.get("logprob_token_ids")
        if ids and body.get("logprobs") is None:
            return _error(400, "`logprobs` must be set when `logprob_token_ids` is set.")
        if ids and len(ids) > MAX_IDS:
            return _error(400, f"logprob_token_ids must have at most {MAX_IDS} entries, got {len(ids)}")
        prompts = body["prompt"]
        choices = []
        for index, prompt in enumerate(prompts):
            logits = state.oracle.logits(prompt)
            raw = _log_softmax(logits)
            bias = np.zeros(VOCAB)
            for token, amount in (body.get("logit_bias") or {}).items():
                bias[int(token)] = amount
            temperature = body.get("temperature", 1.0) or 1.0
            processed = _log_softmax((logits + bias) / temperature)
            shown = {"raw_logprobs": raw, "processed_logprobs": processed, "raw_logits": logits}[state.mode]
            sampled = int(np.argmax(logits + bias))
            wanted = ids if ids else list(np.argsort(-raw)[: body["logprobs"]])
            top = {f"token_id:{sampled}": float(shown[sampled])}
            top.update({f"token_id:{int(i)}": float(shown[int(i)]) for i in wanted})
            logprobs = {
                "text_offset": [0],
                "token_logprobs": [float(shown[sampled])],
                "tokens": [f"token_id:{sampled}"],
                "top_logprobs": [top],
            }
            choices.append(
                {"index": index, "text": "", "logprobs": logprobs, "finish_reason": "length", "stop_reason": None}
            )
        # vLLM orders choices by index; the stub does not, so that the client must
        choices.reverse()
        usage = {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": len(prompts)}
        return {"id": "cmpl-stub", "object": "text_completion", "model": "stub", "choices": choices, "usage": usage}

    return app


@pytest.fixture(scope="module")
def stub_server():
    state = StubState()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(build_stub(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture
def stub(stub_server):
    url, state = stub_server
    state.mode, state.tokenize_shift, state.fail_next = "raw_logprobs", 0, []
    state.completions.clear()
    return url, state


def connect(url: str, **options: Any) -> VllmBackend:
    options.setdefault("backoff_s", 0.01)
    return VllmBackend(url, ByteTokenizer(), vocab_size=VOCAB, **options)


# -- planning ---------------------------------------------------------------------------------
def test_id_chunks_hold_at_most_the_cap_and_keep_a_fitting_read_whole():
    sets = [range(0, 100), range(90, 120), range(150, 160), range(0, 200), (5, 7)]
    chunks = plan_id_chunks(sets, cap=128)
    assert all(len(chunk) <= 128 for chunk in chunks)
    assert set().union(*map(set, chunks)) == set(range(0, 200))
    for ids in sets[:3] + sets[4:]:
        assert any(set(ids) <= set(chunk) for chunk in chunks), ids


# -- reads ------------------------------------------------------------------------------------
def test_two_hundred_ids_are_read_in_two_requests_of_at_most_128(stub):
    url, state = stub
    backend = connect(url)
    state.completions.clear()
    prefix = backend.prefill([10, 20, 30])
    ids = tuple(range(200))
    got = backend.score(prefix, [(40, 50)], [Query(0, 1, ids)]).values[0]
    assert [len(body["logprob_token_ids"]) for body in state.completions] == [128, 72]
    assert backend.forward_passes == 2
    np.testing.assert_array_equal(got, state.oracle.logp((10, 20, 30, 40, 50))[list(ids)])


def test_many_prompts_come_back_in_prompt_order(stub):
    url, state = stub
    backend = connect(url)
    prefix = backend.prefill([1, 2, 3, 4])
    rows = [(5 + k, 7 * k % VOCAB, 11) for k in range(40)]
    queries = [Query(r, p, (0, 9, 99)) for r in range(len(rows)) for p in (0, 2)]
    got = backend.score(prefix, rows, queries).values
    for query, values in zip(queries, got):
        context = prefix.ids + rows[query.row][: query.position + 1]
        np.testing.assert_array_equal(values, state.oracle.logp(context)[[0, 9, 99]])


def test_the_first_read_after_a_new_prefix_warms_the_cache_alone(stub):
    url, state = stub
    backend = connect(url)
    state.completions.clear()
    prefix = backend.prefill([3, 1, 4, 1, 5])
    rows = [(k, 9) for k in range(6)]
    backend.score(prefix, rows, [Query(r, 1, (2, 6)) for r in range(6)])
    backend.score(prefix, rows, [Query(r, 0, (2, 6)) for r in range(6)])
    assert [len(body["prompt"]) for body in state.completions] == [1, 5, 6]
    assert all(body["prompt"][0][:5] == [3, 1, 4, 1, 5] for body in state.completions)


def test_a_read_after_the_prefix_itself_joins_the_rows_request(stub):
    url, state = stub
    backend = connect(url)
    prefix = backend.prefill([8, 6, 7])
    got = backend.score(prefix, [(5, 3)], [Query(0, -1, (1, 2)), Query(0, 1, (1, 2))]).values
    assert backend.forward_passes == 2  # the warm-up and the rest, not a vocabulary's worth
    np.testing.assert_array_equal(got[0], state.oracle.logp((8, 6, 7))[[1, 2]])
    np.testing.assert_array_equal(got[1], state.oracle.logp((8, 6, 7, 5, 3))[[1, 2]])


def test_every_request_carries_logprobs_and_token_id_keys(stub):
    url, state = stub
    backend = connect(url)
    state.completions.clear()
    backend.score(backend.prefill([1, 2]), [(3,), (4,)], [Query(0, 0, (5,)), Query(1, 0, (6,))])
    assert len(state.completions) == 2
    for body in state.completions:
        assert body["logprobs"] == 1 and body["max_tokens"] == 1 and body["return_tokens_as_token_ids"] is True


def test_the_stub_refuses_ids_without_logprobs_with_400(stub):
    url, _ = stub
    body = {"model": "stub", "prompt": [[1, 2]], "max_tokens": 1, "logprob_token_ids": [3]}
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 400
    assert "logprobs" in response.json()["error"]["message"]


def test_more_than_128_ids_in_one_request_is_a_backend_error_naming_the_server(stub):
    url, _ = stub
    backend = connect(url, max_ids_per_request=200)
    with pytest.raises(BackendError, match=r"HTTP 400: logprob_token_ids must have at most 128"):
        backend.score(backend.prefill([1, 2]), [(3,)], [Query(0, 0, tuple(range(150)))])


def test_busy_answers_are_retried_until_the_server_serves(stub):
    url, state = stub
    backend = connect(url)
    state.fail_next = [429, 503, 503]
    got = backend.score(backend.prefill([1, 2]), [(3,)], [Query(0, 0, (4, 5))]).values[0]
    np.testing.assert_array_equal(got, state.oracle.logp((1, 2, 3))[[4, 5]])
    assert state.fail_next == []


def test_a_server_that_stays_busy_fails_the_whole_call(stub):
    url, state = stub
    backend = connect(url, max_retries=2)
    state.fail_next = [503] * 3
    with pytest.raises(BackendError, match="after 3 tries"):
        backend.score(backend.prefill([1, 2]), [(3,), (4,)], [Query(0, 0, (4,)), Query(1, 0, (4,))])


def test_an_unreachable_server_is_a_backend_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(BackendError, match=f"127.0.0.1:{port} did not answer GET /v1/models after 2 tries"):
        connect(f"http://127.0.0.1:{port}", max_retries=1)


# -- start-up checks --------------------------------------------------------------------------
def test_processed_logprobs_are_refused_at_start_up(stub):
    url, state = stub
    state.mode = "processed_logprobs"
    with pytest.raises(BackendError, match="processed log-probs"):
        connect(url)


def test_logits_instead_of_logprobs_are_refused_at_start_up(stub):
    url, state = stub
    state.mode = "raw_logits"
    with pytest.raises(BackendError, match="logits, not log-probs"):
        connect(url)


def test_a_different_tokenizer_is_refused_naming_both_sides(stub):
    url, state = stub
    state.tokenize_shift = 1
    with pytest.raises(BackendError, match=r"'stub' tokenizes differently from the local tokenizer '_ByteVocabulary'"):
        connect(url)


def test_the_start_up_checks_are_not_counted_as_the_callers_passes(stub):
    url, _ = stub
    assert connect(url).forward_passes == 0


def test_prefix_cache_counters_are_summed_over_engines(stub):
    url, _ = stub
    assert connect(url).cache_counters() == {"hits": 128.0, "queries": 200.0}


# -- the contract and the decisions -----------------------------------------------------------
def test_the_backend_contract_holds(stub):
    url, _ = stub
    check_backend(connect(url), [5, 17, 33, 2, 41, 9], [(11, 12, 13), (14, 15)], atol=0)


def test_hidden_states_are_refused_by_type_before_any_request(stub):
    url, _ = stub
    backend = connect(url)
    prefix = backend.prefill([5, 17, 33])
    before = backend.forward_passes
    with pytest.raises(HiddenStatesUnavailableError, match="sends no hidden states"):
        backend.score(prefix, [(11, 12)], [Query(0, 1, (0,))], hidden=True)
    assert backend.forward_passes == before


@pytest.mark.parametrize("case", schema_cases())
def test_fills_equal_the_local_oracle_engine_exactly(stub, case):
    url, _ = stub
    data = load_case(case)
    local = Engine(OracleBackend(VOCAB, context_length=CONTEXT - 1), ByteTokenizer(), "oracle")
    remote = Engine(connect(url), ByteTokenizer(), "stub")
    want, got = local.fill(data["json_schema"], data["input"]), remote.fill(data["json_schema"], data["input"])
    assert got.values == want.values
    for name, expected in want.fields.items():
        assert got.fields[name].probabilities == expected.probabilities, name
        assert got.fields[name].candidate_mass == expected.candidate_mass, name


def test_decisions_equal_the_local_oracle_engine_exactly(stub):
    url, _ = stub
    data = json.loads((DATA_DIR / "refund_request_questions.json").read_text())
    local = Engine(OracleBackend(VOCAB, context_length=CONTEXT - 1), ByteTokenizer(), "oracle")
    remote = Engine(connect(url), ByteTokenizer(), "stub")
    want = local.decide(data["state"], data["questions"]).answers
    got = remote.decide(data["state"], data["questions"]).answers
    assert {k: v.model_dump() for k, v in got.items()} == {k: v.model_dump() for k, v in want.items()}


def test_threads_sharing_one_backend_get_the_sequential_answers(stub):
    url, state = stub
    backend = connect(url)
    prefix = backend.prefill([2, 7, 1, 8])
    jobs = [[(k, j) for j in range(5)] for k in range(8)]

    def read(rows: list[tuple[int, int]]) -> list[np.ndarray]:
        return backend.score(prefix, rows, [Query(r, 1, (3, 4)) for r in range(len(rows))]).values

    sequential = [read(rows) for rows in jobs]
    results: dict[int, list[np.ndarray]] = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, read(jobs[k]))) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for k, want in enumerate(sequential):
        for have, expected in zip(results[k], want):
            np.testing.assert_array_equal(have, expected)


# -- wiring -----------------------------------------------------------------------------------
def test_engine_load_reaches_the_server_and_refuses_its_other_tokenizer(stub):
    url, _ = stub
    with pytest.raises(BackendError, match=r"'stub' tokenizes differently from the local tokenizer '.*SmolLM2"):
        Engine.load("smollm2-135m", backend="vllm", base_url=url)


def test_the_vllm_backend_needs_a_base_url_in_every_entry_point(capsys):
    from mcp_server.__main__ import parse_args
    from pcd_core.errors import PcdError
    from pcd_integrations.commands.main import main

    with pytest.raises(PcdError, match="base_url"):
        Engine.load("smollm2-135m", backend="vllm")
    assert main(["fill", "--schema", str(DATA_DIR / "support_ticket.json"), "--backend", "vllm"]) == 2
    assert "backend 'vllm' needs base_url (--base-url)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--backend", "vllm"])
    assert exit_info.value.code == 2
    assert "backend 'vllm' needs base_url (--base-url)" in capsys.readouterr().err


def test_a_model_server_that_stays_busy_is_a_502_on_every_route_never_a_500(stub):
    from pcd_integrations.http import create_app

    url, state = stub
    remote = Engine(connect(url, max_retries=1), ByteTokenizer(), "stub")
    app = create_app(remote)
    question = {"q": {"type": "noul", "instructions": "Is it urgent?"}}

    async def send() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            state.fail_next = [503, 503]  # both tries of the first read
            system_one = await client.post("/v1/systemone", json={"state": "The site is down.", "questions": question})
            state.fail_next = [503, 503]
            decisions = await client.post(
                "/v1/decisions",
                json={
                    "model": "stub",
                    "input": "The site is down.",
                    "questions": [{"type": "predicate", "instructions": "Is it urgent?"}],
                },
            )
            return [system_one, decisions]

    system_one, decisions = asyncio.run(send())
    assert system_one.status_code == 502, system_one.text
    assert system_one.json()["detail"]["error_type"] == "upstream_error"
    assert "did not answer" in system_one.json()["detail"]["message"]
    assert decisions.status_code == 502, decisions.text
    assert decisions.json()["error"]["type"] == "server_error"  # OpenAI's type for a 5xx
    assert decisions.json()["error"]["code"] == "upstream_error"
