"""Test tools any suite can reuse: an oracle LM, a byte tokenizer, and the backend conformance check.

``OracleBackend`` is a deterministic fake causal LM: its logits are a hash of the last few tokens,
plus scripted boosts, so a brute-force reference can recompute any probability independently.
``ByteTokenizer`` spells text one UTF-8 byte per token, which makes every label a deep trie path.
``check_backend`` proves the backend contract of ``backends/base.py`` for any backend.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .backends.base import Backend, Prefix, Query, TokenTree
from .tokenizer import TextTokenizer


class OracleBackend(Backend):
    """Logits are a function of the last ``window`` tokens; ``boosts`` adds scripted preferences:
    ``{context_suffix_ids: {token: bonus}}`` applies when the context ends with that suffix.
    """

    name = "oracle"

    def __init__(
        self,
        vocab_size: int = 300,
        *,
        window: int = 3,
        boosts: Mapping[tuple[int, ...], Mapping[int, float]] | None = None,
        context_length: int = 4096,
        max_tokens_per_pass: int | None = None,
    ) -> None:
        super().__init__(context_length=context_length, max_tokens_per_pass=max_tokens_per_pass)
        self._vocab = vocab_size
        self.window = window
        self.boosts = {tuple(k): dict(v) for k, v in (boosts or {}).items()}

    @property
    def vocab_size(self) -> int:
        return self._vocab

    def logits(self, context: Sequence[int]) -> np.ndarray:
        recent = bytes(str(tuple(context[-self.window :])), "ascii")
        seed = int.from_bytes(hashlib.sha256(recent).digest()[:8], "little")
        values = np.random.default_rng(seed).normal(0.0, 2.0, self._vocab)
        for suffix, bonus in self.boosts.items():
            if tuple(context[-len(suffix) :]) == suffix:
                for token, amount in bonus.items():
                    values[token] += amount
        return values

    def logp(self, context: Sequence[int]) -> np.ndarray:
        values = self.logits(context)
        top = values.max()
        return values - top - np.log(np.exp(values - top).sum())

    def _prefill(self, ids: tuple[int, ...], parent: Prefix | None) -> tuple[int, ...]:
        return (parent.ids if parent is not None else ()) + ids

    def _score_chunk(self, prefix: Prefix, tree: TokenTree, queries: list[Query]) -> list[np.ndarray]:
        rows = tree.rows
        return [self.logp(prefix.ids + rows[q.row][: q.position + 1])[list(q.ids)] for q in queries]

    def _prefix_logp(self, prefix: Prefix) -> np.ndarray:
        return self.logp(prefix.ids)


class _ByteVocabulary:
    """Just enough of a Hugging Face tokenizer for ``TextTokenizer``: UTF-8 bytes as token ids."""

    chat_template = None
    eos_token_id = 256
    unk_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def convert_tokens_to_ids(self, token: str) -> None:
        return None


class ByteTokenizer(TextTokenizer):
    def __init__(self) -> None:
        super().__init__(_ByteVocabulary())


def oracle_engine(**backend_options: Any):
    """An ``Engine`` over the oracle LM and byte tokenizer: fast, deterministic, model-free."""
    from .engine import Engine

    return Engine(OracleBackend(**backend_options), ByteTokenizer(), "oracle")


def check_backend(backend: Backend, prompt: Sequence[int], rows: Sequence[Sequence[int]], atol: float = 1e-4) -> None:
    """Assert the backend contract on ``prompt`` and two or more ``rows`` (token ids of the model)."""
    assert len(rows) >= 2 and all(rows), "check_backend needs at least two non-empty rows"
    # one more row that starts like the first, so that a packed pass merges their shared token
    rows = [tuple(row) for row in rows] + [tuple(rows[0][:1]) + tuple(rows[1])]
    ids = tuple(sorted({int(t) for row in rows for t in row} | {0, 1}))
    half = len(prompt) // 2
    whole = backend.prefill(prompt)
    parent = backend.prefill(prompt[:half])
    before = backend.next_logp(parent)
    child = backend.prefill(prompt[half:], parent=parent)
    np.testing.assert_allclose(
        backend.next_logp(child),
        backend.next_logp(whole),
        atol=atol,
        err_msg="a prefix extension differs from one prefill",
    )
    np.testing.assert_allclose(backend.next_logp(parent), before, atol=0, err_msg="prefill changed its parent")
    assert parent.ids == tuple(prompt[:half])

    queries = [Query(r, p, ids) for r, row in enumerate(rows) for p in range(len(row))]
    snapshot = backend.next_logp(whole)
    batched = backend.score(whole, rows, queries)
    np.testing.assert_allclose(backend.next_logp(whole), snapshot, atol=0, err_msg="score changed the prefix")
    for k, query in enumerate(queries):
        single = backend.score(whole, [rows[query.row]], [Query(0, query.position, ids)])[0]
        np.testing.assert_allclose(batched[k], single, atol=atol, err_msg="batched rows differ from single rows")
        extended = backend.prefill(rows[query.row][: query.position + 1], parent=whole)
        np.testing.assert_allclose(
            batched[k],
            backend.next_logp(extended)[list(ids)],
            atol=atol,
            err_msg="a query does not read the position it names",
        )

    saved = backend.max_tokens_per_pass
    backend.max_tokens_per_pass = 1
    try:
        chunked = backend.score(whole, rows, queries)
    finally:
        backend.max_tokens_per_pass = saved
    for got, want in zip(chunked, batched):
        np.testing.assert_allclose(got, want, atol=atol, err_msg="chunking changed a result")

    full = backend.next_logp(whole)
    total = float(np.logaddexp.reduce(full))
    assert abs(total) < 1e-3, f"log-probs are not normalised: logsumexp = {total}"
    assert full.shape == (backend.vocab_size,), f"next_logp has shape {full.shape}, not the vocabulary"


def check_grow(
    backend: Backend, prompt: Sequence[int], steps: Sequence[Sequence[Sequence[int]]], atol: float = 1e-4
) -> None:
    """Assert that ``grow`` over several steps equals a plain prefill of each row after the prompt.

    ``steps[s][i]`` are the tokens row ``i`` gains at step ``s`` (empty: the row is not read then).
    """
    prefix = backend.prefill(prompt)
    snapshot = backend.next_logp(prefix)
    rows = None
    for new in steps:
        passes = backend.forward_passes
        rows = backend.grow(prefix, rows, new)
        assert backend.forward_passes - passes <= (1 if backend.max_tokens_per_pass is None else len(new)), (
            "grow took more than one pass for one step"
        )
        for i, tokens in enumerate(new):
            if not tokens:
                assert rows.logp[i] is None, "a row without new tokens was read"
                continue
            want = backend.next_logp(backend.prefill(rows.ids[i], parent=prefix))
            got = rows.logp[i]
            assert got is not None
            np.testing.assert_allclose(got, want, atol=atol, err_msg=f"grown row {i} differs from a prefill")
    np.testing.assert_allclose(backend.next_logp(prefix), snapshot, atol=0, err_msg="grow changed the prefix")
