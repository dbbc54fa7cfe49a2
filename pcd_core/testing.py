"""Test tools any suite can reuse: an oracle LM, a byte tokenizer, and the backend conformance check.

``OracleBackend`` is a deterministic fake causal LM: its logits are a hash of the last few tokens,
plus scripted boosts, so a brute-force reference can recompute any probability independently.
``ByteTokenizer`` spells text one UTF-8 byte per token, which makes every label a deep trie path.
``check_backend`` proves the backend contract of ``backends/base.py`` for any backend.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pcd_core.backends.base import Backend, GrowStep, Prefix, Query, Rows
from pcd_core.backends.packing import TokenTree, plan_chunks
from pcd_core.tokenizer import TextTokenizer

if TYPE_CHECKING:
    from pcd_core.engine import Engine


class OracleBackend(Backend):
    """Logits are a function of the last ``window`` tokens; ``boosts`` adds scripted preferences:
    ``{context_suffix_ids: {token: bonus}}`` applies when the context ends with that suffix.

    With ``hidden_size``, the oracle also has hidden states (``state``): the mean of a fixed random
    direction per token of the whole context, a bag of tokens. Words in the input move it, so a trained
    head can be fitted and served on the oracle, without a model.
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
        max_pass_bytes: int | None = None,
        hidden_size: int | None = None,
    ) -> None:
        super().__init__(
            context_length=context_length, max_tokens_per_pass=max_tokens_per_pass, max_pass_bytes=max_pass_bytes
        )
        self._vocab = vocab_size
        self.window = window
        self.boosts = {tuple(k): dict(v) for k, v in (boosts or {}).items()}
        self.hidden_size = hidden_size
        self.reads_hidden = hidden_size is not None
        self._directions: dict[int, np.ndarray] = {}

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

    def state(self, context: Sequence[int]) -> np.ndarray:
        """The hidden state after ``context``: the mean of its tokens' fixed directions (float32)."""
        assert self.hidden_size is not None, "an oracle without hidden_size has no hidden states"
        total = np.zeros(self.hidden_size, dtype=np.float64)
        for token in context:
            if token not in self._directions:
                self._directions[token] = np.random.default_rng(token).normal(0.0, 1.0, self.hidden_size)
            total += self._directions[token]
        return (total / max(len(context), 1)).astype(np.float32)

    def _prefill(self, ids: tuple[int, ...], parent: Prefix | None, room: int = 0) -> tuple[int, ...]:
        return (parent.ids if parent is not None else ()) + ids

    def _score_chunk(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], tuple[int, ...] | None]:
        rows = tree.rows
        before = (prefix.ids if prefix is not None else ()) + trunk
        values = [self.logp(before + rows[q.row][: q.position + 1])[list(q.ids)] for q in queries]
        return values, (before if trunk else None)

    def _prefix_logp(self, prefix: Prefix) -> np.ndarray:
        return self.logp(prefix.ids)

    def _cut(self, prefix: Prefix, n_tokens: int) -> Prefix:
        return Prefix(prefix.ids[:n_tokens], state=prefix.ids[:n_tokens])  # the ids are the whole state

    def _score_chunk_hidden(
        self, prefix: Prefix | None, trunk: tuple[int, ...], tree: TokenTree, queries: list[Query]
    ) -> tuple[list[np.ndarray], tuple[int, ...] | None, list[np.ndarray]]:
        values, state = self._score_chunk(prefix, trunk, tree, queries)
        before = (prefix.ids if prefix is not None else ()) + trunk
        return values, state, [self.state(before + tree.rows[q.row][: q.position + 1]) for q in queries]

    def _prefix_hidden(self, prefix: Prefix) -> np.ndarray:
        return self.state(prefix.ids)


class _ByteVocabulary:
    """Just enough of a Hugging Face tokenizer for ``TextTokenizer``: UTF-8 bytes as token ids, and
    optional merges of byte pairs into one token id above 256, as a BPE merge would.
    """

    chat_template = None
    eos_token_id = 256
    unk_token_id = None

    def __init__(self, merges: Mapping[bytes, int] | None = None) -> None:
        self.merges = dict(merges or {})
        assert all(len(pair) == 2 and token > 256 for pair, token in self.merges.items())

    def token_bytes(self) -> list[bytes]:
        """The bytes of every id up to the highest merge: what a grammar engine masks over."""
        size = max([257, *(token + 1 for token in self.merges.values())])
        tokens = [bytes([i]) for i in range(256)] + [b"<eos>"] + [b"<unused>"] * (size - 257)
        for pair, token in self.merges.items():
            tokens[token] = pair
        return tokens

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        data, ids, k = text.encode("utf-8"), [], 0
        while k < len(data):
            merged = self.merges.get(data[k : k + 2])
            ids.append(data[k] if merged is None else merged)
            k += 1 if merged is None else 2
        return ids

    def decode(self, ids: list[int]) -> str:
        spelled = {token: pair for pair, token in self.merges.items()}
        return b"".join(spelled.get(i, bytes([i]) if i < 256 else b"") for i in ids).decode("utf-8", errors="replace")

    def convert_tokens_to_ids(self, token: str) -> None:
        return None


class ByteTokenizer(TextTokenizer):
    r"""``merges`` maps byte pairs to token ids above 256: ``{b"\n#": 257}`` makes an input that starts
    with ``#`` merge with a head that ends in a newline, the case the engine's head cache must bypass.
    """

    def __init__(self, merges: Mapping[bytes, int] | None = None) -> None:
        super().__init__(_ByteVocabulary(merges))


def oracle_engine(merges: Mapping[bytes, int] | None = None, **backend_options: Any) -> Engine:
    """An ``Engine`` over the oracle LM and byte tokenizer: fast, deterministic, model-free."""
    from pcd_core.engine import Engine

    return Engine(OracleBackend(**backend_options), ByteTokenizer(merges), "oracle")


def check_backend(backend: Backend, prompt: Sequence[int], rows: Sequence[Sequence[int]], atol: float = 1e-4) -> None:
    """Assert the backend contract on ``prompt`` and two or more ``rows`` (token ids of the model).

    A trunk must equal a prefill followed by a score (probabilities to 1e-5): the engine reads every
    request that way, and its results must not depend on it.
    """
    assert len(rows) >= 2 and all(rows), "check_backend needs at least two non-empty rows"
    assert len(prompt) >= 4, "check_backend needs a prompt of four tokens or more"
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
    assert batched.prefix is whole, "a score without a trunk must hand back its own prefix"
    np.testing.assert_allclose(backend.next_logp(whole), snapshot, atol=0, err_msg="score changed the prefix")
    for k, query in enumerate(queries):
        single = backend.score(whole, [rows[query.row]], [Query(0, query.position, ids)]).values[0]
        np.testing.assert_allclose(batched.values[k], single, atol=atol, err_msg="batched rows differ from single rows")
        extended = backend.prefill(rows[query.row][: query.position + 1], parent=whole)
        np.testing.assert_allclose(
            batched.values[k],
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
    for got, want in zip(chunked.values, batched.values):
        np.testing.assert_allclose(got, want, atol=atol, err_msg="chunking changed a result")
    _check_trunk(backend, prompt, rows, queries, atol)
    _check_cut(backend, prompt, rows, queries, atol)
    if backend.reads_hidden:
        _check_hidden(backend, whole, rows, queries, batched.values, atol)

    full = backend.next_logp(whole)
    total = float(np.logaddexp.reduce(full))
    assert abs(total) < 1e-3, f"log-probs are not normalised: logsumexp = {total}"
    assert full.shape == (backend.vocab_size,), f"next_logp has shape {full.shape}, not the vocabulary"


def _check_hidden(
    backend: Backend,
    whole: Prefix,
    rows: list[tuple[int, ...]],
    queries: list[Query],
    values: list[np.ndarray],
    atol: float,
) -> None:
    """Hidden states come from the same reads as the log-probs: asking for them changes no value and
    no pass count, and the state at each query equals the one after the same tokens read as a prefix.
    """
    before = backend.forward_passes
    backend.score(whole, rows, queries)
    plain, before = backend.forward_passes - before, backend.forward_passes
    read = backend.score(whole, rows, queries, hidden=True)
    assert backend.forward_passes - before == plain, "hidden states cost a pass of their own"
    assert read.hidden is not None and len(read.hidden) == len(queries)
    for got, want in zip(read.values, values):
        np.testing.assert_allclose(got, want, atol=atol, err_msg="asking for hidden states changed a log-prob")
    width = read.hidden[0].shape
    for k, query in enumerate(queries):
        assert read.hidden[k].shape == width and np.all(np.isfinite(read.hidden[k]))
        extended = backend.prefill(rows[query.row][: query.position + 1], parent=whole, hidden=True)
        alone = backend.score(extended, [rows[0]], [Query(0, -1, (0,))], hidden=True).hidden
        assert alone is not None
        np.testing.assert_allclose(
            read.hidden[k], alone[0], rtol=1e-3, atol=atol, err_msg="a hidden state differs from the row read alone"
        )


def _check_trunk(
    backend: Backend, prompt: Sequence[int], rows: list[tuple[int, ...]], queries: list[Query], atol: float
) -> None:
    """A trunk read with the rows equals the trunk prefilled, then the rows scored after it.

    Log-probs must agree to ``atol``, probabilities to 1e-5: in float32 a different pass shape
    reorders sums, which moves the log-prob of a token at -12 nats by about 2e-5, and the engine's
    results are probabilities.
    """
    ids = queries[0].ids
    half = len(prompt) // 2
    parent = backend.prefill(prompt[:half])
    prefilled = backend.prefill(prompt[half:], parent=parent)
    reference = backend.score(prefilled, rows, queries).values + [backend.next_logp(prefilled)[list(ids)]]
    # a trunk on a prefix in one pass, and the whole prompt as a trunk on nothing, one row per pass
    for prefix, trunk, limit in ((parent, tuple(prompt[half:]), backend.max_tokens_per_pass), (None, tuple(prompt), 1)):
        saved, passes = backend.max_tokens_per_pass, backend.forward_passes
        backend.max_tokens_per_pass = limit
        try:
            scored = backend.score(prefix, rows, queries + [Query(0, -1, ids)], trunk=trunk)
        finally:
            backend.max_tokens_per_pass = saved
        where = f"a trunk of {len(trunk)} tokens on {'a prefix' if prefix else 'nothing'}, chunk limit {limit}"
        if len(plan_chunks(rows, limit)) == 1 and backend.packs_trunk:
            assert backend.forward_passes - passes == 1, f"{where}: a trunk and its rows are not one pass"
        for got, want in zip(scored.values, reference, strict=True):
            np.testing.assert_allclose(
                got, want, atol=atol, err_msg=f"{where}: a log-prob differs from prefill + score"
            )
            np.testing.assert_allclose(np.exp(got), np.exp(want), atol=1e-5, err_msg=f"{where}: a probability differs")
        assert scored.prefix.ids == tuple(prompt), f"{where}: the extended prefix has the wrong ids"
        # the kept KV must serve a later pass as a prefilled prefix does
        later = backend.score(scored.prefix, rows, queries[:1]).values[0]
        np.testing.assert_allclose(later, reference[0], atol=atol, err_msg=f"{where}: the extended prefix differs")
    assert (parent.ids, prefilled.ids) == (tuple(prompt[:half]), tuple(prompt)), "a trunk changed its prefix"


def _check_cut(
    backend: Backend, prompt: Sequence[int], rows: list[tuple[int, ...]], queries: list[Query], atol: float
) -> None:
    """A prefix cut inside the trunk a pass read (as a session keeps its conversation), or inside a
    prefill, is that start of the prompt prefilled: the same probabilities after it and after rows
    read from it, a later prefill from it included, for no pass; the prefix it was cut from is
    unchanged. Probabilities, not log-probs: llama.cpp's batch shapes move a log-prob at -12 nats by
    0.2 to 0.5 between two prefills of the same tokens, and a probability there by 1e-5.
    """
    tolerance = min(atol, 0.05)
    ids = queries[0].ids
    first = backend.prefill(prompt[:1])
    scored = backend.score(first, rows, queries, trunk=tuple(prompt[1:]))
    after_scored = backend.score(scored.prefix, rows, queries).values
    prefilled = backend.prefill(prompt)
    for source, n in ((scored.prefix, len(prompt) // 2), (scored.prefix, len(prompt) - 1), (prefilled, 2)):
        passes = backend.forward_passes
        cut = backend.cut(source, n)
        assert backend.forward_passes == passes, f"a cut to {n} of {source.n_tokens} tokens read a pass"
        assert cut.ids == tuple(prompt[:n])
        reference = backend.prefill(prompt[:n])
        np.testing.assert_allclose(
            np.exp(backend.next_logp(cut)[list(ids)]),
            np.exp(backend.next_logp(reference)[list(ids)]),
            atol=tolerance,
            err_msg=f"after a cut to {n} tokens, a probability differs from the prefill",
        )
        for got, want in zip(backend.score(cut, rows, queries).values, backend.score(reference, rows, queries).values):
            np.testing.assert_allclose(
                np.exp(got), np.exp(want), atol=tolerance, err_msg=f"rows after a cut to {n} tokens differ"
            )
        grown = backend.prefill(prompt[n:], parent=cut)
        np.testing.assert_allclose(
            np.exp(backend.next_logp(grown)),
            np.exp(backend.next_logp(prefilled)),
            atol=tolerance,
            err_msg=f"a prefill after a cut to {n} tokens differs from the whole prompt's",
        )
    for got, want in zip(backend.score(scored.prefix, rows, queries).values, after_scored):
        np.testing.assert_allclose(got, want, atol=0, err_msg="a cut changed the prefix it was cut from")


def check_grow(
    backend: Backend,
    prompt: Sequence[int],
    steps: Sequence[Sequence[Sequence[int]]],
    atol: float = 1e-4,
    room: int = 0,
    trunk: Sequence[int] = (),
) -> None:
    """Assert that ``grow`` over several steps equals a plain prefill of each row after the prompt.

    ``steps[s][i]`` are the tokens row ``i`` gains at step ``s`` (empty: the row is not read then).
    The prompt is read with ``room`` (``Backend.prefill``); a ``trunk`` is read by the first step,
    and the rows must then equal prefills after prompt + trunk.
    """
    prefix = backend.prefill(prompt, room=0 if trunk else room)
    snapshot = backend.next_logp(prefix)
    start = prefix
    rows = None
    for new in steps:
        passes = backend.forward_passes
        if rows is None:
            rows = backend.grow(prefix, None, new, trunk=trunk, room=room)
            prefix = rows.prefix
        else:
            rows = backend.grow(prefix, rows, new)
        assert backend.forward_passes - passes <= (1 if backend.max_tokens_per_pass is None else len(new)), (
            "grow took more than one pass for one step"
        )
        for i, tokens in enumerate(new):
            if not tokens:
                assert rows.logp[i] is None, "a row without new tokens was read"
                continue
            want = backend.next_logp(backend.prefill(tuple(trunk) + rows.ids[i], parent=start))
            got = rows.logp[i]
            assert got is not None
            np.testing.assert_allclose(got, want, atol=atol, err_msg=f"grown row {i} differs from a prefill")
    np.testing.assert_allclose(backend.next_logp(start), snapshot, atol=0, err_msg="grow changed the prefix")
    if trunk:
        want = backend.next_logp(backend.prefill(trunk, parent=start))
        np.testing.assert_allclose(backend.next_logp(prefix), want, atol=atol, err_msg="the trunk's prefix differs")


def check_grow_many(
    backend: Backend,
    prompts: Sequence[Sequence[int]],
    steps: Sequence[Sequence[Sequence[Sequence[int]] | None]],
    atol: float = 1e-4,
    joins: bool = True,
) -> None:
    """Assert that ``grow_many`` reads each generation as its own ``grow`` would: every row equals a
    plain prefill of it after its own prompt.

    ``steps[s][g]`` are the new tokens of generation ``g``'s rows at step ``s``, or None where that
    generation is not stepped (it has not started, or it sits this step out). With ``joins``, every
    step that reads a token costs one pass, whatever the number of generations in it; else one per
    generation with a new token (the base class).
    """
    prefixes = [backend.prefill(prompt) for prompt in prompts]
    snapshots = [backend.next_logp(prefix) for prefix in prefixes]
    rows: list[Rows | None] = [None] * len(prompts)
    for step in steps:
        stepped = [g for g, new in enumerate(step) if new is not None]
        growing = [GrowStep(prefixes[g], rows[g], tuple(tuple(n) for n in step[g] or ())) for g in stepped]
        reading = sum(1 for g in stepped if any(step[g] or ()))
        passes = backend.forward_passes
        grown = backend.grow_many(growing)
        want_passes = min(reading, 1) if joins else reading
        assert backend.forward_passes - passes == want_passes, (
            f"grow_many took {backend.forward_passes - passes} passes for {reading} generations, not {want_passes}"
        )
        for g, result in zip(stepped, grown, strict=True):
            rows[g] = result
            for i, tokens in enumerate(step[g] or ()):
                if not tokens:
                    assert result.logp[i] is None, "a row without new tokens was read"
                    continue
                want = backend.next_logp(backend.prefill(result.ids[i], parent=prefixes[g]))
                got = result.logp[i]
                assert got is not None
                np.testing.assert_allclose(got, want, atol=atol, err_msg=f"generation {g}, row {i} differs")
    for prefix, snapshot in zip(prefixes, snapshots):
        np.testing.assert_allclose(backend.next_logp(prefix), snapshot, atol=0, err_msg="grow_many changed a prefix")
