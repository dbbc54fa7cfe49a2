"""The reference the torch backend's load-time layout check compares with: the model's own passes.

A row layout (``packed`` or ``copies``) is accepted only if its log-probs match the model's plain
forward pass over the same text (``TorchBackend._choose_layout``). This module computes that plain
side, independent of any layout: ``whole_pass_case`` reads prompt + each row in one whole pass, and
``rounding_floor`` measures how far the model's own code disagrees with itself in its dtype (the
rows read after the prompt through its KV cache), which sets the tolerance in 16-bit dtypes. Only
``torch_backend`` imports it, after checking that torch is installed; ``tests/test_torch_backend.py``
and ``tests/test_dummy_weights.py`` load backends that pass the check.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch  # only ``torch_backend`` imports this module, after checking that torch is there


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
