"""Near-duplicate groups (pcd_core/trust/near_duplicates.py) and the head folds that keep them whole."""

from __future__ import annotations

import numpy as np
import pytest

from pcd_core.trust.near_duplicates import BOILERPLATE_SHARE, RUN_WORDS, THREAD_TEXTS, near_duplicate_groups

QUOTE = "the launch was moved to friday because the weather station reported strong winds"


def _filler(index: int, n_words: int = 12) -> str:
    """Words no other text of the test uses."""
    return " ".join(f"w{index}x{k}" for k in range(n_words))


def test_a_shared_run_of_the_length_groups_and_a_shorter_one_does_not():
    run = QUOTE.split()[:RUN_WORDS]
    shorter = run[:-1]
    texts = [
        f"{_filler(0)} {' '.join(run)} {_filler(1)}",
        f"re {' '.join(run)} {_filler(2)}",
        f"{_filler(3)} {' '.join(shorter)}",
        f"{' '.join(shorter)} {_filler(4)}",
    ]
    groups = near_duplicate_groups(texts)
    assert groups[0] == groups[1]
    assert len({groups[1], groups[2], groups[3]}) == 3
    assert groups.tolist() == [0, 0, 1, 2]  # numbered in order of first appearance


def test_groups_close_over_a_chain_of_quotes():
    a, b = QUOTE.split()[:RUN_WORDS], QUOTE.split()[-RUN_WORDS:]
    texts = [
        f"{_filler(0)} {' '.join(a)}",
        f"{' '.join(a)} {_filler(1)} {' '.join(b)}",  # quotes the first, is quoted by the third
        f"{' '.join(b)} {_filler(2)}",
        _filler(3),
    ]
    groups = near_duplicate_groups(texts)
    assert groups[0] == groups[1] == groups[2] != groups[3]


def test_a_run_in_too_many_texts_is_boilerplate_and_links_nothing():
    footer = "this message was sent to the list and may be read by anyone who subscribes"
    n = 400
    most = max(THREAD_TEXTS, int(BOILERPLATE_SHARE * n))
    texts = [f"{_filler(k)} {footer}" if k <= most else _filler(k) for k in range(n)]
    assert len(np.unique(near_duplicate_groups(texts))) == n  # most + 1 texts carry it: a footer
    texts = [f"{_filler(k)} {footer}" if k < most else _filler(k) for k in range(n)]
    groups = near_duplicate_groups(texts)
    assert len(np.unique(groups[:most])) == 1  # as many as a thread may hold: one group
    assert len(np.unique(groups)) == n - most + 1


def test_folds_that_keep_twins_together_do_not_learn_the_twin():
    """Labels that are noise, each example present twice: a head scored out of fold on folds drawn at
    random meets its twin in training and looks right; on grouped folds it is at chance, as on new data.
    """
    pytest.importorskip("sklearn")
    from pcd_core.trust.heads import fit_head, out_of_fold

    rng = np.random.default_rng(0)
    states = rng.standard_normal((150, 300))  # wider than the examples: a fit can memorise them
    gold = rng.integers(0, 3, size=150)
    twins, twin_gold = np.concatenate([states, states]), np.concatenate([gold, gold])
    groups = np.concatenate([np.arange(150), np.arange(150)])
    labels = ["a", "b", "c"]
    loose = fit_head(twins, twin_gold, labels, "m")
    loose_rows = out_of_fold(twins, twin_gold, loose)
    kept = fit_head(twins, twin_gold, labels, "m", groups=groups)
    kept_rows = out_of_fold(twins, twin_gold, kept, groups=groups)
    loose_accuracy = float(np.mean(loose_rows.argmax(axis=1) == twin_gold))
    kept_accuracy = float(np.mean(kept_rows.argmax(axis=1) == twin_gold))
    assert loose_accuracy > 0.8  # the twin gave the answer away
    assert kept_accuracy < 0.5  # three labels of noise: chance is a third
    assert kept.strength < loose.strength  # and the strength search no longer rewards memorising
