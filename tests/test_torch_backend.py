"""The PyTorch backend and the engine on the real embedded model (SmolLM2-135M, fp32)."""

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import load_case

from pcd_core import BackendError, Engine, PromptError
from pcd_core.backends.base import Query
from pcd_core.backends.torch_backend import TorchBackend
from pcd_core.backends.torch_check import LAYOUT_TOLERANCE
from pcd_core.testing import check_backend

TICKET = load_case("support_ticket")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SMALL_SCHEMA = json.loads((EXAMPLES / "ticket_schema.json").read_text())
SMALL_TEXT = (EXAMPLES / "ticket.txt").read_text()


def test_backend_contract(engine):
    ids = list(engine.tokenizer.encode("The customer was billed twice and wants a refund now."))
    rows = [engine.tokenizer.encode(' "refund": true'), engine.tokenizer.encode(' "team": "BILLING"')]
    check_backend(engine.backend, ids, rows)


def test_copy_fallback_passes_the_same_contract(engine):
    copies = TorchBackend(engine.backend.model, row_layout="copies")
    assert copies.row_layout == "copies"
    ids = list(engine.tokenizer.encode("Order 55120 arrived broken."))
    rows = [engine.tokenizer.encode(" yes it"), engine.tokenizer.encode(" no")]
    check_backend(copies, ids, rows)


def test_tokens_read_counts_what_each_layout_reads(engine):
    """Packed rows read a shared start once; copies read every row whole."""
    copies = TorchBackend(engine.backend.model, row_layout="copies")
    rows = [engine.tokenizer.encode(" yes it is"), engine.tokenizer.encode(" yes it was")]
    shared = len(os.path.commonprefix(rows))
    assert shared >= 2
    for backend, expected in ((engine.backend, sum(map(len, rows)) - shared), (copies, sum(map(len, rows)))):
        prefix = backend.prefill(engine.tokenizer.encode("Is the order late?"))
        before = backend.counter.tokens_read
        backend.score(prefix, rows, [Query(0, 0, (1,)), Query(1, 0, (1,))])
        assert backend.counter.tokens_read - before == expected, backend.row_layout


def test_restricted_softmax_equals_native_next_token_probabilities(engine):
    schema = TICKET["json_schema"]
    result = engine.fill(schema, TICKET["input"])
    compiled = engine.compile(schema)
    first = compiled.field(compiled.waves[0][0])
    context = compiled.head_ids + engine.tokenizer.encode(compiled.prompt.request_text(TICKET["input"]))
    context = list(context + first.trie.row)
    with torch.inference_mode():
        logits = engine.backend.model(input_ids=torch.tensor([context])).logits[0, -1]
    native = torch.softmax(logits.double(), -1)
    firsts = {}
    for variant in first.variants:
        firsts.setdefault(variant.label, set()).add(variant.ids[len(first.trie.row)])
    # every label of this field is settled by its first token, so the decision is one restricted softmax
    assert all(len(tokens) == 1 for tokens in firsts.values())
    mass = {label: float(native[list(tokens)].sum()) for label, tokens in firsts.items()}
    total = sum(mass.values())
    got = result.fields[first.name]
    for index, label in enumerate(first.field.labels):
        assert got.probabilities[label.text] == pytest.approx(mass[index] / total, abs=1e-5)
    assert got.candidate_mass == pytest.approx(total, abs=1e-5)


def _probabilities(result):
    return {name: list(f.probabilities.values()) for name, f in result.fields.items()}


def test_packed_rows_equal_copies_and_chunking_changes_nothing(engine):
    schema, text = SMALL_SCHEMA, SMALL_TEXT
    engine.warmup(schema)
    packed = engine.fill(schema, text)
    copies = Engine(TorchBackend(engine.backend.model, row_layout="copies"), engine.tokenizer, "copies")
    chunked = Engine(TorchBackend(engine.backend.model, max_tokens_per_pass=16), engine.tokenizer, "chunked")
    copies.warmup(schema)
    by_copies, by_chunks = copies.fill(schema, text), chunked.fill(schema, text)
    # copies read each trunk as a prefill of its own: a trunk per row would read the request per row
    assert (packed.stats.forward_passes, by_copies.stats.forward_passes) == (2, 4)
    for other in (by_copies, by_chunks):
        for name, values in _probabilities(packed).items():
            np.testing.assert_allclose(_probabilities(other)[name], values, atol=1e-4, err_msg=name)
        assert other.values == packed.values
    assert by_copies.stats.row_layout == "copies"
    assert by_chunks.stats.forward_passes > packed.stats.forward_passes


def test_head_cache_on_and_off_agree(engine):
    schema, text = SMALL_SCHEMA, SMALL_TEXT
    cached = engine.fill(schema, text)
    uncached = engine.fill(schema, text, use_head_cache=False)
    for name, values in _probabilities(cached).items():
        np.testing.assert_allclose(_probabilities(uncached)[name], values, atol=1e-4, err_msg=name)


def test_a_warm_28_field_request_costs_two_passes_and_a_cold_one_three(engine):
    fresh = Engine(engine.backend, engine.tokenizer, "fresh")  # the loaded model, nothing cached
    schema, text = TICKET["json_schema"], TICKET["input"]
    cold = fresh.fill(schema, text)
    warm = fresh.fill(schema, text)
    assert len(cold.fields) == 28
    assert (cold.stats.forward_passes, cold.stats.head_cache) == (3, "miss")
    assert (warm.stats.forward_passes, warm.stats.head_cache) == (2, "hit")
    assert warm.stats.cached_tokens == len(fresh.compile(schema).head_ids) > 500


def test_memory_is_estimated_from_the_model_and_an_unchunked_flood_is_refused(engine):
    backend = engine.backend
    config = backend.model.config
    assert backend.kv_bytes_per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * 64 * 4
    prefix = backend.prefill(engine.tokenizer.encode("A state."))
    rows = [(k % 500, k // 500 + 1) + tuple(range(100, 138)) for k in range(2000)]  # 2000 questions' rows
    saved, passes = backend.max_tokens_per_pass, backend.forward_passes
    backend.max_tokens_per_pass = None  # no chunking: one pass would need an 80000-token square mask
    try:
        with pytest.raises(PromptError, match="max_pass_bytes of 2048 MiB"):
            backend.score(prefix, rows, [Query(r, 39, (1,)) for r in range(len(rows))])
    finally:
        backend.max_tokens_per_pass = saved
    assert backend.forward_passes == passes


@pytest.fixture(scope="module")
def bfloat16_model(engine):
    return copy.deepcopy(engine.backend.model).to(torch.bfloat16)


def test_a_bfloat16_model_loads_against_its_own_rounding_and_decides_the_clear_fields_alike(engine, bfloat16_model):
    backend = TorchBackend(bfloat16_model)
    assert backend.row_layout == "packed"
    error, floor = backend._self_check(), backend._rounding_floor()
    # the float32 bound alone would refuse the model; twice its own code's disagreement admits it
    assert LAYOUT_TOLERANCE < error <= LAYOUT_TOLERANCE + 2 * floor
    half = Engine(backend, engine.tokenizer, "bf16").fill(TICKET["json_schema"], TICKET["input"])
    full = engine.fill(TICKET["json_schema"], TICKET["input"])
    # bfloat16 moves this model's probabilities by a few hundredths: a field decided at 0.65 or more
    # keeps its answer, and its probability stays within 0.1
    clear = [name for name, f in full.fields.items() if f.probability >= 0.65]
    assert len(clear) >= 8
    assert {name: half.values[name] for name in clear} == {name: full.values[name] for name in clear}
    for name in clear:
        assert half.fields[name].probability == pytest.approx(full.fields[name].probability, abs=0.1), name


def test_a_wrong_mask_is_still_refused_in_bfloat16(bfloat16_model, monkeypatch):
    masks = TorchBackend._masks

    def unmasked(self, q_pos, k_pos, allowed):  # every token sees every other: rows read each other
        return masks(self, q_pos, k_pos, torch.ones_like(allowed))

    monkeypatch.setattr(TorchBackend, "_masks", unmasked)
    with pytest.raises(BackendError, match="no row layout of 'llama' matches"):
        TorchBackend(bfloat16_model)


@pytest.mark.parametrize("which", ["engine", "gemma_engine"])
def test_a_prefill_after_a_prefix_reads_like_one_whole_pass(which, request):
    """The prefix-continuing prefill passes its own additive causal mask (and Gemma 3's 512-token
    window, which these 900 tokens cross); the next-token log-probs equal the model's own whole pass.
    """
    backend = request.getfixturevalue(which).backend
    ids = [(7 * i + 3) % 30000 + 100 for i in range(900)]
    prefix = backend.prefill(ids[600:], parent=backend.prefill(ids[:600]))
    with torch.inference_mode():
        whole = backend.model(input_ids=torch.tensor([ids], device=backend.device)).logits[0, -1]
    expected = torch.log_softmax(whole.float(), -1).double().cpu().numpy()
    np.testing.assert_allclose(backend.next_logp(prefix), expected, atol=2e-4)
