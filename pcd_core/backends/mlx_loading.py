"""Loading mlx-lm models for the MLX backend: a llama GGUF read natively, or an HF directory.

Kept apart from ``mlx_backend`` because it is all about names and configuration, not about the two
primitives. Both loaders return the mlx-lm model and its context length.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx  # only ``mlx_backend`` imports this module, after checking that mlx is there
from mlx import nn

from pcd_core.errors import BackendError

#: GGUF tensor names (llama.cpp) to mlx-lm parameter paths
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: ggml's Q4_0 / Q4_1 / Q8_0 blocks hold 32 weights each, so every MLX triple has this group size
_GGUF_GROUP_SIZE = 32


def load_llama_gguf(path: str | Path, dtype: str) -> tuple[nn.Module, int]:
    """A llama GGUF read by ``mx.load``, its Q4_0/Q4_1/Q8_0 tensors kept as MLX quantized triples.

    ``dtype`` is the compute type of everything that is not quantized (norms, scales, biases).
    """
    from mlx_lm.models import llama

    try:
        weights, metadata = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as error:
        # MLX reads F32, F16, Q4_0, Q4_1 and Q8_0 tensors; k-quants (Q4_K_M...) fail here
        raise BackendError(
            f"{path}: MLX cannot read this GGUF ({error}); it reads F32/F16/Q4_0/Q4_1/Q8_0 "
            "tensors only, so load an HF directory with MlxBackend.from_hf_dir instead"
        ) from error
    # return_metadata=True gives (weights, metadata) dicts; the union type covers the other modes
    assert isinstance(weights, dict) and isinstance(metadata, dict)
    config, context_length = _llama_config_from_gguf(metadata, weights, path)
    compute = getattr(mx, dtype)
    renamed = {
        _hf_name(name, path): value if value.dtype == mx.uint32 else value.astype(compute)
        for name, value in weights.items()
    }
    # bits per weight follow from the packed width: in_features = scales columns * group size
    bits = {
        name[: -len(".scales")]: renamed[name[: -len(".scales")] + ".weight"].shape[-1] // value.shape[-1]
        for name, value in renamed.items()
        if name.endswith(".scales")
    }
    model = llama.Model(llama.ModelArgs.from_dict(config))
    nn.quantize(
        model,
        class_predicate=lambda module_path, _: (
            {"group_size": _GGUF_GROUP_SIZE, "bits": bits[module_path], "mode": "affine"}
            if module_path in bits
            else False
        ),
    )
    model.load_weights(list(renamed.items()), strict=True)
    mx.eval(model.parameters())
    return model, context_length


def load_hf_dir(path: str | Path) -> tuple[nn.Module, int]:
    """An HF model directory (or a cached HF id), loaded the way mlx-lm loads it.

    transformers 5 writes ``rope_theta`` inside ``rope_parameters``, while mlx-lm reads the
    top-level key and silently defaults to 10000; a prototype disagreed with torch on 10 to 17
    of 28 fields until the value was passed through, so it is passed here explicitly.
    """
    from mlx_lm.utils import load_model

    model_dir = Path(path)
    if not model_dir.is_dir():
        from huggingface_hub import snapshot_download

        model_dir = Path(snapshot_download(str(path), allow_patterns=["*.json", "*.safetensors"]))
    config = json.loads((model_dir / "config.json").read_text())
    model, config = load_model(model_dir, model_config=rope_overrides(config))
    text_config = config.get("text_config", config)
    context_length = text_config.get("max_position_embeddings")
    if context_length is None:
        raise BackendError(f"{model_dir / 'config.json'} names no max_position_embeddings")
    return model, int(context_length)


def _hf_name(gguf_name: str, path: str | Path) -> str:
    module, _, param = gguf_name.rpartition(".")
    try:
        if module.startswith("blk."):
            _, layer, part = module.split(".", 2)
            return f"model.layers.{layer}.{_GGUF_BLOCK_NAMES[part]}.{param}"
        return f"{_GGUF_TOP_NAMES[module]}.{param}"
    except KeyError:
        raise BackendError(
            f"{path}: GGUF tensor {gguf_name!r} has no place in an mlx-lm llama model; "
            "convert the model to an HF directory and use MlxBackend.from_hf_dir"
        ) from None


def _llama_config_from_gguf(
    metadata: dict[str, Any], weights: dict[str, Any], path: str | Path
) -> tuple[dict[str, Any], int]:
    """mlx-lm llama arguments and the context length, from a GGUF's metadata."""
    arch = str(metadata.get("general.architecture"))
    if arch != "llama":
        raise BackendError(
            f"{path}: the mlx backend reads llama GGUFs natively, not {arch!r}; "
            "load an HF directory with MlxBackend.from_hf_dir instead"
        )

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"llama.{key}")
        return default if value is None else value.item()

    hidden_size = get("embedding_length")
    n_heads = get("attention.head_count")
    config = {
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": get("block_count"),
        "intermediate_size": get("feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": get("attention.head_count_kv", n_heads),
        "head_dim": get("attention.key_length", hidden_size // n_heads),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "vocab_size": weights["token_embd.weight"].shape[0],
        "rope_theta": get("rope.freq_base", 10000.0),
        # llama.cpp's converter permutes the q/k rows of each head so that rotary pairs become
        # adjacent: that is the "traditional" rotation on the stored weights (checked against
        # transformers, which undoes the permutation, in tests/test_mlx_backend.py).
        "rope_traditional": True,
        "tie_word_embeddings": "output.weight" not in weights,
        "max_position_embeddings": get("context_length"),
    }
    return config, int(get("context_length"))


def rope_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """Top-level rope keys for mlx-lm, from transformers 5's ``rope_parameters`` when that is all there is."""
    params = config.get("rope_parameters")
    if not params or "rope_theta" in config:
        return {}
    if "rope_theta" in params:  # one rotary setting for every layer
        overrides: dict[str, Any] = {"rope_theta": params["rope_theta"]}
        full = params
    else:  # one per layer type (Gemma 3: full_attention / sliding_attention)
        full = params.get("full_attention", {})
        overrides = {"rope_theta": full["rope_theta"]}
        if "sliding_attention" in params:
            overrides["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
    if full.get("rope_type", "default") != "default":
        overrides["rope_scaling"] = full
    return overrides
