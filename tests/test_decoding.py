"""Every decoder against brute force on the oracle LM.

The expected values come from functions in this file that score whole contexts with the oracle's own
``logp``, independently of the trie, the row planner and the backend's packing.
"""

import dataclasses
import math

import numpy as np
import pytest

from pcd_core import BackendError, DecodeOptions, OptionError, PromptError
from pcd_core.backends.base import Query
from pcd_core.planning import speculation
from pcd_core.prompting.trie import LabelTrie, Variant
from pcd_core.reading.rounds import DecisionTask, RoundStats, decode, plan_rows
from pcd_core.testing import OracleBackend, check_backend, oracle_engine

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


def test_oracle_engine_first_field_equals_brute_force_over_the_whole_prompt(monkeypatch):
    monkeypatch.setattr(speculation, "SPECULATIVE_TOKENS", 0)  # each wave in a pass of its own
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


# -- trunks, the engine's pass counts and its options, on the oracle ---------------------------
def test_the_oracle_meets_the_backend_contract_trunks_included():
    for backend in (OracleBackend(), OracleBackend(max_tokens_per_pass=2)):
        check_backend(backend, list(PROMPT[:12]), [(1, 2, 3), (4, 5)], atol=1e-12)


@pytest.mark.parametrize("strategy", ["trie", "greedy", "exact"])
def test_a_trunk_read_with_the_first_round_equals_its_prefill(strategy):
    oracle = OracleBackend(boosts={KEY: {1: 3.0}})
    half = len(PROMPT) // 2
    task = DecisionTask(LabelTrie(variants(), "field"), strategy)
    passes = oracle.forward_passes
    decoded = decode(oracle, oracle.prefill(PROMPT[:half]), [task], RoundStats(), trunk=PROMPT[half:])
    passes = oracle.forward_passes - passes
    prefilled, stats = run(oracle, strategy)
    assert decoded.readouts[0].probabilities == prefilled.probabilities
    assert decoded.prefix.ids == PROMPT
    assert passes == 1 + stats.rounds  # the first half's prefill, then the rounds: the trunk costs none


def test_a_warm_fill_is_two_passes_a_cold_one_three_and_each_wave_one_more(monkeypatch):
    monkeypatch.setattr(speculation, "SPECULATIVE_TOKENS", 0)  # each wave in a pass of its own
    engine = oracle_engine()
    schema = {"flag": "boolean", "tier": ["GOLD", "SILVER"], "team": {"enum": ["A", "B"], "depends_on": ["tier"]}}
    assert [engine.fill(schema, "some input").stats.forward_passes for _ in range(2)] == [4, 3]
    flat = {"flag": "boolean", "tier": ["GOLD", "SILVER"]}
    assert [engine.fill(flat, "some input").stats.forward_passes for _ in range(2)] == [3, 2]
    question = {"q": {"type": "noul", "instructions": "Is it gold?"}}
    assert [engine.decide("some state", question).stats.forward_passes for _ in range(2)] == [2, 1]


def test_an_input_that_merges_with_the_head_is_read_whole_and_warned_about(monkeypatch):
    monkeypatch.setattr(speculation, "SPECULATIVE_TOKENS", 0)  # each wave in a pass of its own
    # every request opens its fence with "<<<", right after the head's newline: here they merge
    engine = oracle_engine(merges={b"\n<": 300})
    schema = {"flag": "boolean", "tier": ["GOLD", "SILVER"]}
    merged = engine.fill(schema, "#7 some input")
    plain = oracle_engine().fill(schema, "some input")
    assert (merged.stats.head_cache, plain.stats.head_cache) == ("bypassed", "miss")
    assert merged.stats.forward_passes == 2  # the cached head is never prefilled for it
    assert merged.stats.cached_tokens == 0 and any("merged" in w for w in merged.warnings)
    compiled = engine.compile(schema)
    whole = engine.request_ids(compiled, "#7 some input")
    assert 300 in whole and merged.stats.prompt_tokens == len(whole) + len(compiled.field("flag").answer_ids[0])


def test_the_task_reaches_the_prompt_and_gets_its_own_head():
    engine = oracle_engine()
    schema = {"flag": "boolean", "tier": ["GOLD", "SILVER"]}
    plain, tasked = engine.compile(schema), engine.compile(schema, task="Triage the following ticket.")
    assert "Triage the following ticket." in tasked.prompt.head
    assert "Triage" not in plain.prompt.head
    engine.fill(schema, "some input")
    again = engine.fill(schema, "some input", task="Triage the following ticket.")
    assert again.stats.head_cache == "miss"  # another head, not the cached plain one


def test_unknown_strategies_are_option_errors_checked_once():
    with pytest.raises(OptionError, match="unknown strategy 'beam'; choose one of trie, greedy, exact"):
        DecodeOptions(strategy="beam")  # type: ignore[arg-type]
    options = DecodeOptions()
    assert options.replace(strategy="exact").strategy == "exact" and options.strategy == "trie"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.strategy = "exact"  # type: ignore[misc]
    engine = oracle_engine()
    with pytest.raises(OptionError):
        engine.fill({"flag": "boolean", "tier": ["GOLD", "SILVER"]}, "some input", strategy="beam")
    assert engine.backend.forward_passes == 0


def test_rows_are_chunked_at_4096_tokens_by_default_and_an_oversized_pass_is_refused():
    oracle = OracleBackend()
    assert oracle.max_tokens_per_pass == 4096
    prefix = oracle.prefill(PROMPT)
    rows = [(k % 250, (k // 250) % 250) + tuple(range(8)) for k in range(2000)]  # 20000 row tokens
    queries = [Query(r, 9, (1, 2)) for r in range(len(rows))]
    before = oracle.forward_passes
    oracle.score(prefix, rows, queries)
    assert oracle.forward_passes - before == 5  # ceil(20000 / 4096), no n-by-n mask over all rows
    tight = OracleBackend(max_tokens_per_pass=10**9, max_pass_bytes=10**7)
    prefix = tight.prefill(PROMPT)
    before = tight.forward_passes
    with pytest.raises(PromptError, match=r"over the backend's max_pass_bytes of 10 MiB"):
        tight.score(prefix, rows, queries)
    assert tight.forward_passes == before  # refused before any pass


class _Overflowing(OracleBackend):
    """A model whose activations overflow after token 9, as Gemma's do in float16: NaN log-probs."""

    def logp(self, context):
        values = super().logp(context)
        if 9 in context:
            values[3] = np.nan
        if 8 in context:
            values[4] = -np.inf  # a token the model rules out: allowed
        return values


def test_nan_log_probs_are_refused_on_every_read_and_minus_infinity_is_not():
    backend = _Overflowing()
    clean = backend.prefill([1, 2, 8])
    assert backend.score(clean, [(5, 6)], [Query(0, 1, (3, 4))]).values[0][1] == -np.inf
    assert backend.next_logp(clean)[4] == -np.inf
    assert backend.grow(clean, None, [(5,)]).logp[0] is not None
    overflowed = backend.prefill([1, 2, 9])
    for read in (
        lambda: backend.score(overflowed, [(5, 6)], [Query(0, 1, (3, 4))]),
        lambda: backend.score(clean, [(9, 6)], [Query(0, 1, (3,))]),
        lambda: backend.next_logp(overflowed),
        lambda: backend.grow(overflowed, None, [(5,)]),
    ):
        with pytest.raises(BackendError, match="NaN or infinite.*bfloat16 or float32"):
            read()
