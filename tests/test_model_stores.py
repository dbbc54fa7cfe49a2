"""Ollama's and LM Studio's stores, built in the layouts those tools write around the embedded GGUF.

The Ollama store has a manifest under ``manifests/registry.ollama.ai/library/<model>/<tag>`` whose
model layer names ``blobs/sha256-<hex>`` (the GGUF's real digest; the blob is a hard link, or a
symbolic link across file systems, so nothing is copied), and a config blob as ``ollama pull`` writes
one. The LM Studio folder is ``<models>/<publisher>/<model>/<file>.gguf``, found through the home
pointer file and ``settings.json`` as LM Studio finds it. A model loaded through either store must
answer exactly as the embedded alias does on the same backend.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from pcd_core import Engine, ModelNotFoundError, PcdError
from pcd_core.loading.model_files import EMBEDDED, resolve
from pcd_core.loading.model_stores import (
    lmstudio_models,
    lmstudio_models_dir,
    ollama_models,
    ollama_parts,
    resolve_lmstudio,
    resolve_ollama,
)

SCHEMA = {
    "type": "object",
    "properties": {"wants_refund": {"type": "boolean"}, "topic": {"enum": ["billing", "shipping", "other"]}},
}
TEXT = "I was charged twice for my order. Please give me my money back."


def link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system: a symbolic link reads the same
        target.symlink_to(source)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture(scope="module")
def gguf() -> Path:
    return EMBEDDED["smollm2-135m"].locate()


@pytest.fixture(scope="module")
def ollama_store(tmp_path_factory, gguf) -> Path:
    """An Ollama store holding ``smollm2:135m`` and ``me/tuned`` (tag latest) as ``ollama pull`` lays it out."""
    root = tmp_path_factory.mktemp("ollama") / "models"
    weights = sha256(gguf)
    link(gguf, root / "blobs" / f"sha256-{weights}")
    config = json.dumps({"model_format": "gguf", "model_family": "llama", "file_type": "Q4_1"}).encode()
    config_digest = hashlib.sha256(config).hexdigest()
    (root / "blobs" / f"sha256-{config_digest}").write_bytes(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "digest": f"sha256:{config_digest}",
            "size": len(config),
        },
        "layers": [
            {
                "mediaType": "application/vnd.ollama.image.model",
                "digest": f"sha256:{weights}",
                "size": gguf.stat().st_size,
            }
        ],
    }
    for relative in ("registry.ollama.ai/library/smollm2/135m", "registry.ollama.ai/me/tuned/latest"):
        path = root / "manifests" / relative
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(manifest))
    # a model stored one tensor per layer (no GGUF): listed, refused with the reason
    tensors = root / "manifests/registry.ollama.ai/library/safetensors-only/latest"
    tensors.parent.mkdir(parents=True)
    tensors.write_text(json.dumps({**manifest, "layers": [{"mediaType": "application/vnd.ollama.image.tensor"}]}))
    return root


@pytest.fixture
def lmstudio_home(tmp_path, monkeypatch, gguf) -> Path:
    """A home whose pointer file names an LM Studio home, whose settings.json moves the models folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    home = tmp_path / "elsewhere" / "lmstudio"
    models = tmp_path / "big-disk" / "models"
    home.mkdir(parents=True)
    (tmp_path / ".lmstudio-home-pointer").write_text(f"{home}\n")
    (home / "settings.json").write_text(json.dumps({"downloadsFolder": str(models)}))
    link(gguf, models / "HuggingFaceTB" / "SmolLM2-135M-Instruct-GGUF" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    return models


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("qwen2.5:1.5b", ("registry.ollama.ai", "library", "qwen2.5", "1.5b")),
        ("llama3.2", ("registry.ollama.ai", "library", "llama3.2", "latest")),
        ("user/model", ("registry.ollama.ai", "user", "model", "latest")),
        ("hf.co/org/Repo-GGUF:Q4_K_M", ("hf.co", "org", "Repo-GGUF", "Q4_K_M")),
        ("localhost:5000/ns/m:v1", ("localhost:5000", "ns", "m", "v1")),
    ],
)
def test_ollama_names_complete_as_ollama_completes_them(name, parts):
    assert ollama_parts(name) == parts


def test_an_ollama_name_resolves_to_the_blob_its_manifest_names(ollama_store, gguf, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", f' "{ollama_store}" ')  # Ollama trims spaces and quotes too
    blob = resolve_ollama("smollm2:135m")
    assert blob.parent == ollama_store / "blobs" and blob.name == f"sha256-{sha256(gguf)}"
    assert resolve("ollama:SmolLM2:135M").gguf == blob  # names compare case-insensitively
    assert resolve("ollama:me/tuned").gguf == blob


def test_an_ollama_name_not_there_lists_what_is(ollama_store, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama_store))
    with pytest.raises(ModelNotFoundError) as caught:
        resolve("ollama:qwen2.5:1.5b")
    message = str(caught.value)
    assert "'qwen2.5:1.5b'" in message and str(ollama_store) in message
    assert "ollama:smollm2:135m" in message and "ollama:me/tuned:latest" in message


def test_an_ollama_model_without_a_gguf_is_refused_with_the_reason(ollama_store, monkeypatch):
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama_store))
    with pytest.raises(PcdError, match=r"no GGUF weights \(tensors"):
        resolve("ollama:safetensors-only")
    listed = {m.name: m for m in ollama_models()}
    assert listed["ollama:safetensors-only:latest"].format == "tensors"
    assert listed["ollama:smollm2:135m"].format == "gguf" and listed["ollama:smollm2:135m"].size_bytes > 10**7


def test_the_default_ollama_store_is_under_home(tmp_path, monkeypatch):
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match=str(tmp_path / ".ollama" / "models")):
        resolve_ollama("llama3.2")


def test_lmstudio_finds_its_folder_through_the_pointer_and_settings(lmstudio_home, gguf):
    assert lmstudio_models_dir() == lmstudio_home
    found = resolve_lmstudio("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF")
    assert found.name == gguf.name and found.parent.parent.parent == lmstudio_home
    [listed] = lmstudio_models()
    assert listed.name == "lmstudio:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF" and listed.format == "gguf"


def test_lmstudio_without_pointer_or_settings_uses_dot_lmstudio(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert lmstudio_models_dir() == tmp_path / ".lmstudio" / "models"
    (tmp_path / ".cache" / "lm-studio").mkdir(parents=True)  # the older home wins where it exists
    assert lmstudio_models_dir() == tmp_path / ".cache" / "lm-studio" / "models"


def test_an_lmstudio_folder_given_as_an_option_wins(lmstudio_home, tmp_path, gguf):
    other = tmp_path / "other"
    link(gguf, other / "me" / "small" / "a-Q4_1.gguf")
    link(gguf, other / "me" / "small" / "a-Q8_0.gguf")
    with pytest.raises(ModelNotFoundError, match=r"has 2 GGUF files; name one: lmstudio:me/small/a-Q4_1.gguf"):
        resolve("lmstudio:me/small", lmstudio_dir=str(other))
    assert resolve("lmstudio:me/small/a-Q8_0.gguf", lmstudio_dir=str(other)).gguf == other / "me/small/a-Q8_0.gguf"
    with pytest.raises(ModelNotFoundError) as caught:
        resolve("lmstudio:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", lmstudio_dir=str(other))
    assert "lmstudio:me/small/a-Q4_1.gguf" in str(caught.value) and str(other) in str(caught.value)


@pytest.mark.slow
def test_models_from_both_stores_answer_as_the_embedded_alias_does(ollama_store, lmstudio_home, monkeypatch):
    pytest.importorskip("llama_cpp", reason="the stores hold GGUFs, read by the llamacpp extra")
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama_store))
    expected = Engine.load("smollm2-135m", backend="llamacpp").fill(SCHEMA, TEXT)
    for name in ("ollama:smollm2:135m", "lmstudio:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"):
        engine = Engine.load(name, backend="llamacpp")
        assert engine.model_name == name
        got = engine.fill(SCHEMA, TEXT)
        assert got.value == expected.value
        for field, result in got.fields.items():  # the chat template came from the GGUF: same prompt, same reads
            assert result.probability == pytest.approx(expected.fields[field].probability, abs=1e-6)
