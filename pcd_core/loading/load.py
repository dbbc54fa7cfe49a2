"""The backend dispatch: from checked load options to a loaded backend and its tokenizer.

Kept apart from ``model_files.py`` (the registry and the files on disk) so that what only needs a
model's files (dummy weights, datasets, the commands) does not import every backend's loader.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from pcd_core.backends import model_thread
from pcd_core.errors import BackendError, BackendUnavailableError
from pcd_core.loading import auto
from pcd_core.loading.model_files import ModelSource, cache_dir, load_tokenizer_and_weights_dir, resolve_options
from pcd_core.loading.options import LoadOptions
from pcd_core.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from pcd_core.backends.base import Backend

logger = logging.getLogger(__name__)


def load_backend(options: LoadOptions) -> tuple[Any, TextTokenizer, str]:
    """Load weights and tokenizer as ``options`` say (checked when they were built, so nothing here
    refuses an option), with a progress bar on stderr. For ``backend="vllm"`` only the tokenizer loads
    here, from the same files as the server's model.
    """
    options, choice = chosen_options(options)
    # a model in this process is built on the thread that will run it (``backends/model_thread.py``)
    loaded, tokenizer, name = _load(options) if options.backend == "vllm" else model_thread.run(partial(_load, options))
    if options.max_pass_bytes is not None:
        loaded.max_pass_bytes = options.max_pass_bytes
    return loaded, tokenizer, name


def chosen_options(options: LoadOptions) -> tuple[LoadOptions, auto.Choice]:
    """``options`` with ``backend="auto"`` replaced by the backend ``auto.py``'s rule picks for this
    model on this machine (resolving the model to see its format and size, unless an option names the
    backend), and the choice with its reason. A named backend is kept.
    """
    if options.backend in ("mlx", "llamacpp", "vllm"):  # named, and not torch: no need to look for CUDA
        return options, auto.Choice(options.backend, None, "named")
    machine = auto.this_machine()
    if options.backend != "auto":
        return options, auto.choose(options, "remote", 0, machine)
    model_format: auto.ModelFormat = "remote"
    size = 0
    if auto.forced(options) is None:
        source = resolve_options(options)
        model_format, size = auto.source_format(source.gguf, source.pretrained)
    choice = auto.choose(options, model_format, size, machine)
    logger.info(
        "backend auto: %s, dtype %s, on %s: %s", choice.backend, choice.dtype, machine.describe(), choice.reason
    )
    return dataclasses.replace(options, backend=choice.backend), choice


def _load(options: LoadOptions) -> tuple[Any, TextTokenizer, str]:
    if options.dummy_weights is not None:
        from pcd_core.loading.dummy_weights import load_dummy_backend

        return load_dummy_backend(options)
    if options.backend == "llamacpp":  # reads the GGUF itself: no dequantized folder, no torch
        from pcd_core.backends.llamacpp_loading import load_llamacpp

        return load_llamacpp(resolve_options(options), options.max_tokens_per_pass, cache_dir(), options.threads)
    model = options.model
    with tqdm(total=3, desc=f"loading {model}", disable=None, leave=False) as progress, _library_bars_off():
        source = resolve_options(options)
        progress.update()
        folder = load_tokenizer_and_weights_dir(source, progress)
        from transformers import AutoTokenizer

        tokenizer = TextTokenizer(AutoTokenizer.from_pretrained(folder, local_files_only=True))
        progress.update()
        if options.backend == "torch":
            loaded = _torch_backend(folder, options)
        elif options.backend == "mlx":
            loaded = _mlx_backend(source, folder, options.max_tokens_per_pass)
        else:
            loaded = _vllm_backend(folder, tokenizer, options)
        progress.update()
    return loaded, tokenizer, source.name


@contextmanager
def _library_bars_off() -> Iterator[None]:
    """Silence transformers' own bars while we load ("Loading weights" on every load, warm ones
    too); ours stays. transformers' tqdm hook is swapped in and the previous one put back, so that the
    caller's settings are as they were (``tests/test_models.py`` reads a warm load's stderr).
    """
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # the vllm extra's tokenizer needs transformers too; without it nothing prints
        yield
        return
    if not hasattr(transformers_logging, "set_tqdm_hook"):  # older 5.x: the global switch, put back
        was_on = transformers_logging.is_progress_bar_enabled()
        transformers_logging.disable_progress_bar()
        try:
            yield
        finally:
            if was_on:
                transformers_logging.enable_progress_bar()
        return
    previous = transformers_logging.set_tqdm_hook(_no_bar)
    try:
        yield
    finally:
        transformers_logging.set_tqdm_hook(previous)


def _no_bar(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return factory(*args, **{**kwargs, "disable": True})


def _torch_backend(folder: str, options: LoadOptions) -> Backend:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as error:
        raise BackendUnavailableError("torch", error.name or "torch") from error
    from pcd_core.backends.torch_backend import TorchBackend, default_dtype

    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if options.dtype:
        torch_dtype = getattr(torch, options.dtype)
    elif device == "cpu" and auto.this_machine().amx:  # auto: bfloat16 on AMX, if the self-check passes in it
        torch_dtype = torch.bfloat16
    else:
        torch_dtype = default_dtype(torch.device(device))

    def build(dtype: Any) -> Backend:
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation="sdpa", local_files_only=True
        )
        model = model.to(device)  # type: ignore[arg-type]
        return TorchBackend(model, max_tokens_per_pass=options.max_tokens_per_pass, row_layout=options.row_layout)

    try:
        return build(torch_dtype)
    except BackendError as error:
        if options.dtype or torch_dtype == torch.float32:
            raise
        logger.warning("the load self-check failed in %s (%s); loading in float32", torch_dtype, error)
        return build(torch.float32)


def _mlx_backend(source: ModelSource, folder: str, max_tokens: int | None) -> Backend:
    from pcd_core.backends.mlx_backend import MlxBackend

    if source.gguf is not None:
        try:  # MLX keeps Q4_0/Q4_1/Q8_0 llama GGUFs quantized (SmolLM2)
            return MlxBackend.from_gguf(str(source.gguf), max_tokens_per_pass=max_tokens)
        except BackendError as error:  # k-quants (Gemma's Q4_K_M): read the dequantized folder
            logger.info("MLX cannot read %s natively (%s); using %s", source.gguf.name, error, folder)
    return MlxBackend.from_hf_dir(folder, max_tokens_per_pass=max_tokens)


def _vllm_backend(folder: str, tokenizer: TextTokenizer, options: LoadOptions) -> Any:
    from transformers import AutoConfig

    from pcd_core.backends.vllm_backend import VllmBackend

    # the output head's size, which a tokenizer's length can undercount (padded vocabularies)
    vocab = getattr(AutoConfig.from_pretrained(folder).get_text_config(), "vocab_size", None)
    return VllmBackend(
        options.base_url or "",
        tokenizer,
        api_key=options.api_key,
        vocab_size=vocab,
        max_tokens_per_pass=options.max_tokens_per_pass,
    )
