"""The model stores other local tools keep: Ollama's and LM Studio's, read in place, never copied.

``ollama:NAME[:TAG]`` resolves as Ollama itself does: the store's root is ``$OLLAMA_MODELS``, else
``~/.ollama/models``; the name is completed with Ollama's defaults (host ``registry.ollama.ai``,
namespace ``library``, tag ``latest``) into ``manifests/<host>/<namespace>/<model>/<tag>``, and the
manifest's ``application/vnd.ollama.image.model`` layer names the weights blob,
``blobs/sha256-<hex>``: a GGUF that the llama.cpp backend reads as it is (its chat template is in
the GGUF's metadata). ``lmstudio:PUBLISHER/NAME`` resolves in LM Studio's models folder, found the
way LM Studio finds it (its home from ``~/.lmstudio-home-pointer``, else ``~/.cache/lm-studio``, else
``~/.lmstudio``; then ``settings.json``'s ``downloadsFolder``, else ``<home>/models``); LM Studio
reads no environment variable, so another folder is the ``lmstudio_dir`` load option.

The invariant: a name resolves to a file that starts with the GGUF magic, or raises
``ModelNotFoundError`` with the names the store does hold. ``tests/test_model_stores.py`` builds
both stores around the embedded GGUF, in the layouts those tools write, and loads through them.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pcd_core.errors import ModelNotFoundError, PcdError

logger = logging.getLogger(__name__)

OLLAMA_PREFIX = "ollama:"
LMSTUDIO_PREFIX = "lmstudio:"

OLLAMA_HOST = "registry.ollama.ai"
OLLAMA_NAMESPACE = "library"
OLLAMA_TAG = "latest"
#: the manifest layer that holds the weights; a model stored as one layer per tensor has none
OLLAMA_WEIGHTS = "application/vnd.ollama.image.model"
GGUF_MAGIC = b"GGUF"

StoreName = Literal["ollama", "lmstudio"]


@dataclass(frozen=True)
class StoredModel:
    """One model a store holds: the name to load it by, its weights file, and their size."""

    name: str  # with its prefix, as ``Engine.load`` takes it: ``ollama:qwen2.5:1.5b``
    path: Path
    size_bytes: int
    format: str  # "gguf", or what else the store says it is ("tensors": Ollama's safetensors-style models)


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _not_found(what: str, where: Path, held: list[StoredModel], hint: str) -> ModelNotFoundError:
    names = ", ".join(m.name for m in held) if held else "none"
    return ModelNotFoundError(f"{what} is not in {where} ({hint}); the models there: {names}")


# -- Ollama ------------------------------------------------------------------------------------------
def ollama_root() -> Path:
    """Ollama's store: ``$OLLAMA_MODELS`` (trimmed of spaces and quotes, as Ollama trims it), else
    ``~/.ollama/models``. A Linux service install keeps its store under the ``ollama`` user's home
    (``/usr/share/ollama/.ollama/models``): set ``OLLAMA_MODELS`` to read that one.
    """
    given = os.environ.get("OLLAMA_MODELS", "").strip().strip("\"'")
    return Path(given).expanduser() if given else Path.home() / ".ollama" / "models"


def ollama_parts(name: str) -> tuple[str, str, str, str]:
    """``name`` as Ollama parses it: the tag after the last ``:`` that follows the last ``/``; then
    model, namespace and host cut at ``/`` from the right, each defaulted when absent.
    """
    tag = OLLAMA_TAG
    colon, slash = name.rfind(":"), name.rfind("/")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    name = re.sub(r"^[a-z]+://", "", name)
    parts = name.split("/")
    if not name or len(parts) > 3 or not all(parts) or not tag:
        raise PcdError(f"{OLLAMA_PREFIX}{name}:{tag} is not an Ollama model name (NAME[:TAG], e.g. qwen2.5:1.5b)")
    model = parts[-1]
    namespace = parts[-2] if len(parts) > 1 else OLLAMA_NAMESPACE
    host = parts[-3] if len(parts) > 2 else OLLAMA_HOST
    return host, namespace, model, tag


def _ollama_short(host: str, namespace: str, model: str, tag: str) -> str:
    """The shortest name Ollama shows: default host and namespace left out, the tag always kept."""
    if host == OLLAMA_HOST and namespace == OLLAMA_NAMESPACE:
        return f"{model}:{tag}"
    if host == OLLAMA_HOST:
        return f"{namespace}/{model}:{tag}"
    return f"{host}/{namespace}/{model}:{tag}"


def _ollama_weights(manifest: Path, root: Path) -> tuple[Path | None, str]:
    """The weights blob a manifest names, and its format ("gguf", or why there is no GGUF)."""
    try:
        layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers") or []
    except (OSError, ValueError, AttributeError) as error:
        return None, f"unreadable manifest ({error})"
    weights = [layer for layer in layers if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_WEIGHTS]
    if not weights:
        return None, "tensors"  # one layer per tensor: a safetensors-style model, not one GGUF
    digest = str(weights[0].get("digest", ""))
    if not re.fullmatch(r"sha256[:-][0-9a-fA-F]{64}", digest):
        return None, f"bad digest {digest!r}"
    blob = root / "blobs" / digest.replace(":", "-")
    return blob, "gguf" if is_gguf(blob) else "not gguf"


def ollama_models(root: Path | None = None) -> list[StoredModel]:
    """Every model in Ollama's store (manifests exactly four folders deep, as Ollama globs them)."""
    root = root or ollama_root()
    found = []
    for manifest in sorted((root / "manifests").glob("*/*/*/*")):
        if not manifest.is_file():
            continue
        host, namespace, model, tag = manifest.relative_to(root / "manifests").parts
        blob, form = _ollama_weights(manifest, root)
        size = blob.stat().st_size if blob is not None and blob.is_file() else 0
        found.append(
            StoredModel(OLLAMA_PREFIX + _ollama_short(host, namespace, model, tag), blob or manifest, size, form)
        )
    return found


def resolve_ollama(name: str, root: Path | None = None) -> Path:
    """The GGUF blob of ``name`` (without the ``ollama:`` prefix) in Ollama's store."""
    root = root or ollama_root()
    host, namespace, model, tag = ollama_parts(name)
    manifests = root / "manifests"
    manifest = manifests / host / namespace / model / tag
    if not manifest.is_file() and manifests.is_dir():  # Ollama compares names case-insensitively
        wanted = (host, namespace, model, tag)
        for candidate in manifests.glob("*/*/*/*"):
            if tuple(p.lower() for p in candidate.relative_to(manifests).parts) == tuple(w.lower() for w in wanted):
                manifest = candidate
                break
    if not manifest.is_file():
        raise _not_found(
            f"ollama model {name!r}", root, ollama_models(root), "OLLAMA_MODELS, else ~/.ollama/models; ollama pull it"
        )
    blob, form = _ollama_weights(manifest, root)
    if blob is None or form != "gguf":
        raise PcdError(
            f"ollama model {name!r} has no GGUF weights ({form}; manifest {manifest}): pcd-engine reads an "
            "Ollama model stored as one GGUF file, the way ollama pull stores llama.cpp models"
        )
    return blob


# -- LM Studio ---------------------------------------------------------------------------------------
def lmstudio_home() -> Path:
    """LM Studio's home, as LM Studio finds it: the path in ``~/.lmstudio-home-pointer``, else
    ``~/.cache/lm-studio`` where it exists, else ``~/.lmstudio``.
    """
    home = Path.home().resolve()
    pointer = home / ".lmstudio-home-pointer"
    if pointer.is_file():
        pointed = pointer.read_text(encoding="utf-8").strip()
        if pointed:
            return Path(pointed).expanduser()
    legacy = home / ".cache" / "lm-studio"
    return legacy if legacy.is_dir() else home / ".lmstudio"


def lmstudio_models_dir(given: str | Path | None = None) -> Path:
    """The models folder: ``given`` (the ``lmstudio_dir`` option), else the one LM Studio's
    ``settings.json`` names (``downloadsFolder``, its Settings > Models Directory), else ``<home>/models``.
    """
    if given:
        return Path(given).expanduser()
    home = lmstudio_home()
    try:
        folder = json.loads((home / "settings.json").read_text(encoding="utf-8")).get("downloadsFolder")
    except (OSError, ValueError, AttributeError):
        folder = None
    return Path(folder).expanduser() if isinstance(folder, str) and folder else home / "models"


def _lmstudio_files(folder: Path) -> Iterator[Path]:
    """A model folder's weights: its GGUF files, projectors (``mmproj-*``) left out."""
    for file in sorted(folder.glob("*.gguf")):
        if not file.name.lower().startswith("mmproj"):
            yield file


def lmstudio_models(models_dir: str | Path | None = None) -> list[StoredModel]:
    """Every GGUF under ``<models>/<publisher>/<model>/`` (the layout LM Studio downloads into)."""
    root = lmstudio_models_dir(models_dir)
    found = []
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
        files = list(_lmstudio_files(folder))
        for file in files:
            name = f"{folder.parent.name}/{folder.name}" + (f"/{file.name}" if len(files) > 1 else "")
            found.append(StoredModel(LMSTUDIO_PREFIX + name, file, file.stat().st_size, "gguf"))
    return found


def resolve_lmstudio(name: str, models_dir: str | Path | None = None) -> Path:
    """The GGUF of ``PUBLISHER/NAME`` (or ``PUBLISHER/NAME/FILE.gguf``, where the folder holds several
    quantizations) in LM Studio's models folder.
    """
    root = lmstudio_models_dir(models_dir)
    parts = name.strip("/").split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise PcdError(f"{LMSTUDIO_PREFIX}{name} is not an LM Studio model name (PUBLISHER/NAME[/FILE.gguf])")
    folder = root / parts[0] / parts[1]
    files = [folder / parts[2]] if len(parts) == 3 else list(_lmstudio_files(folder))
    files = [file for file in files if file.is_file()]
    hint = "the lmstudio_dir option (--lmstudio-dir), else LM Studio's own models folder"
    if not files:
        raise _not_found(f"LM Studio model {name!r}", root, lmstudio_models(root), hint)
    if len(files) > 1:
        choices = ", ".join(f"{LMSTUDIO_PREFIX}{parts[0]}/{parts[1]}/{file.name}" for file in files)
        raise ModelNotFoundError(f"LM Studio model {name!r} has {len(files)} GGUF files; name one: {choices}")
    if not is_gguf(files[0]):
        raise PcdError(f"{files[0]} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    return files[0]
