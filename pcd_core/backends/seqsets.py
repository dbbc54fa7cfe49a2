"""Packed rows as llama.cpp sequence sets: the batch layout of one pass, as a pure function.

llama.cpp's KV cache lets one token belong to several sequences: a batch entry carries a list of
sequence ids and its KV cell keeps them all. A query token attends to every cell that holds the
*first* of its sequence ids at a position not after its own (``llama-kv-cache.cpp``,
``set_input_kq_mask``, reads ``ubatch->seq_id[i][0]``). So the tree mask of ``packing.TokenTree`` is a
choice of sequence sets:

- each leaf of the tree (a node with no child) is a sequence of its own;
- a tree node belongs to the sequences of every leaf below it, its own first: a leaf's sequence
  holds exactly the leaf's path, so a node sees its ancestors and never a sibling branch;
- the trunk belongs to every leaf's sequence, and to the sequence that keeps the extended prefix;
- the prefix's cells are given to every leaf's sequence before the pass (``llama_memory_seq_cp``,
  which only adds the id to existing cells) and taken back after it (``llama_memory_seq_rm``).

Positions are set per token: the trunk continues the prefix, and a tree node sits at the trunk's
end plus its depth, so siblings share positions. llama.cpp checks that each sequence's positions
in a batch are continuous and do not decrease; a node is packed after its parent, so each leaf's
path comes in order. A row that ends inside another row's path needs no sequence of its own, so
a pass needs one sequence per leaf, not per row; ``tests/test_llamacpp_backend.py`` checks these
layouts against the tree mask with an oracle, and a split of rows at the sequence limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pcd_core.backends.packing import TokenTree


@dataclass(frozen=True)
class BatchLayout:
    """One ``llama_decode`` batch: per entry its token, position, sequence ids and logits flag."""

    tokens: tuple[int, ...]
    positions: tuple[int, ...]
    seq_ids: tuple[tuple[int, ...], ...]
    logits: tuple[bool, ...]

    @property
    def max_seqs_per_token(self) -> int:
        return max((len(ids) for ids in self.seq_ids), default=1)

    def sees(self, query: int, key: int) -> bool:
        """Whether entry ``query`` attends to entry ``key`` under llama.cpp's rule (first id, position)."""
        return self.seq_ids[query][0] in self.seq_ids[key] and self.positions[key] <= self.positions[query]


def leaves(tree: TokenTree) -> list[int]:
    """The tree's leaves (nodes that are no node's parent), in packing order."""
    parents = set(tree.parent)
    return [node for node in range(len(tree.tokens)) if node not in parents]


def leaves_below(tree: TokenTree) -> list[list[int]]:
    """Per node, the numbers (into ``leaves(tree)``) of the leaves at or below it, nearest first."""
    below: list[list[int]] = [[] for _ in tree.tokens]
    for number, leaf in enumerate(leaves(tree)):
        node = leaf
        while node >= 0:
            below[node].append(number)
            node = tree.parent[node]
    return below


def pass_layout(
    n_prefix: int,
    trunk: Sequence[int],
    tree: TokenTree,
    *,
    leaf_seqs: Sequence[int],
    trunk_seq: int | None,
    read_nodes: Iterable[int],
) -> BatchLayout:
    """The batch of a packed pass: ``trunk`` then ``tree`` after ``n_prefix`` cached tokens.

    ``leaf_seqs`` gives one sequence id per leaf; ``trunk_seq`` keeps the extended prefix (None when
    there is no trunk). Logits are read at the trunk's last token (the extended prefix's next-token
    distribution) and at the tree nodes ``read_nodes``.
    """
    n_leaves = len(leaves(tree))
    if len(leaf_seqs) != n_leaves:
        raise ValueError(f"the tree has {n_leaves} leaves, got {len(leaf_seqs)} sequence ids")
    if trunk and trunk_seq is None:
        raise ValueError("a trunk needs the sequence that keeps it")
    every = tuple(leaf_seqs)
    trunk_ids = ((trunk_seq,) if trunk_seq is not None else ()) + every
    wanted = set(read_nodes)
    start = n_prefix + len(trunk)
    below = leaves_below(tree)
    return BatchLayout(
        tokens=tuple(trunk) + tuple(tree.tokens),
        positions=tuple(range(n_prefix, start)) + tuple(start + d for d in tree.depth),
        seq_ids=tuple(trunk_ids for _ in trunk) + tuple(tuple(every[n] for n in b) for b in below),
        logits=tuple(k == len(trunk) - 1 for k in range(len(trunk)))
        + tuple(n in wanted for n in range(len(tree.tokens))),
    )


def grow_layout(
    base: int,
    trunk: Sequence[int],
    row_seqs: Sequence[int],
    written: Sequence[int],
    new: Sequence[Sequence[int]],
    *,
    trunk_seq: int | None,
) -> BatchLayout:
    """The batch of one generation step: ``trunk`` (when starting rows), then each row's new tokens.

    Row ``k`` already has ``written[k]`` tokens in sequence ``row_seqs[k]`` after ``base`` prompt
    tokens; its new tokens continue its positions. Logits are read at each row's last new token and
    at the trunk's last token.
    """
    if trunk and trunk_seq is None:
        raise ValueError("a trunk needs the sequence that keeps it")
    n_prefix = base - len(trunk)
    trunk_ids = ((trunk_seq,) if trunk_seq is not None else ()) + tuple(row_seqs)
    tokens, positions = list(trunk), list(range(n_prefix, base))
    seq_ids = [trunk_ids] * len(trunk)
    logits = [k == len(trunk) - 1 for k in range(len(trunk))]
    for seq, done, tokens_new in zip(row_seqs, written, new, strict=True):
        for j, token in enumerate(tokens_new):
            tokens.append(int(token))
            positions.append(base + done + j)
            seq_ids.append((seq,))
            logits.append(j == len(tokens_new) - 1)
    return BatchLayout(tuple(tokens), tuple(positions), tuple(seq_ids), tuple(logits))


def pass_layout_for_prompt(ids: Sequence[int], seq: int, start: int = 0) -> BatchLayout:
    """A plain causal read of ``ids`` at positions from ``start`` into one sequence; logits at the end."""
    n = len(ids)
    return BatchLayout(
        tokens=tuple(ids),
        positions=tuple(range(start, start + n)),
        seq_ids=((seq,),) * n,
        logits=tuple(k == n - 1 for k in range(n)),
    )
