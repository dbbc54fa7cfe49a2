"""Every decoder against brute force on the oracle LM.

The expected values come from functions in this file that score whole contexts with the oracle's own
``logp``, independently of the trie, the row planner and the backend's packing.
"""

import math

import numpy as np
import pytest

from pcd_core.backends.base import Query
from pcd_core.decoding import DecisionTask, RoundStats, decode, plan_rows
from pcd_core.testing import OracleBackend, oracle_engine
from pcd_core.trie import LabelTrie, Variant

PROMPT = tuple(range(10, 30))
KEY = (40, 41, 42)  # the field's key tokens, shared by every variant
# labels as token paths: 0 -> [1,2], 1 -> [1,3,4], 2 -> [5] and a quoted spelling [6,5,6]
LABELS = {0: [(1, 2, 9)], 1: [(1, 3, 4, 9)], 2: [(5, 9), (6, 5, 6, 9)]}


def variants():
    return tuple(Variant(label, KEY + path) for label, paths in LABELS.items() for path in paths)


def settling_length(ids, label, all_variants):
    """The shortest prefix of ``ids`` that no variant of another label shares."""
    for d in range(1, len(ids) + 1):
        if not any(v.ids[:d] == ids[:d] for v in all_variants if v.label != label):
            return d
    return len(ids)


def path_logp(oracle, ids, start, stop, normalise_over=None):
    total = 0.0
    for k in range(start, stop):
        logp = oracle.logp(PROMPT + ids[:k])
        if normalise_over is not None:
            allowed = normalise_over(ids[:k])
            logp = logp - np.logaddexp.reduce(logp[list(allowed)])
        total += logp[ids[k]]
    return total


def children(all_variants, prefix):
    return {v.ids[len(prefix)] for v in all_variants if v.ids[: len(prefix)] == prefix and len(v.ids) > len(prefix)}


def brute_force(oracle, mode, branch_norm=False):
    vs = variants()
    start = len(KEY)
    masses = {label: 0.0 for label in LABELS}
    seen = set()
    for v in vs:
        stop = len(v.ids) if mode == "exact" else settling_length(v.ids, v.label, vs)
        if v.ids[:stop] in seen:
            continue
        seen.add(v.ids[:stop])
        norm = (lambda prefix: children(vs, prefix)) if branch_norm else None
        masses[v.label] += math.exp(path_logp(oracle, v.ids, start, stop, norm))
    total = sum(masses.values())
    return [masses[label] / total for label in LABELS]


def run(oracle, strategy, branch_norm=False):
    prefix = oracle.prefill(PROMPT)
    task = DecisionTask(LabelTrie(variants(), "field"), strategy, branch_norm)
    stats = RoundStats()
    return decode(oracle, prefix, [task], stats).readouts[0], stats


@pytest.mark.parametrize("strategy", ["trie", "exact"])
@pytest.mark.parametrize("seed_boost", [0.0, 4.0])
def test_trie_and_exact_equal_brute_force(strategy, seed_boost):
    oracle = OracleBackend(boosts={KEY: {6: seed_boost}})
    readout, stats = run(oracle, strategy)
    np.testing.assert_allclose(readout.probabilities, brute_force(oracle, strategy), atol=1e-12)
    assert stats.rounds == 1


def test_branch_normalised_trie_equals_forced_decision_tree():
    oracle = OracleBackend()
    readout, _ = run(oracle, "trie", branch_norm=True)
    np.testing.assert_allclose(readout.probabilities, brute_force(oracle, "trie", branch_norm=True), atol=1e-12)


def test_candidate_mass_is_unrenormalised_first_token_mass():
    oracle = OracleBackend()
    readout, _ = run(oracle, "trie")
    logp = oracle.logp(PROMPT + KEY)
    assert readout.candidate_mass == pytest.approx(sum(math.exp(logp[t]) for t in (1, 5, 6)), abs=1e-12)


def greedy_brute_force(oracle):
    vs = variants()
    masses = {label: 0.0 for label in LABELS}
    prefix, logp_so_far = KEY, 0.0
    while True:
        logp = oracle.logp(PROMPT + prefix)
        options = sorted(children(vs, prefix))
        for token in options:
            below = {v.label for v in vs if v.ids[: len(prefix) + 1] == prefix + (token,)}
            if len(below) == 1:
                masses[below.pop()] += math.exp(logp_so_far + logp[token])
        best = max(options, key=lambda t: logp[t])
        below = {v.label for v in vs if v.ids[: len(prefix) + 1] == prefix + (best,)}
        if len(below) == 1:
            break
        prefix, logp_so_far = prefix + (best,), logp_so_far + logp[best]
    total = sum(masses.values())
    return [masses[label] / total for label in LABELS]


@pytest.mark.parametrize("boost", [0.0, 6.0])
def test_greedy_follows_the_likeliest_branch(boost):
    oracle = OracleBackend(boosts={KEY: {1: boost}})
    readout, stats = run(oracle, "greedy")
    np.testing.assert_allclose(readout.probabilities, greedy_brute_force(oracle), atol=1e-12)
    assert stats.rounds >= 1


def test_quoted_spelling_is_followed_and_added():
    # the oracle puts almost everything on the quote, then on label 2 inside it
    oracle = OracleBackend(boosts={KEY: {6: 12.0}, KEY + (6,): {5: 12.0}})
    readout, _ = run(oracle, "trie")
    assert readout.best == 2 and readout.probabilities[2] > 0.99


def test_nested_reads_share_one_row():
    rows, placed = plan_rows([((1, 2), ()), ((1, 2), (3,)), ((1, 2), (3, 4))])
    assert rows == [(1, 2, 3, 4)]
    assert placed == [(0, 1), (0, 2), (0, 3)]


def test_chunking_changes_nothing_but_the_pass_count():
    def two_fields(backend):
        prefix = backend.prefill(PROMPT)
        other = tuple(Variant(v.label, (50,) + v.ids) for v in variants())
        tasks = [DecisionTask(LabelTrie(variants(), "a")), DecisionTask(LabelTrie(other, "b"))]
        return decode(backend, prefix, tasks, RoundStats()).readouts

    whole, chunked = OracleBackend(), OracleBackend(max_tokens_per_pass=1)
    assert [r.probabilities for r in two_fields(whole)] == [r.probabilities for r in two_fields(chunked)]
    assert chunked.forward_passes > whole.forward_passes


def test_query_after_the_prefix_reads_its_last_position():
    oracle = OracleBackend()
    prefix = oracle.prefill(PROMPT)
    got = oracle.score(prefix, [], [Query(0, -1, (3, 4))]).values[0]
    np.testing.assert_allclose(got, oracle.logp(PROMPT)[[3, 4]])


def test_oracle_engine_first_field_equals_brute_force_over_the_whole_prompt():
    engine = oracle_engine()
    schema = {"flag": "boolean", "tier": ["GOLD", "SILVER"]}
    result = engine.fill(schema, "some input")
    compiled = engine.compile(schema)
    context = compiled.head_ids + engine.tokenizer.encode(compiled.prompt.request_text("some input"))
    field = compiled.field("flag")
    vs = field.variants
    start = len(field.trie.row)
    masses = [0.0, 0.0]
    seen = set()
    for v in vs:
        stop = settling_length(v.ids, v.label, vs)
        if v.ids[:stop] in seen:
            continue
        seen.add(v.ids[:stop])
        total = sum(engine.backend.logp(context + v.ids[:k])[v.ids[k]] for k in range(start, stop))
        masses[v.label] += math.exp(total)
    assert result.fields["flag"].probabilities["true"] == pytest.approx(masses[0] / sum(masses), abs=1e-12)
    assert result.stats.forward_passes == 3  # head; input with the first field; its answer with the rest
