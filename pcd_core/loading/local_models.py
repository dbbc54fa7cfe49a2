"""The models on this machine, wherever they are kept, with what ``backend="auto"`` would run them on.

``pcd models`` prints this list: the embedded aliases (installed or not), the Hugging Face cache's
model repositories (``HF_HUB_CACHE``; safetensors snapshots, and each GGUF file as
``ORG/REPO:FILE.gguf``), Ollama's store and LM Studio's folder (``model_stores.py``). Each row has the
name ``Engine.load`` takes, the weights' size and format, and the backend and dtype ``auto.py``'s
rule picks for it on this machine. Nothing is loaded, downloaded or written to list them.
``tests/test_auto.py`` checks the rows against stores built in a temporary folder.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pcd_core.errors import PcdError
from pcd_core.loading import auto, hub, model_stores
from pcd_core.loading.model_files import EMBEDDED
from pcd_core.loading.options import LoadOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalModel:
    """One row of ``pcd models``."""

    name: str  # as Engine.load takes it
    store: str  # "embedded", "hf", "ollama" or "lmstudio"
    size_bytes: int  # 0 where the weights are not on disk (an embedded package not installed)
    format: str  # "gguf", "safetensors", or why it cannot load ("not installed", "tensors")
    backend: str  # what backend="auto" picks; "" where it cannot load
    dtype: str  # torch's dtype under dtype="auto"; "" for llama.cpp, which reads the file's own types
    note: str = ""


def _row(name: str, store: str, model_format: str, size: int, machine: auto.Machine) -> LocalModel:
    if model_format not in ("gguf", "safetensors"):
        return LocalModel(name, store, size, model_format, "", "")
    choice = auto.choose(LoadOptions(), "gguf" if model_format == "gguf" else "safetensors", size, machine)
    return LocalModel(name, store, size, model_format, choice.backend, choice.dtype or "", choice.reason)


def _embedded(machine: auto.Machine) -> list[LocalModel]:
    rows = []
    for alias, spec in EMBEDDED.items():
        try:
            path = spec.locate()
        except PcdError:
            rows.append(LocalModel(alias, "embedded", 0, "not installed", "", "", spec.install_command))
            continue
        rows.append(_row(alias, "embedded", "gguf", path.stat().st_size, machine))
    return rows


def _hf_cache(machine: auto.Machine) -> list[LocalModel]:
    """Each model repository's newest snapshot in the HF cache: its safetensors, and each GGUF file."""
    rows = []
    cache = hub.hub_cache_dir()
    for repo in sorted(cache.glob("models--*")):
        repo_id = repo.name.removeprefix("models--").replace("--", "/")
        snapshots = sorted((p for p in (repo / "snapshots").glob("*") if p.is_dir()), key=lambda p: p.stat().st_mtime)
        if not snapshots:
            continue
        snapshot = snapshots[-1]
        for gguf in sorted(snapshot.glob("*.gguf")):
            rows.append(_row(f"{repo_id}:{gguf.name}", "hf", "gguf", gguf.stat().st_size, machine))
        weights = list(snapshot.glob("*.safetensors"))
        if weights:
            size = sum(p.stat().st_size for p in weights)
            missing = hub.missing_parts(snapshot)
            row = _row(repo_id, "hf", "safetensors", size, machine)
            rows.append(
                row if not missing else LocalModel(repo_id, "hf", size, "incomplete", "", "", ", ".join(missing))
            )
    return rows


def _stores(machine: auto.Machine, lmstudio_dir: str | None) -> list[LocalModel]:
    rows = []
    for store, found in (
        ("ollama", model_stores.ollama_models()),
        ("lmstudio", model_stores.lmstudio_models(lmstudio_dir)),
    ):
        for model in found:
            rows.append(_row(model.name, store, model.format, model.size_bytes, machine))
    return rows


def local_models(lmstudio_dir: str | None = None, machine: auto.Machine | None = None) -> list[LocalModel]:
    """Every model found: embedded, HF cache, Ollama, LM Studio, in that order."""
    machine = machine or auto.this_machine()
    return [*_embedded(machine), *_hf_cache(machine), *_stores(machine, lmstudio_dir)]
