"""The PyTorch backend: any ``transformers`` causal LM, on CPU or CUDA.

``TorchBackend`` is the class users and tests load; it puts the backend contract together from
modules that each hold one idea:

- ``torch_passes.py``: the model and the one decoder pass every read makes (caches over a prefix,
  the additive masks, the output head), and prefill;
- ``torch_packed.py``: rows after a prefix read as one sequence under a tree-shaped mask, sharing
  the prefix KV without a copy per row;
- ``torch_batched.py``: rows read as a batch instead, where many inputs' groups cost less that way,
  keeping each input's request for the batch's next round (``StemMemo``), and the ``copies`` layout;
- ``torch_generation.py``: generation, each step reading only its new tokens into an arena, and
  several generations' steps joined in one pass;
- ``torch_check.py``: the load-time check that picks the row layout the model reads correctly;
- ``torch_cache.py``: the ``transformers`` cache layers all of them read the prefix's tensors through.

This module is the only one of them that checks that torch is installed, and it does so before it
imports the others. On CUDA the default dtype is bfloat16 (``default_dtype``), as GPU serving runs.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np

from pcd_core.backends.base import Growth, LayoutChoice, Prefix, Query, Rows
from pcd_core.backends.packing import TokenTree
from pcd_core.errors import BackendUnavailableError

try:
    import torch
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise BackendUnavailableError("torch", error.name or "torch") from error

# they need torch, imported above
from pcd_core.backends.torch_batched import pass_groups, reused_stems
from pcd_core.backends.torch_cache import TorchState
from pcd_core.backends.torch_check import CheckCase, choose_layout, rounding_floor, self_check, whole_pass_case
from pcd_core.backends.torch_generation import grow, grow_many, joins, route_attention
from pcd_core.backends.torch_packed import read_chunk
from pcd_core.backends.torch_passes import TorchPasses


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA, as GPU serving runs; float32 elsewhere. A CPU with AMX reads wide passes
    (batches, a long request) faster in bfloat16, but a one-token step slower, and bfloat16 rounding
    moves log-probabilities by tenths; the CPU figures in the docs are float32 unless they say so.
    """
    return torch.bfloat16 if device.type == "cuda" else torch.float32


class TorchBackend(TorchPasses):
    name = "torch"
    reads_hidden = True  # the final state (the LM head's input) and the middle layers' mean (base.py)
    hidden_parts = ("final", "middle")

    def __init__(
        self, model: Any, *, max_tokens_per_pass: int | None = None, row_layout: LayoutChoice = "auto"
    ) -> None:
        super().__init__(model, max_tokens_per_pass=max_tokens_per_pass)
        self._checked: CheckCase | None = None
        self._joins = route_attention(model)
        # the self-check's passes, on the thread every later pass runs on (``model_thread.py``)
        self.row_layout = self._on_model_thread(
            partial(choose_layout, self, row_layout, self._self_check, self._rounding_floor, model.config.model_type)
        )

    # -- scoring (``torch_packed.py``, ``torch_batched.py``) -------------------------------------
    def _score_chunk(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], TorchState | None]:
        values, state, _ = read_chunk(self, prefix, trunk, tree, queries, keep_hidden=False)
        return values, state

    def _score_chunk_hidden(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], TorchState | None, list[np.ndarray]]:
        return read_chunk(self, prefix, trunk, tree, queries, keep_hidden=True)

    def pass_tokens(self, prefix: Prefix | None, n_trunk: int, tree: TokenTree) -> int:
        """As the base class counts, or for a batch of groups each group's tokens (a shared
        ancestor once per group that holds it) less those whose keys it takes from ``StemMemo``.
        """
        groups = pass_groups(self, prefix.n_tokens if prefix is not None else 0, n_trunk, tree, prefix)
        if groups is None or prefix is None:
            return super().pass_tokens(prefix, n_trunk, tree)
        return sum(len(nodes) - n for nodes, (_, n) in zip(groups, reused_stems(self, prefix, tree, groups)))

    def pass_bytes(self, n_context: int, n_trunk: int, tree: TokenTree) -> int:
        """As the base class estimates, or for a batch of groups (``pass_groups``) what that batch holds."""
        groups = pass_groups(self, n_context, n_trunk, tree)
        if groups is None:
            return super().pass_bytes(n_context, n_trunk, tree)
        return self._batch_bytes(len(groups), max(map(len, groups)), n_context)

    # -- growing rows (``torch_generation.py``) ----------------------------------------------------
    def _grow(
        self,
        prefix: Prefix,
        rows: Rows | None,
        extended: tuple[tuple[int, ...], ...],
        n_new: list[int],
        trunk: tuple[int, ...] = (),
        room: int = 0,
    ) -> Rows:
        """The packed layout reads only each row's new tokens (``torch_generation.grow``); the copies
        layout re-reads the rows as the base class does.
        """
        if self.row_layout != "packed":
            return super()._grow(prefix, rows, extended, n_new, trunk, room)
        return grow(self, prefix, rows, extended, n_new, trunk, room)

    def _grow_many(self, growths: list[Growth]) -> list[Rows]:
        """Several generations' steps in one pass (``torch_generation.grow_many``). Steps whose rows
        share an arena, the copies layout, and a model whose attention is not routed
        (``route_attention``) take one pass each.
        """
        if not self._joins or self.row_layout != "packed" or not joins(growths):
            return super()._grow_many(growths)
        return grow_many(self, growths)

    # -- self-check (``torch_check.py``) ----------------------------------------------------------
    def _check_case(self) -> CheckCase:
        """The self-check's text and the model's whole pass over it, read once per backend: every
        layout tried, and the rounding floor, compare with the same whole pass.
        """
        if self._checked is None:
            self._checked = whole_pass_case(self.model, self.device, self._vocab)
        return self._checked

    def _rounding_floor(self) -> float:
        """How far the model's own code disagrees with itself in its dtype (``torch_check.rounding_floor``)."""
        return rounding_floor(self.model, self.device, self._check_case())

    def _self_check(self) -> float:
        """Max |log-prob| difference between scored rows and a plain forward pass over the same text."""
        return self_check(self, self._check_case())
