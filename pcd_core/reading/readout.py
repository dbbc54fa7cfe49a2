"""Pure math from gathered log-probs to a decision: probability, candidate mass, confidence.

- ``probabilities``: the labels' settled masses renormalised over the allowed labels, in float64.
- ``candidate_mass``: the unrenormalised probability that the model's next token starts any allowed
  label at the decision point. Low mass means the model wanted to write something off the menu
  (0.24 on a field of the double-billing ticket whose winner still read 0.551 after renormalising).
- ``confidence``: the normalised peak ``(n * max p - 1) / (n - 1)``, clamped to [0, 1], as the hosted
  Jev API computes it: 0 for a uniform split, 1 for certainty.
- ``settled_logmass`` / ``exact_logmass``: from the log-probs read at a trie's nodes (``trie.py``
  says which nodes each strategy reads) to each label's log mass, summed over its spellings.

``tests/test_readout.py`` checks these against hand-computed values, ``tests/test_decoding.py``
the masses against brute force on an oracle model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pcd_core.prompting.trie import LabelTrie, Node, Path


@dataclass(frozen=True)
class Readout:
    logmass: tuple[float, ...]  # per label, unrenormalised log mass of its settled paths
    probabilities: tuple[float, ...]
    candidate_mass: float
    best: int
    # the model's final hidden state at the decision's first point (a numpy vector), when the pass was
    # asked for it (``decode(..., hidden=True)``): what a trained head reads (pcd_core/trust/heads.py)
    hidden: Any = field(default=None, compare=False, repr=False)

    @property
    def confidence(self) -> float:
        return normalised_peak(self.probabilities)

    def ranked(self) -> list[int]:
        return sorted(range(len(self.probabilities)), key=lambda i: (-self.probabilities[i], i))


def renormalise(logmass: list[float]) -> tuple[float, ...]:
    total = logsumexp(logmass)
    if total == -math.inf:
        return tuple(1.0 / len(logmass) for _ in logmass)
    return tuple(math.exp(v - total) if v != -math.inf else 0.0 for v in logmass)


def normalised_peak(probabilities: tuple[float, ...] | list[float]) -> float:
    n = len(probabilities)
    if n < 2:
        return 1.0
    return min(1.0, max(0.0, (n * max(probabilities) - 1.0) / (n - 1.0)))


def make_readout(logmass: list[float], root_read: dict[int, float]) -> Readout:
    probabilities = renormalise(logmass)
    best = max(range(len(probabilities)), key=lambda i: (probabilities[i], -i))
    candidate_mass = min(1.0, math.exp(logsumexp(list(root_read.values()))))
    return Readout(tuple(logmass), probabilities, candidate_mass, best)


def settled_logmass(
    trie: LabelTrie, reads: dict[Path, dict[int, float]], n_labels: int, branch_norm: bool = False
) -> list[float]:
    """Per label, log of the summed mass of its settled paths over the nodes that were read.

    With ``branch_norm`` every read is renormalised over the node's children first: the forced
    decision tree, where a deeper node asks only which allowed continuation follows.
    Nodes that were not read (``greedy`` branches not taken) leave their labels at ``-inf``.
    """
    terms: list[list[float]] = [[] for _ in range(n_labels)]

    def walk(node: Node, path: Path, logp: float) -> None:
        read = reads.get(path)
        if read is None:
            return
        local = _log_normalised(read) if branch_norm else read
        for token, child in node.children.items():
            step = logp + local[token]
            if len(child.labels) == 1:
                terms[next(iter(child.labels))].append(step)
            else:
                walk(child, path + (token,), step)

    walk(trie.root, (), 0.0)
    return [logsumexp(t) for t in terms]


def exact_logmass(trie: LabelTrie, reads: dict[Path, dict[int, float]], n_labels: int) -> list[float]:
    """Per label, log of the summed probability of its whole lines (every token, ending included)."""
    terms: list[list[float]] = [[] for _ in range(n_labels)]
    seen: set[tuple[int, ...]] = set()
    start = len(trie.row)
    for variant in trie.variants:
        if variant.ids in seen:
            continue
        seen.add(variant.ids)
        below = variant.ids[start:]
        terms[variant.label].append(sum(reads[below[:d]][below[d]] for d in range(len(below))))
    return [logsumexp(t) for t in terms]


def _log_normalised(read: dict[int, float]) -> dict[int, float]:
    total = logsumexp(list(read.values()))
    return {token: value - total for token, value in read.items()}


def logsumexp(values: list[float]) -> float:
    finite = [v for v in values if v != -math.inf]
    if not finite:
        return -math.inf
    top = max(finite)
    return top + math.log(sum(math.exp(v - top) for v in finite))
