"""Model resolution with downloads off never touches the network, and never the caller's environment.

With ``HF_HUB_OFFLINE=1`` (as ``conftest.py`` sets it) a Hugging Face id resolves only from the local
cache; one that is not cached is a ``PcdError`` that says how to get it, raised before anything loads
(the download itself is ``tests/test_hub.py``'s). Loading leaves ``HF_HUB_OFFLINE`` unset: the environment is
the application's. The cached-id test builds a real HF cache layout around the embedded model's weights
and loads it in a fresh process, whose environment no test fixture has touched.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pcd_core import Engine, OptionError, PcdError
from pcd_core.loading import model_files
from pcd_core.loading.model_files import EMBEDDED, converted_dir, resolve

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, os, socket, sys
before = dict(os.environ)
attempts = []
def refuse(self, address):  # any connection attempt is recorded and refused
    attempts.append(repr(address))
    raise OSError("network refused by the test")
socket.socket.connect = refuse
from pcd_core import Engine
engine = Engine.load(sys.argv[1])
result = engine.fill(json.loads(sys.argv[2]), sys.argv[3])
print(json.dumps({
    "hf_hub_offline": os.environ.get("HF_HUB_OFFLINE"),
    "environment_changes": sorted(k for k in before.keys() | os.environ.keys() if before.get(k) != os.environ.get(k)),
    "attempts": attempts,
    "model": engine.model_name,
    "probabilities": {name: f.probability for name, f in result.fields.items()},
}))
"""

SCHEMA = {
    "type": "object",
    "properties": {
        "wants_refund": {"type": "boolean"},
        "topic": {"enum": ["billing", "shipping", "other"]},
    },
}
TEXT = "I was charged twice for my order. Please give me my money back."


@pytest.fixture
def no_network(monkeypatch):
    def refuse(self, address):
        raise AssertionError(f"a network connection was attempted: {address!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_an_uncached_hf_id_fails_fast_with_a_hint(no_network):
    started = time.perf_counter()
    with pytest.raises(PcdError) as caught:
        resolve("pcd-tests/surely-not-cached")
    assert time.perf_counter() - started < 2.0
    message = str(caught.value)
    assert "not in the local Hugging Face cache" in message
    assert "hf download pcd-tests/surely-not-cached" in message and "local model folder" in message


def test_a_name_that_is_nothing_is_a_pcd_error(no_network):
    with pytest.raises(PcdError, match="not an embedded alias"):
        resolve("./no/such/folder")


def test_a_local_folder_resolves_to_itself(tmp_path):
    assert resolve(str(tmp_path)).pretrained == str(tmp_path)


def hf_cache_with(repo_id: str, weights: Path, root: Path) -> Path:
    """The layout ``huggingface_hub`` writes: refs/main names a snapshot whose files link to blobs."""
    commit = "0" * 40
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in weights.iterdir():
        (snapshot / file.name).symlink_to(file)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return root


@pytest.mark.slow
def test_a_cached_hf_id_loads_offline_without_touching_the_environment(engine, tmp_path):
    weights = converted_dir(EMBEDDED["smollm2-135m"].locate())
    assert (weights / "config.json").is_file(), "the embedded model has been converted by the engine fixture"
    cache = hf_cache_with("pcd-tests/smollm2-135m", weights, tmp_path / "hub")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env |= {"HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", CHILD, "pcd-tests/smollm2-135m", json.dumps(SCHEMA), TEXT]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    child = json.loads(done.stdout.splitlines()[-1])
    assert child["hf_hub_offline"] is None
    assert child["environment_changes"] == []  # loading and filling set no variable of the user's process
    assert child["attempts"] == []
    assert child["model"] == "pcd-tests/smollm2-135m"
    expected = {name: f.probability for name, f in engine.fill(SCHEMA, TEXT).fields.items()}
    assert child["probabilities"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(
    ("backend", "dtype", "says"),
    [
        ("torch", "float8", "dtype must be one of float32, float16, bfloat16"),
        ("vllm", "bfloat16", "vllm serve --dtype"),
        ("mlx", "float16", "MLX backend sets its own compute dtype"),
    ],
)
def test_a_dtype_that_would_not_be_used_is_refused_before_anything_loads(backend, dtype, says, monkeypatch):
    monkeypatch.setattr(model_files, "resolve", lambda name: pytest.fail("resolved a model after a bad dtype"))
    with pytest.raises(OptionError, match=says):
        Engine.load("smollm2-135m", backend=backend, dtype=dtype, base_url="http://127.0.0.1:9")


def test_a_typo_of_an_alias_asks_did_you_mean(no_network):
    with pytest.raises(PcdError, match=r"did you mean 'smollm2-135m'\?") as caught:
        resolve("smollm2-135")
    assert "hf download" not in str(caught.value)  # not a hub download for a misspelt alias
    with pytest.raises(PcdError, match="did you mean 'qwen2.5-coder-0.5b'"):
        resolve("qwen2.5-coder-0.5")


def test_a_warm_load_prints_no_library_bars_and_leaves_them_on(engine, capfd):
    """transformers printed "Loading weights" bars on every load; its bars are the caller's again after."""
    from transformers.utils import logging as transformers_logging

    capfd.readouterr()
    Engine.load("smollm2-135m")
    loading = capfd.readouterr().err
    assert "Loading weights" not in loading and "it/s" not in loading
    for _ in transformers_logging.tqdm(range(2), desc="the caller's own bar"):
        pass
    assert "the caller's own bar" in capfd.readouterr().err
