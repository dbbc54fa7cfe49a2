"""Loading a GGUF into the llama.cpp backend, with the tokenizer the engine needs beside it.

llama.cpp reads the GGUF's weights as they are. The engine still needs a Hugging Face tokenizer
(chat template, the compiler's encodings, llguidance's byte view), which transformers builds from
the same GGUF's metadata: on two cores that takes seconds (its GGUF reader walks the 49k-token
vocabulary and its merges through a numpy memmap), so the tokenizer alone, a few MB, is saved once
in the cache folder (``model_files.cache_dir``). No weights are written anywhere.

Every load, the first included, reads the saved tokenizer with ``PreTrainedTokenizerFast``, which
does not import torch; ``AutoTokenizer`` does (through transformers' model configurations), and
torch stays resident once imported (180 MB here, more once its thread pools start), as much as the
embedded model's weights and KV cache together. So only the first load of a GGUF, whose build goes
through transformers' GGUF reader, which imports torch too, holds it; later processes never do. The
tokenizer must agree with llama.cpp's own vocabulary, token for token, or the engine would score ids
the model reads as other text: ``check_vocabulary`` refuses a mismatch at load.

The context's thread count is the ``threads`` load option (``pcd_core/loading/options.py``), else
``PCD_LLAMACPP_THREADS`` when set, else every core of the machine.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from pcd_core.errors import BackendError, OptionError, PcdError
from pcd_core.tokenizer import TextTokenizer

#: texts whose tokenization must be the same in llama.cpp and in the tokenizer: words, digits,
#: spaces, punctuation, JSON and non-ASCII, where byte-level pre-tokenizers differ first
VOCABULARY_SAMPLES = (
    'Ticket #4521: "refund" requested — 3 items, 12.50 EUR; shipped 2024-11-03.\n',
    '{"priority": "high", "tags": ["billing", "login"]}\n\n  indented   spaces\ttab',
    "Überprüfung café naïve 東京 ✓ emoji 🙂 don't won't I'm",
)
#: SentencePiece's visible space, which transformers keeps in token texts and llama.cpp stores as " "
SPM_SPACE = "\u2581"


def tokenizer_dir(gguf: Path, cache: Path) -> Path:
    """The cached tokenizer of one GGUF under ``cache``, keyed by its path, size and modification time."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache / "tokenizer" / f"{gguf.stem}-{key}"


def gguf_tokenizer(gguf: Path, cache: Path) -> Any:
    """The Hugging Face tokenizer stored in a GGUF, built once and then read from the cache."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError as error:
        raise PcdError(
            "the llamacpp backend builds its tokenizer with transformers: pip install transformers"
        ) from error
    target = tokenizer_dir(gguf, cache)
    if not (target / "tokenizer_config.json").is_file():
        build_tokenizer(gguf, target)
    # the saved folder names its class (GemmaTokenizer, Qwen2Tokenizer...) and holds the whole
    # tokenizer: read this way it encodes, decodes and templates as the class that saved it does
    return PreTrainedTokenizerFast.from_pretrained(str(target), local_files_only=True)


def build_tokenizer(gguf: Path, target: Path) -> None:
    """Build the tokenizer that ``gguf`` describes, with the class transformers picks for its
    architecture, and save it as ``target`` atomically: a concurrent load sees the whole folder or none.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(target)
    except OSError:  # another process finished first; its copy is the same
        shutil.rmtree(partial, ignore_errors=True)


def threads_from_environment() -> int | None:
    given = os.environ.get("PCD_LLAMACPP_THREADS")
    if not given:
        return None
    if not given.isdigit() or int(given) < 1:
        raise OptionError(f"PCD_LLAMACPP_THREADS must be a positive whole number, got {given!r}")
    return int(given)


def load_llamacpp(
    source: Any, max_tokens_per_pass: int | None, cache: Path, threads: int | None = None
) -> tuple[Any, TextTokenizer, str]:
    """``load.load_backend`` for ``backend="llamacpp"``: (backend, tokenizer, model name). ``cache`` is
    the weights cache folder (``model_files.cache_dir``), passed in so that a backend never imports the loader.
    """
    if source.gguf is None:
        raise PcdError(
            f"the llamacpp backend reads GGUF files, and {source.name!r} is a model folder or hub id; "
            "give an embedded alias or a .gguf path, or use backend='torch'"
        )
    from pcd_core.backends.llamacpp_backend import LlamaCppBackend  # BackendUnavailableError without the extra

    with tqdm(total=2, desc=f"loading {source.name}", disable=None, leave=False) as progress:
        hf_tokenizer = gguf_tokenizer(source.gguf, cache)
        progress.update()
        backend = LlamaCppBackend(
            source.gguf, threads=threads or threads_from_environment(), max_tokens_per_pass=max_tokens_per_pass
        )
        check_vocabulary(backend, hf_tokenizer, VOCABULARY_SAMPLES)
        progress.update()
    return backend, TextTokenizer(hf_tokenizer), source.name


def check_vocabulary(backend: Any, hf_tokenizer: Any, samples: Iterable[str]) -> None:
    """Refuse a tokenizer that does not match the llama.cpp backend's vocabulary: the same token texts,
    id for id (``backend.token_text``), and the same ids for ``samples`` (``backend.tokenize``), so the
    pre-tokenizer splits text alike.
    """
    size = len(hf_tokenizer)
    if size > backend.vocab_size:
        raise BackendError(f"the tokenizer has {size} tokens, llama.cpp's vocabulary {backend.vocab_size}")
    texts = hf_tokenizer.convert_ids_to_tokens(list(range(size)))
    for token, text in enumerate(texts):
        # a SentencePiece vocabulary (Gemma's) spells a space as U+2581 in transformers, as a space in llama.cpp
        if text.replace(SPM_SPACE, " ") != backend.token_text(token).replace(SPM_SPACE, " "):
            raise BackendError(
                f"token {token} is {text!r} in the tokenizer but {backend.token_text(token)!r} in llama.cpp"
            )
    for sample in samples:
        ours, theirs = list(hf_tokenizer.encode(sample, add_special_tokens=False)), backend.tokenize(sample)
        if ours != theirs:
            raise BackendError(f"the tokenizer and llama.cpp split {sample[:40]!r} differently")
