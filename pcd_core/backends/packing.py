"""How rows become passes: which rows share a pass (``plan_chunks``), and one pass's rows merged into
a tree that reads their shared start once (``pack_tree``, ``TokenTree``).

Pure functions of token ids, with no backend state: every backend packs the same way, so chunking
can change only the number of passes, never a result. ``tests/test_choice_rows.py`` and
``tests/test_seqsets.py`` check the plans and trees against the rows they came from.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


def plan_chunks(
    rows: Sequence[Sequence[int]], max_tokens_per_pass: int | None, max_rows: int | None = None
) -> list[list[int]]:
    """Group row indices into passes of at most ``max_tokens_per_pass`` distinct row tokens beyond the
    stem that all of a pass's rows share, and at most ``max_rows`` rows (one row at least).

    Rows are taken in token order, so that rows that start alike share a pass, where ``pack_tree``
    reads their common start once: a row costs only the tokens it adds. The stem is free because any
    pass that reads one of these rows reads it whole: a question whose option list alone is over the
    bound is still one pass with its branch rows. Counting each row whole split a 255-option
    question's 16 branch rows (3,082 tokens each on SmolLM2) into 15 passes that read its option
    list 15 times, 46,245 tokens instead of 3,097 (``tests/test_choice_rows.py``).
    """
    if not rows:
        return []
    if max_tokens_per_pass is None and max_rows is None:
        return [list(range(len(rows)))]
    order = sorted(range(len(rows)), key=lambda k: tuple(rows[k]))
    chunks: list[list[int]] = []
    used = stem = 0  # the current pass's distinct tokens, and the start all its rows share
    for index in order:
        row = rows[index]
        shared = shared_start(rows[chunks[-1][-1]], row) if chunks else 0
        fits = max_tokens_per_pass is None or used + len(row) - shared - min(stem, shared) <= max_tokens_per_pass
        if chunks and fits and (max_rows is None or len(chunks[-1]) < max_rows):
            chunks[-1].append(index)
            used, stem = used + len(row) - shared, min(stem, shared)
        else:
            chunks.append([index])
            used = stem = len(row)
    return chunks


def shared_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from their start."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class TokenTree:
    """Rows merged where they share a start: each distinct row prefix is one packed token.

    Rows of one question share a long text and part only at the answer, so packing them as a tree
    reads the shared text once instead of once per branch, in the same single pass.
    """

    tokens: list[int]
    parent: list[int]  # -1 for a token that follows the prefix directly
    depth: list[int]
    node_of: list[list[int]]  # per row, per position: the packed index

    @property
    def rows(self) -> list[tuple[int, ...]]:
        """The rows as given, for backends that read them one by one."""
        return [tuple(self.tokens[node] for node in nodes) for nodes in self.node_of]

    def ancestors(self) -> np.ndarray:
        """[n, n] boolean: token i may attend to token k iff k is i or one of its ancestors."""
        n = len(self.tokens)
        allowed = np.zeros((n, n), dtype=bool)
        for i, parent in enumerate(self.parent):
            if parent >= 0:
                allowed[i] = allowed[parent]
            allowed[i, i] = True
        return allowed

    def with_trunk(self, n_trunk: int) -> np.ndarray:
        """[t + n, t + n] boolean over the trunk's t tokens then the tree's: the trunk is causal, and
        every tree token sees the whole trunk and its own ancestors.
        """
        n = len(self.tokens)
        allowed = np.zeros((n_trunk + n, n_trunk + n), dtype=bool)
        allowed[:n_trunk, :n_trunk] = np.tril(np.ones((n_trunk, n_trunk), dtype=bool))
        allowed[n_trunk:, :n_trunk] = True
        allowed[n_trunk:, n_trunk:] = self.ancestors()
        return allowed


def pack_tree(rows: list[tuple[int, ...]]) -> TokenTree:
    tree = TokenTree([], [], [], [])
    roots: dict[int, tuple[int, dict]] = {}
    for row in rows:
        children, parent, placed = roots, -1, []
        for depth, token in enumerate(row):
            if token not in children:
                tree.tokens.append(token)
                tree.parent.append(parent)
                tree.depth.append(depth)
                children[token] = (len(tree.tokens) - 1, {})
            parent, children = children[token]
            placed.append(parent)
        tree.node_of.append(placed)
    return tree


def batch_groups(tree: TokenTree, cost: Callable[[int, int], float]) -> list[list[int]]:
    """The tree's tokens split into groups to read side by side as a batch, ``cost(groups, width)``
    the price of a batch of that many groups padded to that width (one group: the packed pass).

    A group is a node's subtree with the node's ancestors copied in front, so it holds everything
    its tokens may see; a token shared by several groups is read in each. Starting from the whole
    tree, the widest group is split, again and again, at its first branching node (one group per
    child), and the cheapest split seen wins. Many inputs' requests behind one template token are
    one subtree at the root, and they part at the first token where their texts differ. Each group
    lists its packed indices in order (parents first).
    """
    n = len(tree.tokens)
    children: list[list[int]] = [[] for _ in range(n)]
    roots: list[int] = []
    for node, parent in enumerate(tree.parent):
        (children[parent] if parent >= 0 else roots).append(node)
    size = [1] * n
    for node in range(n - 1, -1, -1):  # pack_tree places a parent before its children
        if tree.parent[node] >= 0:
            size[tree.parent[node]] += size[node]

    def width(top: int) -> int:
        return n if top < 0 else tree.depth[top] + size[top]

    def branches(top: int) -> list[int]:
        """The children of the first node at or below ``top`` that has other than one child."""
        kids = roots if top < 0 else children[top]
        while len(kids) == 1:
            kids = children[kids[0]]
        return kids

    heap = [(-n, -1)]
    best, best_cost = [-1], cost(1, n)
    while True:
        _, top = heapq.heappop(heap)
        kids = branches(top)
        if not kids:
            break  # the widest group is one row: no split narrows the batch
        for kid in kids:
            heapq.heappush(heap, (-width(kid), kid))
        priced = cost(len(heap), -heap[0][0])
        if priced < best_cost:
            best, best_cost = [t for _, t in heap], priced
    return [_group(tree, children, top) for top in best]


def _group(tree: TokenTree, children: list[list[int]], top: int) -> list[int]:
    """A group's packed indices: ``top``'s ancestors, then its subtree (the whole tree for -1)."""
    if top < 0:
        return list(range(len(tree.tokens)))
    nodes, stack = [], [top]
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(children[node])
    parent = tree.parent[top]
    while parent >= 0:
        nodes.append(parent)
        parent = tree.parent[parent]
    return sorted(nodes)


def leading_chain(tree: TokenTree, nodes: Sequence[int]) -> int:
    """How many of a group's first nodes (``batch_groups``' order: parents first) form one path from
    a root on which no node branches inside the group: in a batch, an input's request and what its
    rows share after it. The keys and values of such a path depend on the prefix and the path's own
    tokens only, so a later pass whose group starts with the same tokens may read them instead of
    computing them again (``torch_batched.batched_hidden``).
    """
    if not nodes or tree.parent[nodes[0]] != -1:
        return 0
    inside = set(nodes)
    kids = dict.fromkeys(nodes, 0)
    for node in nodes:
        if tree.parent[node] in inside:
            kids[tree.parent[node]] += 1
    length = 1
    while length < len(nodes) and tree.parent[nodes[length]] == nodes[length - 1] and kids[nodes[length - 1]] == 1:
        length += 1
    return length
