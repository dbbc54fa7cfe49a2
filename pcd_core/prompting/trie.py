"""The token trie of one decision: where its spellings part, and what each strategy must read.

All variants of a decision share a common token prefix, the *row*; below it the trie branches. A
node with two or more labels beneath it is a *decision node*; a child with one label beneath it
settles that label. Strategies differ only in which nodes they read:

- ``trie`` reads every decision node, all in one pass (their paths are known in advance), and sums a
  label's settled paths: shared prefixes such as ``1_HOUR``/``12_HOURS`` and the quote of ``"true"``
  are followed and multiplied along the path.
- ``greedy`` follows only the likeliest child at each decision node, one pass per level: fewer rows
  for very large label sets, at the price of rounds (labels off the path get no mass).
- ``exact`` reads every node of every variant, so a label's whole line, ending included, is scored.

What a strategy's reads add up to (a label's mass) is the readout's math, in ``readout.py``; this
module only knows the tree. ``tests/test_decoding.py`` checks each against brute force on an oracle
model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from pcd_core.errors import TokenizationError

Path = tuple[int, ...]  # token ids below the row
Strategy = Literal["trie", "greedy", "exact"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)


@dataclass(frozen=True)
class Variant:
    """One spelling of one label: the label's index and its token ids after the prefix."""

    label: int
    ids: tuple[int, ...]


@dataclass
class Node:
    children: dict[int, Node] = field(default_factory=dict)
    labels: set[int] = field(default_factory=set)
    ends: bool = False


class LabelTrie:
    """The variants of one decision, split into the shared row and the trie below it."""

    def __init__(self, variants: tuple[Variant, ...], name: str) -> None:
        if len({v.label for v in variants}) < 2:
            raise TokenizationError("a decision needs at least two labels", field=name)
        self.name = name
        self.variants = variants
        first = variants[0].ids
        common = min(len(v.ids) for v in variants)
        for v in variants:
            common = next((i for i in range(common) if v.ids[i] != first[i]), common)
        self.row: tuple[int, ...] = first[:common]
        self.root = Node()
        for v in variants:
            node = self.root
            node.labels.add(v.label)
            for token in v.ids[common:]:
                node = node.children.setdefault(token, Node())
                node.labels.add(v.label)
            node.ends = True
        self._check(self.root, ())

    def _check(self, node: Node, path: Path) -> None:
        if node.ends and (node.children or len(node.labels) > 1):
            raise TokenizationError(
                "two labels tokenize to the same ids, or one label's line is a prefix of another's",
                field=self.name,
                text=str(path),
            )
        for token, child in node.children.items():
            self._check(child, path + (token,))

    def node(self, path: Path) -> Node:
        node = self.root
        for token in path:
            node = node.children[token]
        return node

    def decision_paths(self) -> list[Path]:
        """Every node with two or more labels beneath it."""
        found: list[Path] = []

        def walk(node: Node, path: Path) -> None:
            if len(node.labels) > 1:
                found.append(path)
                for token, child in node.children.items():
                    walk(child, path + (token,))

        walk(self.root, ())
        return found

    def all_paths(self) -> list[Path]:
        """Every node that has children: the reads of ``exact`` scoring."""
        found: list[Path] = []

        def walk(node: Node, path: Path) -> None:
            if node.children:
                found.append(path)
                for token, child in node.children.items():
                    walk(child, path + (token,))

        walk(self.root, ())
        return found

    def children_ids(self, path: Path) -> tuple[int, ...]:
        return tuple(sorted(self.node(path).children))

    def n_labels(self) -> int:
        return len(self.root.labels)


def greedy_next(trie: LabelTrie, path: Path, read: dict[int, float]) -> Path | None:
    """The child to follow from a read node: the likeliest one, unless it already settles a label."""
    node = trie.node(path)
    token = max(node.children, key=lambda t: (read[t], -t))
    if len(node.children[token].labels) == 1:
        return None
    return path + (token,)
