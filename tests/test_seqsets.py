"""Packed rows as llama.cpp sequence sets (``pcd_core/backends/seqsets.py``), checked without llama.cpp.

An oracle builds the expected sequence set of every tree node from the rows' own paths (not from
the tree's parent links, which the layout walks), and llama.cpp's masking rule (a query sees a cell
that holds its first sequence id, at a position not after its own) applied to the layout must give
exactly the tree mask of ``TokenTree.with_trunk``. The batch checks llama.cpp makes before a decode
(each sequence's positions continuous and not decreasing) are replayed here too.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcd_core.backends.base import Query
from pcd_core.backends.packing import pack_tree, plan_chunks
from pcd_core.backends.seqsets import BatchLayout, grow_layout, leaves, pass_layout
from pcd_core.testing import OracleBackend

# a deep trie: a 6-deep path, branches at depths 1, 2 and 3, a row inside another row's path, a
# duplicate row, and a row with a root of its own
DEEP_ROWS = [(1, 2, 3, 4, 5, 6), (1, 2, 3, 7), (1, 2, 8, 9), (1, 10), (1, 2, 3), (1, 2, 8, 9), (11, 12)]
TRUNK = (20, 21, 22)
N_PREFIX = 31


def expected_sets(rows, tree, leaf_seq):
    """Oracle: a node's sequences are those of the leaf rows whose own path passes through it."""
    paths = [tuple(tree.node_of[r]) for r in range(len(rows))]
    ends = {path[-1] for path in paths if not any(len(o) > len(path) and o[: len(path)] == path for o in paths)}
    sets: list[set[int]] = [set() for _ in tree.tokens]
    for path in paths:
        if path[-1] in ends:
            for node in path:
                sets[node].add(leaf_seq[path[-1]])
    return sets


def check_llama_batch_rules(layout: BatchLayout, starts: dict[int, int]) -> None:
    """llama.cpp's llama_batch_allocr checks: per sequence, positions start right after what the
    sequence holds, are continuous, and never decrease in batch order.
    """
    seen: dict[int, list[int]] = {}
    for position, seqs in zip(layout.positions, layout.seq_ids):
        for seq in seqs:
            seen.setdefault(seq, []).append(position)
    for seq, positions in seen.items():
        assert positions == sorted(positions), f"sequence {seq}: positions decrease"
        assert positions[0] == starts[seq], f"sequence {seq} starts at {positions[0]}, not {starts[seq]}"
        assert positions == list(range(positions[0], positions[0] + len(positions))), f"sequence {seq}: a gap"


def test_deep_trie_gets_the_oracles_sequence_sets_and_the_tree_mask():
    tree = pack_tree(DEEP_ROWS)
    leaf_nodes = leaves(tree)
    leaf_seqs = [40 + k for k in range(len(leaf_nodes))]
    read = [tree.node_of[r][-1] for r in range(len(DEEP_ROWS))]
    layout = pass_layout(N_PREFIX, TRUNK, tree, leaf_seqs=leaf_seqs, trunk_seq=3, read_nodes=read)

    # one sequence per distinct leaf: the row inside another's path and the duplicate take none
    assert len(leaf_nodes) == 5
    want = expected_sets(DEEP_ROWS, tree, dict(zip(leaf_nodes, leaf_seqs)))
    n_trunk = len(TRUNK)
    for node, wanted in enumerate(want):
        got = layout.seq_ids[n_trunk + node]
        assert set(got) == wanted and len(got) == len(wanted), f"node {node}: {got} != {sorted(wanted)}"
    for k in range(n_trunk):
        assert set(layout.seq_ids[k]) == {3, *leaf_seqs}, "the trunk belongs to the prefix's and every leaf's"
    # llama.cpp's rule over the layout is the tree mask, both ways, for every pair of entries
    allowed = tree.with_trunk(n_trunk)
    n = len(layout.tokens)
    got_mask = np.array([[layout.sees(q, k) for k in range(n)] for q in range(n)])
    np.testing.assert_array_equal(got_mask, allowed)
    # the prefix's cells: every query's first sequence is one the prefix was copied into
    assert all(ids[0] in {3, *leaf_seqs} for ids in layout.seq_ids)
    # logits where asked: the trunk's end and each row's last node
    assert [k for k, flag in enumerate(layout.logits) if flag] == sorted({n_trunk - 1, *(n_trunk + r for r in read)})
    check_llama_batch_rules(layout, {seq: N_PREFIX for seq in (3, *leaf_seqs)})


def test_siblings_share_positions():
    rows = [(5, 6, 7), (5, 6, 8), (5, 9, 10), (11, 12)]
    tree = pack_tree(rows)
    layout = pass_layout(N_PREFIX, (), tree, leaf_seqs=list(range(len(leaves(tree)))), trunk_seq=None, read_nodes=[])
    by_row = [[layout.positions[node] for node in tree.node_of[r]] for r in range(len(rows))]
    assert by_row == [[N_PREFIX, N_PREFIX + 1, N_PREFIX + 2]] * 3 + [[N_PREFIX, N_PREFIX + 1]]
    # the siblings 7 and 8 (and 6 and 9, and the roots 5 and 11) are different entries at one position
    assert tree.node_of[0][2] != tree.node_of[1][2] and tree.node_of[0][1] != tree.node_of[2][1]
    check_llama_batch_rules(layout, dict.fromkeys(range(len(leaves(tree))), N_PREFIX))


def test_layout_refuses_a_wrong_number_of_sequences():
    tree = pack_tree(DEEP_ROWS)
    with pytest.raises(ValueError, match="leaves"):
        pass_layout(0, TRUNK, tree, leaf_seqs=[1, 2], trunk_seq=0, read_nodes=[])
    with pytest.raises(ValueError, match="trunk"):
        pass_layout(0, TRUNK, tree, leaf_seqs=list(range(5)), trunk_seq=None, read_nodes=[])


def test_grow_layout_continues_each_row_in_its_own_sequence():
    layout = grow_layout(10, (7, 8), [4, 5, 6], [0, 0, 0], [(1, 2), (3,), ()], trunk_seq=9)
    assert layout.tokens == (7, 8, 1, 2, 3)
    assert layout.positions == (8, 9, 10, 11, 10)
    assert layout.seq_ids == ((9, 4, 5, 6), (9, 4, 5, 6), (4,), (4,), (5,))
    assert layout.logits == (False, True, False, True, True)
    later = grow_layout(10, (), [4, 5, 6], [2, 1, 0], [(3,), (), (4, 5)], trunk_seq=None)
    assert later.positions == (12, 10, 11) and later.seq_ids == ((4,), (6,), (6,))
    check_llama_batch_rules(later, {4: 12, 6: 10})


def test_a_pass_splits_at_the_row_limit_and_reads_the_same():
    rows = [(1, 2, 3), (1, 2, 4), (5, 6), (7,), (1, 8), (9, 9, 9)]
    chunks = plan_chunks(rows, None, max_rows=2)
    assert sorted(k for chunk in chunks for k in chunk) == list(range(len(rows)))
    assert all(1 <= len(chunk) <= 2 for chunk in chunks) and len(chunks) == 3
    assert plan_chunks(rows, None) == [list(range(len(rows)))]
    # through the backend contract: more passes, the same log-probs
    queries = [Query(r, len(row) - 1, (1, 2, 3)) for r, row in enumerate(rows)]
    one = OracleBackend()
    split = OracleBackend()
    split.max_rows_per_pass = 2
    whole = one.score(one.prefill([4, 5, 6]), rows, queries)
    prefix = split.prefill([4, 5, 6])
    passes = split.forward_passes
    parts = split.score(prefix, rows, queries)
    assert split.forward_passes - passes == 3
    for got, want in zip(parts.values, whole.values, strict=True):
        np.testing.assert_allclose(got, want, atol=0)
