"""What a request cost: ``Stats``, the one frozen record that ``fill``, ``decide``, ``generate`` and
``stream`` return, and that every protocol renders its usage from.

The read path (``read_path.py``, ``filling.py``, ``deciding.py``, ``generation.py``, ``chatting.py``)
fills a ``Meter`` pass by pass; each step replaces the meter's record with an updated copy, so a
record handed out never changes afterwards. The wires read it and nothing else: the OpenAI chat
completions usage and ``x_pcd`` (``pcd_integrations/wire/chat.py``), ``/v1/decisions`` usage with
its ``cache_write_tokens`` (``pcd_integrations/wire/decisions.py``), ``/v1/systemone`` and the MCP
results (``questions.Usage``), the LangChain and LlamaIndex usage metadata and the ``pcd`` table.
``tests/test_engine.py`` checks every field on the real model; ``tests/test_cost.py`` checks the
record's own rules.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from pcd_core.backends.base import RowLayout

#: where a request's head came from: the cache, a fresh prefill, or neither when the input merged
#: with the head's last token and the whole prompt was read anew
HeadCache = Literal["hit", "miss", "bypassed"]


@dataclass(frozen=True)
class Stats:
    """The cost of one engine call, as the backend counted it (passes, tokens) and the engine timed it.

    For a fill or a decide every token read is an input token; a fill's open fields and a reply's
    text are its output tokens. A reply (``generate``/``stream``) has no rows: its prompt is read
    like a request with none, and each later token is one ``grow`` step (``open_steps``).
    """

    forward_passes: int = 0
    input_tokens: int = 0  # every token read: the head (cached or not), the request and every row
    prompt_tokens: int = 0  # request and answer-line tokens read outside the head (all of it if bypassed)
    cached_tokens: int = 0  # head tokens served from the cache (0 on a miss or a bypass)
    cache_write_tokens: int = 0  # head tokens prefilled on a miss and kept in the cache for later requests
    row_tokens: int = 0  # distinct row tokens read
    n_rows: int = 0
    rounds: int = 0
    compile_ms: float = 0.0  # schema compile (cached after the first call) or question rendering
    # waiting for the model, before the first pass and after each hand-over (pcd_core/concurrency/model_lock.py);
    # a hand-over's wait also falls inside the phase below that was running when it happened
    queue_ms: float = 0.0
    head_ms: float = 0.0  # the head: a cache lookup, or its prefill on a miss
    prefill_ms: float = 0.0  # the pass that reads the request, with the first decision points in it
    decode_ms: float = 0.0  # every later wave
    generate_ms: float = 0.0  # open rows (the closed answers written in, then every step) or a reply's steps
    open_steps: int = 0  # forward passes that extended the open rows or the reply, one token each
    output_tokens: int = 0  # tokens generated: open fields, or a reply (0 for a closed-only schema)
    total_ms: float = 0.0
    row_layout: RowLayout = "packed"
    head_cache: HeadCache = "miss"
    backend: str = ""  # the backend that ran the request ("torch", "llamacpp", ...): backend="auto"'s pick
    dtype: str = ""  # what it computed in ("float32", "bfloat16"; "gguf": the file's own types)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Meter:
    """One request's ``Stats`` while its passes are read: the read path replaces ``stats`` with an
    updated copy at each step (``dataclasses.replace``, whose keywords mypy checks against the
    fields), so the record a caller is given is never written again.
    """

    stats: Stats = field(default_factory=Stats)
