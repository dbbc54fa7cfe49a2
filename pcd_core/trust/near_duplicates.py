"""Near-duplicate groups of labelled texts, so that cross-validation never splits a thread.

Labelled sets collected from the wild repeat themselves: a reply quotes the post it answers, a form
letter is sent a hundred times, a poster signs every message alike. When two such texts fall in
different folds, the fold model has, in effect, seen the held-out one, and its out-of-fold
probabilities are more confident than the model will be on new text. A trained head (pcd_core/trust/heads.py)
fits hundreds of weights per label, so it learns the quoted words themselves: on 20 Newsgroups'
train split (SmolLM2-135M's states, 2,000 examples) folds drawn at random put the heads' out-of-fold
accuracy well above what the same heads reach on the later test split, and thresholds fitted on those
probabilities (abstention, answer sets: pcd_core/trust/selective.py) answered too often there. Folds that
keep each group whole measure what a new thread gets. docs/trust.md has the figures.

Two texts are in one group when they share a run of ``RUN_WORDS`` words (a quoted sentence, not a
common phrase), and groups are closed under that relation (a thread whose posts each quote the one
before is one group). A run that recurs in more than ``BOILERPLATE_SHARE`` of the texts, and in more
than ``THREAD_TEXTS`` of them, is a disclaimer or a mailing list's footer: it says nothing about
threads and would chain most of a set into one group, so it is not counted.
``tests/test_near_duplicates.py`` checks both rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: a shared run this long is a quotation or a copy, not a turn of phrase
RUN_WORDS = 8

#: a run found in more texts than this share of them (and more than ``THREAD_TEXTS``) is boilerplate,
#: and links nothing
BOILERPLATE_SHARE = 0.02

#: so many texts sharing one run can still be one thread, however small the set
THREAD_TEXTS = 5


def near_duplicate_groups(texts: Sequence[str], run_words: int = RUN_WORDS) -> np.ndarray:
    """One group index per text, ``0..k-1`` in order of first appearance: the module docstring's groups."""
    holders: dict[tuple[str, ...], list[int]] = {}
    for index, text in enumerate(texts):
        words = text.split()
        for run in {tuple(words[start : start + run_words]) for start in range(len(words) - run_words + 1)}:
            holders.setdefault(run, []).append(index)
    most = max(THREAD_TEXTS, int(BOILERPLATE_SHARE * len(texts)))
    parent = list(range(len(texts)))

    def root(index: int) -> int:
        while parent[index] != index:
            parent[index] = parent[parent[index]]
            index = parent[index]
        return index

    for indices in holders.values():
        if 2 <= len(indices) <= most:
            first = root(indices[0])
            for other in indices[1:]:
                parent[root(other)] = first
    numbers: dict[int, int] = {}
    return np.asarray([numbers.setdefault(root(index), len(numbers)) for index in range(len(texts))], dtype=np.int64)
