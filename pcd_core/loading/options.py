"""``LoadOptions``: everything that says how a model loads, in one frozen, checked value.

``Engine.load`` takes one (or keywords that build one); ``load.load_backend`` reads it; the ``pcd``
subcommands, ``pcd bench`` and ``pcd-mcp`` generate their model flags from its fields' metadata
(``pcd_integrations/commands/common.py``), so the flags, their help and the checks cannot drift apart.

The invariant: a ``LoadOptions`` that exists can be loaded as it says. Every value is checked in
``__post_init__`` and a wrong one is an ``OptionError``, before a file is opened or a weight read. An
option that the chosen backend cannot honour is refused the same way for every backend, from one table
(``SUPPORT``) and with one message shape; none is silently dropped (``row_layout`` used to be, for MLX
and vLLM). ``tests/test_options.py`` checks each refusal, and that the flags follow the fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from pcd_core.backends.base import LayoutChoice
from pcd_core.errors import OptionError
from pcd_core.request.limits import MAX_ORDER_SAMPLES, check_order_samples
from pcd_core.trust.calibration import Calibration

#: the one list of backend names: ``Engine.load``, the commands' ``--backend``, ``pcd-mcp`` and the adapters
BackendName = Literal["torch", "mlx", "llamacpp", "vllm"]
BACKENDS: tuple[BackendName, ...] = get_args(BackendName)
#: what ``backend`` takes: a backend, or ``auto``, which ``pcd_core/loading/auto.py`` resolves when the model loads
BackendChoice = Literal["auto", "torch", "mlx", "llamacpp", "vllm"]
BACKEND_CHOICES: tuple[BackendChoice, ...] = get_args(BackendChoice)

#: the module each backend imports, and so the one whose absence means its extra is not installed
BACKEND_MODULES: Mapping[BackendName, str] = {
    "torch": "torch",
    "mlx": "mlx",
    "llamacpp": "llama_cpp",
    "vllm": "httpx",
}

#: the torch dtypes a model may be loaded in; the default is float32 on CPU (every CPU figure here) and
#: bfloat16 on CUDA (``backends.torch_backend.default_dtype``)
Dtype = Literal["float32", "float16", "bfloat16"]
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
#: ``dtype="auto"`` is the default, stored as None: ``pcd_core/loading/auto.py`` picks it when the model loads
DtypeChoice = Literal["auto", "float32", "float16", "bfloat16"]

LAYOUT_CHOICES: tuple[LayoutChoice, ...] = get_args(LayoutChoice)

DEFAULT_MODEL = "smollm2-135m"


def _option(default: Any, help: str, *, flag: bool | str = True, env: str | None = None, **cli: Any) -> Any:
    """A field with its help text and command-line metadata: ``flag`` (whether the commands offer it, as
    ``--name`` or the flag named here), ``env`` (the variable ``pcd-mcp`` defaults it to), ``metavar``,
    ``secret`` (the flag names a variable that holds the value) and ``opt_in`` (offered where asked for).
    """
    return field(default=default, metadata={"help": help, "flag": flag, "env": env, **cli})


@dataclass(frozen=True)
class LoadOptions:
    """How to load a model; ``dataclasses.replace(options, backend="mlx")`` derives another, checked again."""

    model: str = _option(
        DEFAULT_MODEL,
        "embedded alias, Hub id (downloaded on first use; ORG/REPO:FILE.gguf for one GGUF), ollama:NAME[:TAG], "
        "lmstudio:PUBLISHER/NAME, local folder or .gguf path (pcd models lists them)",
        env="PCD_MODEL",
    )
    backend: BackendChoice = _option(
        "auto",
        "the engine that runs the model; auto picks one from the model's format and size and the machine "
        "(pcd_core/loading/auto.py; pcd models shows its pick)",
        env="PCD_BACKEND",
    )
    device: str | None = _option(None, "torch device, e.g. cpu or cuda", env="PCD_DEVICE")
    dtype: DtypeChoice | None = _option(
        None,
        "the torch backend's weights and arithmetic; auto (the default) is bfloat16 on CUDA or a CPU with "
        "AMX whose load self-check passes in it, else float32",
        env="PCD_DTYPE",
    )
    revision: str | None = _option(
        None, "the Hugging Face revision (branch, tag or commit) of a Hub id; a commit pins it", metavar="REV"
    )
    offline: bool = _option(
        False,
        "never download: a Hub id not in the local cache is refused with what is missing (as HF_HUB_OFFLINE=1)",
    )
    lmstudio_dir: str | None = _option(
        None,
        "LM Studio's models folder for lmstudio:PUBLISHER/NAME (default: the one LM Studio uses)",
        env="PCD_LMSTUDIO_DIR",
        metavar="DIR",
    )
    row_layout: LayoutChoice = _option(
        "auto",
        "how rows share the prefix on torch: packed (one sequence, a tree mask) or copies (a KV copy per "
        "row); auto takes the first that passes the load-time self-check",
        env="PCD_ROW_LAYOUT",
    )
    max_tokens_per_pass: int | None = _option(
        None,
        "row tokens per forward pass (default 4096); bounds memory, never changes a result",
        env="PCD_MAX_TOKENS_PER_PASS",
        metavar="N",
    )
    max_pass_bytes: int | None = _option(
        None, "estimated KV and mask bytes one pass may hold (default 2 GiB; backends/base.py)", flag=False
    )
    head_cache_size: int = _option(8, "cached head prefills (the LRU of pcd_core/engine.py)", flag=False)
    # no env: PCD_LLAMACPP_THREADS is read by the llama.cpp loader itself, and only for that backend
    threads: int | None = _option(
        None, "llama.cpp context threads (default $PCD_LLAMACPP_THREADS, else every core)", metavar="N"
    )
    base_url: str | None = _option(
        None, "the vLLM server for --backend vllm, e.g. http://host:8000", env="PCD_VLLM_BASE_URL"
    )
    api_key: str | None = _option(
        None,
        "send the key in environment variable VAR to vLLM (never the key itself on the command line)",
        flag="--vllm-api-key-env",
        env="PCD_VLLM_API_KEY",
        secret=True,
        metavar="VAR",
    )
    calibration: str | Path | Calibration | None = _option(
        None, "a calibration file written by pcd calibrate (or a Calibration), read before the model loads", flag=False
    )
    debias: bool = _option(False, "fill and decide divide out the content-free label prior by default", flag=False)
    order_samples: int = _option(
        1,
        f"decide also reads K - 1 rotations of each choice's and score's options, as more rows of the same "
        f"pass, and averages them; answers report their order spread (1 to {MAX_ORDER_SAMPLES})",
        env="PCD_ORDER_SAMPLES",
        opt_in=True,
        metavar="K",
    )
    max_sessions: int = _option(
        64,
        "sessions that keep their KV at once (pcd_core/sessions/session.py); the least recently used beyond that "
        "drop it and read their text again on their next append",
        flag=False,
    )
    max_session_tokens: int | None = _option(
        None,
        "the most tokens one session's prompt may hold (default: the model's context); with max_sessions "
        "it bounds the KV every session holds together",
        flag=False,
    )
    dummy_weights: str | None = _option(
        None,
        "instead of --model, that architecture with random weights, for timing only: a shipped shape "
        "(pcd_core/loading/dummy_weights.py) or a config JSON file",
        opt_in=True,
        metavar="CONFIG",
    )

    def __post_init__(self) -> None:
        if self.dtype == "auto":  # the default, spelt out: stored as None so that both compare equal
            object.__setattr__(self, "dtype", None)
        _check_values(self)
        check_support(self)
        if self.backend == "vllm" and not self.base_url:
            raise OptionError(
                "backend 'vllm' needs base_url (--base-url): the vLLM server's address, e.g. http://127.0.0.1:8000"
            )
        if self.dummy_weights is not None and self.model != DEFAULT_MODEL:
            raise OptionError(f"give a model ({self.model!r}) or dummy_weights ({self.dummy_weights!r}), not both")

    def fitted_calibration(self) -> Calibration | None:
        """The calibration to apply, its file read now: a bad file fails before the model loads."""
        if isinstance(self.calibration, str | Path):
            return Calibration.load(self.calibration)
        return self.calibration


def load_options(given: LoadOptions | str | None = None, /, **keywords: Any) -> LoadOptions:
    """``Engine.load``'s arguments as one ``LoadOptions``: an options value, a model name or nothing, and
    keywords that build one or override the given one's fields. An unknown keyword is an ``OptionError``.
    """
    unknown = sorted(set(keywords) - {f.name for f in dataclasses.fields(LoadOptions)})
    if unknown:
        names = ", ".join(f.name for f in dataclasses.fields(LoadOptions))
        raise OptionError(f"unknown load option(s) {', '.join(unknown)}; the options are: {names}")
    if isinstance(given, LoadOptions):
        return dataclasses.replace(given, **keywords)
    if given is not None:
        if "model" in keywords:
            raise OptionError(f"the model is named twice: {given!r} and model={keywords['model']!r}")
        keywords["model"] = given
    return LoadOptions(**keywords)


def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise OptionError(f"{name} must be a positive whole number, got {value!r}")


def _check_values(options: LoadOptions) -> None:
    """Each value on its own: a name from its list, a positive count, a non-empty model."""
    for name, allowed, more in (
        ("backend", BACKEND_CHOICES, ""),
        ("dtype", DTYPES, " (or auto)"),
        ("row_layout", LAYOUT_CHOICES, ""),
    ):
        value = getattr(options, name)
        if value is not None and value not in allowed:
            raise OptionError(f"{name} must be one of {', '.join(allowed)}{more}, got {value!r}")
    if not isinstance(options.model, str) or not options.model:
        raise OptionError(f"model must be a model name or path, got {options.model!r}")
    if not isinstance(options.offline, bool):
        raise OptionError(f"offline must be True or False, got {options.offline!r}")
    for name in ("revision", "lmstudio_dir"):
        value = getattr(options, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise OptionError(f"{name} must be a non-empty string, got {value!r}")
    for name in ("max_tokens_per_pass", "max_pass_bytes", "threads", "max_sessions", "max_session_tokens"):
        _positive(name, getattr(options, name))
    check_order_samples(options.order_samples)
    if isinstance(options.head_cache_size, bool) or not isinstance(options.head_cache_size, int):
        raise OptionError(f"head_cache_size must be a whole number, got {options.head_cache_size!r}")
    if options.head_cache_size < 0:
        raise OptionError(f"head_cache_size must be 0 (no cache) or more, got {options.head_cache_size!r}")


@dataclass(frozen=True)
class Support:
    """One row of ``SUPPORT``: the backends that honour an option, each with the values it takes (None:
    any), and why the others cannot, with what to do instead.
    """

    backends: Mapping[BackendName, tuple[str, ...] | None]
    why: str


#: which backend honours which option. An option not listed here is honoured by every backend; an
#: option at its default (unset, or row_layout "auto") asks nothing of a backend and is never refused.
SUPPORT: Mapping[str, Support] = {
    "device": Support(
        {"torch": None},
        "only torch places the weights; llama.cpp runs on the CPU, MLX on its own default device, and a vLLM "
        "server on the devices it was started with",
    ),
    "dtype": Support(
        {"torch": None, "mlx": ("float32",)},
        "llama.cpp computes in the GGUF's own types, the MLX backend sets its own compute dtype (float32 for a "
        "GGUF), and a vLLM server in the dtype it was started with (vllm serve --dtype)",
    ),
    "row_layout": Support(
        {"torch": None, "mlx": ("packed",), "llamacpp": ("packed",), "vllm": ("copies",)},
        "only torch has both layouts; MLX and llama.cpp always pack the rows, and vLLM reads a copy per row",
    ),
    "threads": Support(
        {"llamacpp": None},
        "torch and MLX take their thread counts from their own settings (torch.set_num_threads, "
        "OMP_NUM_THREADS), and vLLM computes on its server",
    ),
    "base_url": Support({"vllm": None}, "only the vllm backend reads on a server; the others load the model here"),
    "api_key": Support({"vllm": None}, "only the vllm backend reads on a server that may want a key"),
    "dummy_weights": Support({"torch": None}, "dummy weights run on the torch backend only"),
}


def check_support(options: LoadOptions) -> None:
    """Refuse an option the backend cannot honour: one check and one message shape for every backend."""
    defaults = {f.name: f.default for f in dataclasses.fields(LoadOptions)}
    if options.backend == "auto":  # auto picks a backend that honours all that is set (pcd_core/loading/auto.py)
        possible, named = set(BACKENDS), []
        for name, support in SUPPORT.items():
            value = getattr(options, name)
            if value != defaults[name]:
                named.append(name)
                possible &= {b for b, takes in support.backends.items() if takes is None or value in takes}
        if not possible:
            raise OptionError(
                f"no backend honours {' and '.join(named)} together, so backend 'auto' has none to pick; "
                "leave one unset or name a backend"
            )
        return
    for name, support in SUPPORT.items():
        value = getattr(options, name)
        if value == defaults[name]:
            continue
        if options.backend in support.backends:
            takes = support.backends[options.backend]
            if takes is None or value in takes:
                continue
            can = f"it takes {name} {' or '.join(map(repr, takes))} only"
        else:
            can = "it takes none"
        shown = "(set)" if name == "api_key" else repr(value)
        raise OptionError(
            f"the {options.backend} backend cannot honour {name}={shown} ({can}): {support.why}; "
            f"leave {name} unset or choose another backend"
        )
