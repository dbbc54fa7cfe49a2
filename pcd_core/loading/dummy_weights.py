"""Models with random weights built from an architecture config: speed at any size, without the weights.

A forward pass costs the same whatever the weights' values, so a model of the right shape with random
weights times PCD and its competitors as the real model would (serving engines do the same: vLLM's
``--load-format dummy``). Its answers mean nothing; ``pcd bench --dummy-weights`` says so and compares
only times and pass counts. The shapes ship as JSON in ``pcd_core/loading/archs/`` (a Llama-3-8B, a Qwen2.5-7B
and a Gemma-3-4B shape, the embedded models' own, and ``tiny-llama`` for CI); a Hugging Face
``config.json`` given as a path works too. The tokenizer is the embedded model's of the same family
(``FAMILY_TOKENIZERS``), since prompts, rows and tries need a real one, and the vocabulary follows it.
A family without a tokenizer here is refused before anything is built.

The model is built once, on its device and in its dtype (no second copy), and drawn with a standard
deviation of ``hidden_size ** -0.5``: each projection then keeps its input's scale, so log-probs move
by whole nats with the context, and the torch backend's layout self-check can still tell a wrong mask
from rounding (with transformers' default 0.02 a tiny model's log-probs are almost flat).
``tests/test_dummy_weights.py`` runs the bench on ``tiny-llama``, refuses a family without a tokenizer,
and passes the self-check in bfloat16 on small versions of every shipped family.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcd_core.errors import BackendUnavailableError, OptionError, PcdError
from pcd_core.loading.model_files import cache_dir, converted_dir, resolve
from pcd_core.loading.options import LoadOptions
from pcd_core.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

ARCH_DIR = Path(__file__).resolve().parent / "archs"

#: the embedded model whose tokenizer each architecture family borrows (``model_type`` -> alias)
FAMILY_TOKENIZERS = {"llama": "smollm2-135m", "qwen2": "qwen2.5-coder-0.5b", "gemma3_text": "gemma3-270m"}

#: what a config may say that the dummy model sets itself: the vocabulary and special ids follow the
#: borrowed tokenizer, the dtype is the caller's, and the weights are not quantized
_REPLACED = (
    "vocab_size",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    "quantization_config",
)

#: the share of free memory a dummy model may take; the rest is for activations, KV and the runtime
_MEMORY_SHARE = 0.9


def shipped_architectures() -> list[str]:
    return sorted(path.stem for path in ARCH_DIR.glob("*.json"))


@dataclass(frozen=True)
class Architecture:
    """A model's shape: a Hugging Face config without weights, and where it came from."""

    name: str
    description: str
    config: dict[str, Any] = field(hash=False)

    @property
    def family(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def tokenizer_alias(self) -> str:
        """The embedded model whose tokenizer this shape runs with; refused when there is none."""
        alias = FAMILY_TOKENIZERS.get(self.family)
        if alias is None:
            known = ", ".join(f"{family} ({alias})" for family, alias in FAMILY_TOKENIZERS.items())
            raise OptionError(
                f"architecture {self.name!r} is of family {self.family!r}, whose tokenizer does not ship "
                f"here; dummy weights need a real tokenizer of the same family: {known}"
            )
        return alias


def read_architecture(spec: str) -> Architecture:
    """A shipped shape by name (``llama3-8b``) or a JSON file: ``{"description", "config"}`` or a bare
    Hugging Face ``config.json``. Gemma 3's multimodal config is read as its text model.
    """
    path = ARCH_DIR / f"{spec}.json"
    if not path.is_file():
        path = Path(spec).expanduser()
        if not path.is_file():
            raise OptionError(
                f"dummy weights {spec!r}: neither a shipped shape ({', '.join(shipped_architectures())}) "
                "nor a JSON file"
            )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise OptionError(f"dummy weights {spec!r}: cannot read {str(path)!r}: {error}") from error
    config = data.get("config", data) if isinstance(data, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise OptionError(f"dummy weights {spec!r}: {str(path)!r} holds no config with a 'model_type'")
    if config["model_type"] == "gemma3" and isinstance(config.get("text_config"), dict):
        config = dict(config["text_config"], model_type="gemma3_text")
    description = data.get("description", "") if "config" in data else f"the shape of {path}"
    return Architecture(path.stem, str(description), config)


def check_architecture(spec: str) -> tuple[Architecture, str]:
    """The shape named by ``spec`` and the alias of its tokenizer; refused when either is missing."""
    arch = read_architecture(spec)
    return arch, arch.tokenizer_alias


def dummy_tokenizer(alias: str) -> TextTokenizer:
    """The embedded model's tokenizer alone, kept in the cache by alias after the first read.

    Reading a tokenizer out of a GGUF takes seconds (40 s for Gemma's 262k entries on two cores); the
    dequantized folder of a model loaded before holds it already. Keyed by alias, the cached folder
    also serves where the model's package is absent, so it alone can be carried to another machine.
    """
    from transformers import AutoTokenizer

    kept = cache_dir() / "tokenizers" / alias
    if not (kept / "tokenizer_config.json").is_file():
        gguf = resolve(alias).gguf
        assert gguf is not None, "every embedded model is a GGUF"
        converted = converted_dir(gguf)
        if (converted / "tokenizer_config.json").is_file():
            hf = AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
        else:
            hf = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        # write beside the target and rename, so that a concurrent load never sees half a folder
        kept.parent.mkdir(parents=True, exist_ok=True)
        partial = kept.with_name(f"{alias}.partial-{os.getpid()}")
        hf.save_pretrained(partial)
        try:
            partial.rename(kept)
        except OSError:  # another process finished first; its copy is identical
            shutil.rmtree(partial, ignore_errors=True)
    return TextTokenizer(AutoTokenizer.from_pretrained(str(kept), local_files_only=True))


def model_config(arch: Architecture, vocab_size: int, special_ids: dict[str, int | None]) -> Any:
    """The transformers config of ``arch`` with the borrowed tokenizer's vocabulary size and special
    ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``), and the weights' scale.
    """
    from transformers import AutoConfig

    settings: dict[str, Any] = {key: value for key, value in arch.config.items() if key not in _REPLACED}
    hidden = settings.get("hidden_size")
    if not isinstance(hidden, int) or hidden < 1:
        raise OptionError(f"dummy weights {arch.name!r}: the config needs a positive whole 'hidden_size'")
    try:
        settings.update(special_ids, vocab_size=vocab_size, initializer_range=hidden**-0.5)
        return AutoConfig.for_model(**settings)
    except (ValueError, TypeError, KeyError) as error:
        raise OptionError(f"dummy weights {arch.name!r}: transformers refuses the config: {error}") from error


def special_ids(hf_tokenizer: Any) -> dict[str, int | None]:
    """A tokenizer's special ids as config keys; a pad id past the vocabulary is left unset."""
    vocab, pad = len(hf_tokenizer), hf_tokenizer.pad_token_id
    return {
        "bos_token_id": hf_tokenizer.bos_token_id,
        "eos_token_id": hf_tokenizer.eos_token_id,
        "pad_token_id": pad if pad is not None and pad < vocab else None,
    }


def build_model(config: Any, device: Any, dtype: Any, seed: int = 0) -> Any:
    """The model, allocated once on ``device`` in ``dtype`` and drawn from ``seed``; refused up front
    when its weights would not fit in the device's free memory.
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: the size, before any memory is taken
        shape = AutoModelForCausalLM.from_config(config)
    n_bytes = sum(p.numel() for p in shape.parameters()) * torch.finfo(dtype).bits // 8
    free = _free_bytes(device)
    if free is not None and n_bytes > _MEMORY_SHARE * free:
        raise OptionError(
            f"dummy weights of {n_bytes / 2**20:,.0f} MiB in {str(dtype).removeprefix('torch.')} do not fit in "
            f"the {free / 2**20:,.0f} MiB free on {device}; pick a smaller shape, a 16-bit dtype, or a device "
            "with more memory"
        )
    logger.info("building a %.2f GiB model with random weights on %s", n_bytes / 2**30, device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def _free_bytes(device: Any) -> int | None:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:  # what Linux can hand out without swapping, page cache included
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
    return None


def load_dummy_backend(options: LoadOptions) -> tuple[Any, TextTokenizer, str]:
    """``Engine.load(dummy_weights=spec)``: a torch backend over a random model of that shape. The
    options were checked when built (torch only, no model beside the shape; ``pcd_core/loading/options.py``).
    """
    assert options.dummy_weights is not None
    spec, device, dtype = options.dummy_weights, options.device, options.dtype
    arch, alias = check_architecture(spec)
    try:
        import torch

        from pcd_core.backends.torch_backend import TorchBackend, default_dtype
    except ImportError as error:
        raise BackendUnavailableError("torch", error.name or "torch") from error
    try:
        tokenizer = dummy_tokenizer(alias)
    except PcdError as error:
        raise PcdError(f"dummy weights {arch.name!r} borrow the tokenizer of {alias}: {error}") from error
    place = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = getattr(torch, dtype) if dtype else default_dtype(place)
    config = model_config(arch, len(tokenizer.hf), special_ids(tokenizer.hf))
    model = build_model(config, place, torch_dtype)
    loaded = TorchBackend(model, max_tokens_per_pass=options.max_tokens_per_pass, row_layout=options.row_layout)
    return loaded, tokenizer, f"dummy:{arch.name}"
