"""The torch backend's load-time layout check: a row layout is kept only if it reads what the model does.

A row layout (``packed`` or ``copies``) is accepted only if its log-probs match the model's plain
forward pass over the same text (``choose_layout``): to 1e-3 in float32, and in a 16-bit dtype to
twice what the model's own code differs from itself there (a read through its KV cache against one
whole pass), since bfloat16 rounding alone moves log-probs by tenths while a wrong mask or position
moves them by more than 1. A model whose attention ignores custom masks fails that check and falls
back to ``copies`` (one broadcast KV per row, padded), which ``stats.row_layout`` reports; if that
fails too the backend refuses to load. The copies fallback reads a trunk as a prefill of its own
(one more pass) instead of once per row.

The plain side is independent of any layout: ``whole_pass_case`` reads prompt + each row in one
whole pass, and ``rounding_floor`` measures how far the model's own code disagrees with itself in
its dtype (the rows read after the prompt through its KV cache), which sets the tolerance in 16-bit
dtypes; ``self_check`` reads the same rows through the backend's layout. Only ``torch_backend``
imports this module, after checking that torch is installed (``TorchBackend`` runs
``choose_layout`` when it is built); ``tests/test_torch_backend.py`` and
``tests/test_dummy_weights.py`` load backends that pass the check and refuse a wrong mask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch  # reached only through ``torch_backend``, which checks that torch is there

from pcd_core.backends.base import Backend, Query, RowLayout
from pcd_core.backends.packing import pack_tree
from pcd_core.errors import BackendError

logger = logging.getLogger(__name__)

#: how closely a row layout must match the model's own forward pass in float32 (max |log-prob| apart);
#: a lower precision adds twice the disagreement the model's own code shows with itself
LAYOUT_TOLERANCE = 1e-3


def _gathered(logits: torch.Tensor, ids: tuple[int, ...]) -> np.ndarray:
    """Log-probs of ``ids`` after the last position of a model's output logits."""
    return torch.log_softmax(logits[0, -1].float(), -1)[list(ids)].double().cpu().numpy()


@dataclass(frozen=True)
class CheckCase:
    """The layout self-check's text, and the model's whole pass over prompt + each row at ``ids``."""

    prompt: list[int]
    rows: list[tuple[int, ...]]
    ids: tuple[int, ...]
    whole: list[np.ndarray]

    def gap(self, read: Sequence[np.ndarray]) -> float:
        """The largest |log-prob| difference of ``read`` (one array per row) from the whole pass."""
        return max(float(np.max(np.abs(want - got))) for want, got in zip(self.whole, read, strict=True))


@torch.inference_mode()
def whole_pass_case(model: Any, device: torch.device, vocab: int) -> CheckCase:
    """A fixed prompt and two rows spread over the vocabulary, and the model's whole pass over each
    prompt + row; the model's own forward pass applies any final soft-capping itself.
    """
    prompt = [(7 * i + 3) % vocab for i in range(1, 12)]
    rows = [tuple((11 * i + 5) % vocab for i in range(1, 6)), tuple((13 * i + 1) % vocab for i in range(1, 4))]
    ids = tuple(range(0, vocab, max(1, vocab // 64)))
    whole = [_gathered(model(input_ids=torch.tensor([prompt + list(row)], device=device)).logits, ids) for row in rows]
    return CheckCase(prompt, rows, ids, whole)


@torch.inference_mode()
def rounding_floor(model: Any, device: torch.device, case: CheckCase) -> float:
    """How far the model's own code disagrees with itself in this dtype: the case's rows read after
    the prompt through the model's KV cache, against the same text in one pass. Both are exact in
    arithmetic; in float32 they agree to ~1e-5, in bfloat16 to a few tenths, which a layout's
    reading cannot beat. A wrong mask or position moves log-probs by more than 1.
    """
    cached = []
    for row in case.rows:
        head = model(input_ids=torch.tensor([case.prompt], device=device), use_cache=True)
        after = model(input_ids=torch.tensor([list(row)], device=device), cache=head.cache, use_cache=True)
        cached.append(_gathered(after.logits, case.ids))
    return case.gap(cached)


def choose_layout(
    backend: Backend, requested: str, check: Callable[[], float], floor: Callable[[], float], model_type: str
) -> RowLayout:
    """The first layout of ``requested`` (``auto``: packed, then copies) whose ``check()`` (the
    backend's reading against the whole pass, with ``backend.row_layout`` set to it) is within
    ``LAYOUT_TOLERANCE``, or within it plus twice ``floor()`` (this dtype's own rounding, measured
    only when a layout misses the float32 bound); a ``BackendError`` when none is.
    """
    layouts: tuple[RowLayout, ...] = ("packed", "copies")
    candidates = layouts if requested == "auto" else tuple(layout for layout in layouts if layout == requested)
    if not candidates:
        raise ValueError(f"row_layout must be 'auto', 'packed' or 'copies', got {requested!r}")
    tolerance: float | None = None  # measured only when a layout misses the float32 bound
    for layout in candidates:
        backend.row_layout = layout
        error = check()
        if error <= LAYOUT_TOLERANCE:
            return layout
        if tolerance is None:
            tolerance = LAYOUT_TOLERANCE + 2 * floor()
        if error <= tolerance:
            logger.info("row layout %r is within %.2e of a full pass, this dtype's rounding", layout, error)
            return layout
        logger.warning("row layout %r disagrees with a full forward pass by %.2e", layout, error)
    raise BackendError(f"no row layout of {model_type!r} matches its full forward pass")


@torch.inference_mode()
def self_check(backend: Backend, case: CheckCase) -> float:
    """Max |log-prob| difference between the case's rows scored by ``backend`` in its layout and the
    whole pass over the same text; the backend's pass counter is left as it was.
    """
    saved = backend.counter.forward_passes, backend.counter.tokens_read
    # the packed layout reads the prompt's end as a trunk, so the check covers trunks too
    cut = 6 if backend.packs_trunk else len(case.prompt)
    prefix = backend.prefill(case.prompt[:cut])
    queries = [Query(r, len(row) - 1, case.ids) for r, row in enumerate(case.rows)]
    scored, _ = backend._score_chunk(prefix, tuple(case.prompt[cut:]), pack_tree(case.rows), queries)
    backend.counter.forward_passes, backend.counter.tokens_read = saved
    return case.gap(scored)
