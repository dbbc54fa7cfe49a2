"""A pass read as a batch of groups (``packing.batch_groups``, ``torch_batched.batched_hidden``).

Many inputs' requests behind one template token pack into one subtree, and a packed pass's mask is
dense: each token attends over all of them. Read as a batch, each input's group attends over the
prefix and its own tokens only. The split is checked as a pure function of the tree and the price;
on the real model the batch must read what the packed sequence reads, and what each input reads
alone: probabilities to 1e-5 and log-probabilities to 1e-4 (fp32), on SmolLM2-135M and on Gemma 3
(sliding-window layers, a second mask). A later batch after the same prefix whose groups start with
the requests the last batch read takes their keys from the backend's ``StemMemo``: it reads fewer
tokens and the same values.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcd_core.backends import torch_batched
from pcd_core.backends.base import Query
from pcd_core.backends.packing import batch_groups, leading_chain, pack_tree

TOL = 1e-5  # probabilities, as the batch's acceptance asks
LOG_TOL = 1e-4  # log-probabilities, as pcd_core.testing.check_backend compares them
# three inputs behind the shared tokens 7, 8; each input's request ends in two answer rows
ROWS = [
    (7, 8, 10, 11, 12, 20),
    (7, 8, 10, 11, 12, 21, 22),
    (7, 8, 13, 14, 20),
    (7, 8, 13, 14, 21, 22),
    (7, 8, 15, 16, 17, 18, 20),
    (7, 8, 15, 16, 17, 18, 21, 22),
]


def padded(batch: int, width: int) -> float:
    """A price where a token's own work is nothing and attention is all: batches pay."""
    return batch * width * width


def test_inputs_behind_a_shared_start_part_where_their_texts_do():
    tree = pack_tree(ROWS)
    groups = batch_groups(tree, padded)
    tokens = [[tree.tokens[node] for node in group] for group in groups]
    # one group per input, each with the shared start copied in front; the answers stay together,
    # since parting them would read their input's request once per answer
    assert sorted(tokens) == sorted(
        [[7, 8, 10, 11, 12, 20, 21, 22], [7, 8, 13, 14, 20, 21, 22], [7, 8, 15, 16, 17, 18, 20, 21, 22]]
    )
    for group in groups:
        assert group == sorted(group)
        assert all(tree.parent[node] in group for node in group if tree.parent[node] >= 0), "ancestor-closed"
    assert set().union(*groups) == set(range(len(tree.tokens)))


def test_a_groups_leading_path_runs_from_its_root_to_its_first_branch():
    tree = pack_tree(ROWS)
    for group in batch_groups(tree, padded):
        length = leading_chain(tree, group)
        path = [tree.tokens[node] for node in group[:length]]
        assert path in ([7, 8, 10, 11, 12], [7, 8, 13, 14], [7, 8, 15, 16, 17, 18]), "the request, up to its answers"
    lone = pack_tree([(1, 2, 3)])
    assert leading_chain(lone, [0, 1, 2]) == 3 and leading_chain(lone, [1, 2]) == 0  # no root: no path
    assert leading_chain(lone, []) == 0


def test_a_price_on_every_token_read_keeps_one_sequence():
    tree = pack_tree(ROWS)
    groups = batch_groups(tree, lambda batch, width: batch * width * (10**6 + width))
    assert groups == [list(range(len(tree.tokens)))]


def test_rows_that_never_branch_stay_one_group():
    tree = pack_tree([(1, 2, 3, 4)])
    assert batch_groups(tree, padded) == [[0, 1, 2, 3]]


def _reads(engine, monkeypatch, token_cost, prefix, rows, queries, fresh=True):
    """One ``score`` at a token price: its values, passes and tokens counted. ``fresh`` forgets the
    requests an earlier batch kept (``StemMemo``), so the read computes every token itself.
    """
    monkeypatch.setattr(torch_batched, "TOKEN_COST_IN_KEYS", token_cost)
    backend = engine.backend
    if fresh:
        backend._stems = None
    passes, read = backend.counter.forward_passes, backend.counter.tokens_read
    values = backend.score(prefix, rows, queries).values
    return values, backend.counter.forward_passes - passes, backend.counter.tokens_read - read


@pytest.mark.parametrize("which", ["engine", "gemma_engine"])
def test_a_batch_of_groups_reads_what_one_packed_sequence_and_each_input_alone_read(which, request, monkeypatch):
    engine = request.getfixturevalue(which)
    encode = engine.tokenizer.encode
    prefix = engine.backend.prefill(encode("Classify each review as positive or negative.\nReview:"))
    texts = [" The plot was thin but the actors", " The soundtrack alone", " The worst film I have seen this year"]
    stems = [tuple(encode(text + "\nSentiment:")) for text in texts]
    answers = [tuple(encode(" positive")), tuple(encode(" negative"))]
    rows = [stem + answer for stem in stems for answer in answers]
    queries = [Query(r, p, tuple(range(50))) for r, row in enumerate(rows) for p in range(len(row))]
    tree = pack_tree(rows)
    assert len(batch_groups(tree, padded)) == len(texts), "the inputs share their first token and part after"

    batched, batched_passes, batched_read = _reads(engine, monkeypatch, 0, prefix, rows, queries)
    packed, packed_passes, packed_read = _reads(engine, monkeypatch, 10**9, prefix, rows, queries)
    assert batched_passes == packed_passes == 1
    # the batch reads the inputs' shared first token once per input: the counter charges what it reads
    assert packed_read == len(tree.tokens)
    assert batched_read == len(tree.tokens) + len(texts) - 1
    for k, (a, b) in enumerate(zip(batched, packed, strict=True)):
        assert_same(a, b, str(queries[k]))
    for i in range(len(texts)):  # each input's two rows alone
        mine = [k for k, q in enumerate(queries) if q.row in (2 * i, 2 * i + 1)]
        local = [Query(queries[k].row - 2 * i, queries[k].position, queries[k].ids) for k in mine]
        alone, _, _ = _reads(engine, monkeypatch, 0, prefix, rows[2 * i : 2 * i + 2], local)
        for k, value in zip(mine, alone, strict=True):
            assert_same(batched[k], value, str(queries[k]))


def assert_same(got, expected, where):
    np.testing.assert_allclose(got, expected, atol=LOG_TOL, err_msg=where)
    np.testing.assert_allclose(np.exp(got), np.exp(expected), atol=TOL, err_msg=where)


@pytest.mark.parametrize("which", ["engine", "gemma_engine"])
def test_a_later_batch_takes_the_requests_the_last_one_read_and_reads_the_same(which, request, monkeypatch):
    """The second round of a batch: every input's request again, with other rows after it. Read after
    the first round, it reads only the rows; read with the memo cleared, or each input alone, it
    reads the same values. A batch after another prefix takes nothing.
    """
    engine = request.getfixturevalue(which)
    backend, encode = engine.backend, engine.tokenizer.encode
    prefix = backend.prefill(encode("Classify each review as positive or negative.\nReview:"))
    texts = [" The plot was thin but the actors", " The soundtrack alone", " The worst film I have seen this year"]
    stems = [tuple(encode(text + "\nSentiment:")) for text in texts]
    first = [stem + answer for stem in stems for answer in (tuple(encode(" positive")), tuple(encode(" negative")))]
    later = [stem + tuple(encode(word)) for stem in stems for word in (" great", " awful", " fine")]
    queries = [Query(r, p, tuple(range(50))) for r, row in enumerate(later) for p in range(len(row))]
    _reads(engine, monkeypatch, 0, prefix, first, [Query(r, len(row) - 1, (1,)) for r, row in enumerate(first)])
    assert backend._stems is not None and len(backend._stems.stems) == len(texts)
    kept, kept_passes, kept_read = _reads(engine, monkeypatch, 0, prefix, later, queries, fresh=False)
    fresh, fresh_passes, fresh_read = _reads(engine, monkeypatch, 0, prefix, later, queries)
    assert kept_passes == fresh_passes == 1
    # each input's request, up to the token before its rows part, is taken from the first round
    assert fresh_read - kept_read == sum(len(stem) for stem in stems)
    for k, (a, b) in enumerate(zip(kept, fresh, strict=True)):  # queries inside the requests included
        assert_same(a, b, str(queries[k]))
    for i in range(len(texts)):  # each input's rows alone, packed and computed whole
        mine = [k for k, q in enumerate(queries) if 3 * i <= q.row < 3 * i + 3]
        local = [Query(queries[k].row - 3 * i, queries[k].position, queries[k].ids) for k in mine]
        alone, _, _ = _reads(engine, monkeypatch, 10**9, prefix, later[3 * i : 3 * i + 3], local)
        for k, value in zip(mine, alone, strict=True):
            assert_same(kept[k], value, str(queries[k]))
    other = backend.prefill(encode("Classify each review as positive or negative, briefly.\nReview:"))
    _reads(engine, monkeypatch, 0, prefix, first, [Query(r, len(row) - 1, (1,)) for r, row in enumerate(first)])
    _, _, other_read = _reads(engine, monkeypatch, 0, other, later, queries, fresh=False)
    assert other_read == fresh_read  # the memo's requests followed another prefix: nothing taken
