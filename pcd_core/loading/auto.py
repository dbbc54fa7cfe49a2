"""``backend="auto"`` and ``dtype="auto"``: which backend runs a model, and in what, from the model's
format and size and the machine.

The rule, measured by ``pcd bench --auto`` (``pcd_core/bench/auto_pick.py``, docs/models.md's table):

1. Options that only one backend honours decide it: ``base_url`` is vLLM; ``threads`` is llama.cpp;
   ``device``, a torch dtype, ``row_layout="copies"`` or ``dummy_weights`` is torch.
2. With CUDA, torch, in bfloat16 (GPU serving's dtype; ``backends/torch_backend.default_dtype``).
3. On a CPU, a GGUF of at least ``LLAMACPP_MIN_BYTES`` goes to llama.cpp (when its extra is installed),
   which reads the quantized weights as they are; torch would compute on a float32 copy four to
   eight times their size. A smaller GGUF (the embedded SmolLM2) and any safetensors folder go to
   torch. Apple silicon follows the CPU rule (not measured here: no such machine).
4. torch on a CPU computes in bfloat16 only where the CPU has AMX (``amx_bf16``), and only if the
   load-time self-check passes in it (``load._torch_backend`` falls back to float32); elsewhere
   float32, today's default. AVX-512-BF16 without AMX (this project's 2-core AMD machine) keeps
   float32: bfloat16 there was not measured to be faster.

The choice is recorded: every result's ``stats.backend`` and ``stats.dtype`` say what ran, and
``pcd models`` shows what ``auto`` would pick for each model it finds. ``tests/test_auto.py`` checks
each branch of the rule on a described machine, and a real load's stats.
"""

from __future__ import annotations

import importlib.util
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from pcd_core.loading.options import BackendName, LoadOptions

#: GGUF files at least this large run on llama.cpp on a CPU. Measured with ``pcd bench --auto`` on a quiet
#: machine (docs/bench/auto_*_quiet.json, docs/models.md): the 98 MB SmolLM2 read closed fields 1.65x
#: faster on torch, so it stays there; the 253 MB Gemma 3 filled faster on llama.cpp (1.17x closed, 4.7x
#: mixed), as did the 491 MB Qwen2.5-Coder-0.5B and the 1,117 MB 1.5B. The threshold sits between
#: SmolLM2 and Gemma, at their geometric mean: fill times scale with size as a ratio, not a difference
LLAMACPP_MIN_BYTES = 160_000_000

ModelFormat = Literal["gguf", "safetensors", "remote"]


@dataclass(frozen=True)
class Machine:
    """What the rule reads about the machine."""

    cuda: bool
    amx: bool  # Intel AMX tiles with bfloat16 (``amx_bf16``): torch's bfloat16 matrix products use them
    avx512_bf16: bool
    apple_silicon: bool
    llamacpp: bool  # the llamacpp extra is installed

    def describe(self) -> str:
        accel = "CUDA" if self.cuda else "Apple silicon" if self.apple_silicon else "CPU"
        flags = [name for name, on in (("AMX", self.amx), ("AVX512-BF16", self.avx512_bf16)) if on]
        return f"{accel}{' with ' + ', '.join(flags) if flags else ''}"


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


@cache
def this_machine() -> Machine:
    """The machine this process runs on; CUDA is looked at only where torch is already installed."""
    cuda = False
    if importlib.util.find_spec("torch") is not None:
        import torch

        cuda = bool(torch.cuda.is_available())
    flags = _cpu_flags()
    return Machine(
        cuda=cuda,
        amx="amx_bf16" in flags,
        avx512_bf16="avx512_bf16" in flags,
        apple_silicon=platform.system() == "Darwin" and platform.machine() == "arm64",
        llamacpp=importlib.util.find_spec("llama_cpp") is not None,
    )


@dataclass(frozen=True)
class Choice:
    """What ``auto`` picked, and why, in a sentence ``pcd models`` prints."""

    backend: BackendName
    dtype: str | None  # torch's compute dtype; None where the backend computes in the weights' own types
    reason: str


def forced(options: LoadOptions) -> tuple[BackendName, str] | None:
    """The backend that options only it honours name, if any."""
    if options.base_url:
        return "vllm", "base_url names a vLLM server"
    if options.threads is not None:
        return "llamacpp", "threads is a llama.cpp option"
    if options.dummy_weights is not None:
        return "torch", "dummy weights run on torch"
    if options.device is not None or options.dtype is not None or options.row_layout == "copies":
        return "torch", "device, dtype or row_layout copies is a torch option"
    return None


def torch_dtype(machine: Machine) -> str:
    """The torch backend's compute dtype under ``dtype="auto"``: bfloat16 on CUDA or with AMX, else float32."""
    return "bfloat16" if machine.cuda or machine.amx else "float32"


def choose(options: LoadOptions, model_format: ModelFormat, size_bytes: int, machine: Machine) -> Choice:
    """The backend (and torch dtype) for a model of this format and size on ``machine``, as the
    module's rule says; ``options.backend`` other than ``"auto"`` is kept as given.
    """
    if options.backend != "auto":
        backend: BackendName = options.backend
        dtype = (options.dtype or torch_dtype(machine)) if backend == "torch" else None
        return Choice(backend, dtype, "named")
    given = forced(options)
    if given is not None:
        backend, why = given
    elif machine.cuda:
        backend, why = "torch", "CUDA is available"
    elif model_format != "gguf":
        backend, why = "torch", "llama.cpp reads GGUF files only"
    elif size_bytes < LLAMACPP_MIN_BYTES:
        backend, why = "torch", f"a GGUF under {LLAMACPP_MIN_BYTES / 1e6:.0f} MB runs on torch on a CPU"
    elif not machine.llamacpp:
        backend, why = (
            "torch",
            "a large GGUF, but the llamacpp extra is not installed (pip install 'pcd-engine[llamacpp]')",
        )
    else:
        backend, why = (
            "llamacpp",
            f"a GGUF of {LLAMACPP_MIN_BYTES / 1e6:.0f} MB or more runs on llama.cpp on a CPU",
        )
    dtype = (options.dtype or torch_dtype(machine)) if backend == "torch" else None
    return Choice(backend, dtype, why)


def source_format(gguf: Path | None, folder: str | None) -> tuple[ModelFormat, int]:
    """A resolved model's format and weights size in bytes (``model_files.ModelSource``'s two fields)."""
    if gguf is not None:
        return "gguf", gguf.stat().st_size
    if folder is None:
        return "remote", 0
    return "safetensors", sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))
