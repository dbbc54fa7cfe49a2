"""Hugging Face Hub models on first use: read from the standard HF cache, downloaded into it when absent.

A Hub id (``Qwen/Qwen2.5-0.5B-Instruct``) resolves to its snapshot folder in the cache; when the cache
lacks it (or holds only part of it, after an interrupted download) ``huggingface_hub`` downloads only
the files a backend reads, config, tokenizer and safetensors weights at the repository's top level,
with its progress bar on stderr. ``ORG/REPO:FILE.gguf`` names one GGUF file of a repository, and only
that file is fetched. ``revision`` (a branch, a tag or a commit) pins what is read. Nothing is
downloaded when the load option ``offline`` is set (``--offline``) or ``HF_HUB_OFFLINE`` is: the
refusal, an ``OfflineError``, says what is missing. The embedded models never come here
(``model_files.resolve`` answers them first).

``HF_ENDPOINT``, ``HF_HUB_CACHE`` (or ``HF_HOME``) and ``HF_HUB_OFFLINE`` are read at each load, not
once when ``huggingface_hub`` is imported, so that an application that sets them after that import
is still obeyed. The process environment is never written. ``tests/test_hub.py`` serves the embedded
model's files from a loopback server in the Hub's API shape and checks the download, its progress,
the cache layout, the second load that sends no request, a download cut halfway, and the refusals.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from pcd_core.errors import BackendUnavailableError, ModelNotFoundError, OfflineError, PcdError

logger = logging.getLogger(__name__)

#: what a model folder needs (``from_pretrained``): config, every tokenizer file a tokenizer class
#: may read, the chat template, and safetensors weights (sharded ones with their index). Only the
#: repository's top level: subfolders hold other formats (onnx/, original/ checkpoints, gguf/)
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
)
IGNORE_PATTERNS = ("*/*",)

TRUE = {"1", "on", "yes", "true"}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in TRUE


def is_offline(offline: bool = False) -> bool:
    """Whether downloading is off: the load option, or ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``
    as the environment says now or said when ``huggingface_hub`` was imported.
    """
    if offline or _env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE"):
        return True
    if "HF_HUB_OFFLINE" in os.environ:  # set now to a false value: that wins over the import-time one
        return False
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> Path:
    """The standard HF cache: ``HF_HUB_CACHE`` (or its legacy name), else ``$HF_HOME/hub``, else the
    one ``huggingface_hub`` computed at import (``~/.cache/huggingface/hub``).
    """
    given = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if given:
        return Path(given).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _endpoint() -> str | None:
    given = os.environ.get("HF_ENDPOINT")
    return given.rstrip("/") if given else None


def split_gguf(model: str) -> tuple[str, str | None]:
    """``ORG/REPO:FILE.gguf`` as (repo id, file); any other name as (name, None). A repo id never
    holds a colon, so the form is unambiguous.
    """
    repo, colon, file = model.partition(":")
    if colon and file.endswith(".gguf") and "/" in repo:
        return repo, file
    return model, None


def missing_parts(folder: Path) -> list[str]:
    """What a snapshot folder lacks for a model load: config, a tokenizer, the weights (each shard
    its index lists). An empty list means the folder loads as it is.
    """
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        missing.append("a tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        import json

        shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        missing += [shard for shard in shards if not (folder / shard).is_file()]
    elif not list(folder.glob("*.safetensors")):
        missing.append("the weights (*.safetensors)")
    return missing


def _snapshot_folder(repo_id: str, revision: str | None, cache: Path) -> Path | None:
    """The cached snapshot folder ``revision`` points at, read from the cache's own layout, or None."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    wanted = revision or "main"
    ref = repo / "refs" / wanted
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else wanted
    folder = repo / "snapshots" / commit
    return folder if folder.is_dir() else None


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError as error:
        raise BackendUnavailableError("torch", "huggingface_hub") from error
    return huggingface_hub


def fetch_model(repo_id: str, *, revision: str | None = None, offline: bool = False) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision``, downloaded first where the cache lacks
    part of it and downloading is allowed.
    """
    hub = _hub()
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    cache = hub_cache_dir()
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PcdError(
            f"model {repo_id!r} is not an embedded alias, ollama:NAME, lmstudio:PUBLISHER/NAME, a .gguf file, "
            "a local folder or a Hugging Face id"
        ) from error
    folder = _snapshot_folder(repo_id, revision, cache)
    missing = missing_parts(folder) if folder is not None else None
    if folder is not None and not missing:
        return folder
    at = f" at revision {revision!r}" if revision else ""
    if is_offline(offline):
        lacks = f"its snapshot {folder.name} lacks {', '.join(missing)}" if folder and missing else "no snapshot"
        raise OfflineError(
            f"model {repo_id!r}{at} is not in the local Hugging Face cache ({cache}: {lacks}), and downloading "
            f"is off (offline=True, --offline or HF_HUB_OFFLINE=1): run `hf download {repo_id}` where the hub "
            "is reachable (and copy its cache folder here), load without offline, or pass a local model folder"
        )
    logger.info("downloading %s%s into %s", repo_id, at, cache)
    try:
        path = hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            endpoint=_endpoint(),
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
        )
    except Exception as error:
        raise _download_error(repo_id, at, error) from error
    lacking = missing_parts(Path(path))
    if lacking:
        raise ModelNotFoundError(
            f"model {repo_id!r}{at} was downloaded but lacks {', '.join(lacking)}: pcd-engine reads config, "
            "tokenizer and safetensors weights, or one GGUF file named as ORG/REPO:FILE.gguf"
        )
    return Path(path)


def fetch_gguf(repo_id: str, filename: str, *, revision: str | None = None, offline: bool = False) -> Path:
    """One GGUF file of a Hub repository, from the cache or downloaded into it."""
    hub = _hub()
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return Path(hub.hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    at = f" at revision {revision!r}" if revision else ""
    if is_offline(offline):
        raise OfflineError(
            f"{filename} of {repo_id!r}{at} is not in the local Hugging Face cache ({cache}), and downloading is "
            f"off (offline=True, --offline or HF_HUB_OFFLINE=1): run `hf download {repo_id} {filename}` where "
            "the hub is reachable, or load without offline"
        )
    logger.info("downloading %s from %s%s into %s", filename, repo_id, at, cache)
    try:
        return Path(hub.hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache, endpoint=_endpoint()))
    except Exception as error:
        raise _download_error(f"{repo_id}:{filename}", at, error) from error


def _download_error(name: str, at: str, error: Exception) -> PcdError:
    """A download failure as one of ours: a name or revision the hub does not have is a
    ``ModelNotFoundError``; a network or disk failure a ``PcdError`` that says a retry resumes it.
    """
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(error, RepositoryNotFoundError | RevisionNotFoundError | EntryNotFoundError):
        return ModelNotFoundError(f"the hub has no {name!r}{at} ({type(error).__name__}); check the name")
    return PcdError(
        f"downloading {name!r}{at} failed ({type(error).__name__}: {error}); what was downloaded stays in the "
        "cache, and loading again resumes it"
    )
