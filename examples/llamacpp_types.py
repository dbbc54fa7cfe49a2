"""How fast llama.cpp reads a packed pass of the embedded model, by the GGUF's weight type.

    PYTHONPATH=. python examples/llamacpp_types.py > out.json

Writes Q8_0, Q4_0 and F16 copies of the embedded Q4_1 GGUF into a temporary folder with llama.cpp's
own quantizer (``allow_requantize``: the copies carry the Q4_1 values, re-rounded), then, for each file
at 1 and 2 threads, times three 400-token prefills (what a packed pass costs) and twenty 1-token steps
(what generation costs), and reads how far each copy's next-token probabilities after the same 400
tokens lie from the Q4_1 file's. Prints one JSON object. Run it on a quiet machine: every figure is
wall time.
"""

import ctypes
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import llama_cpp
import numpy as np

from pcd_core.backends.llamacpp_backend import LlamaCppBackend
from pcd_core.loading.model_files import resolve

TYPES = {
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16,
}
PROMPT = list(range(1000, 1400))


def copy_as(source: Path, target: Path, ftype: int) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize = ftype, True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not write {target}")


def measure(path: Path, threads: int) -> tuple[dict, np.ndarray]:
    backend = LlamaCppBackend(path, threads=threads)
    backend.prefill(PROMPT[:50])  # warm the kernels
    passes = []
    for _ in range(3):
        start = time.perf_counter()
        prefix = backend.prefill(PROMPT)
        passes.append(time.perf_counter() - start)
    steps = []
    for k in range(20):
        start = time.perf_counter()
        backend.prefill([2000 + k], parent=prefix)
        steps.append(time.perf_counter() - start)
    record = {"pass_400_s": passes, "step_ms_median": 1000 * float(np.median(steps))}
    return record, np.exp(backend.next_logp(prefix))


source = resolve("smollm2-135m").gguf
records: dict = {
    "meta": {
        "command": "PYTHONPATH=. python examples/llamacpp_types.py",
        "machine": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
    }
}
with tempfile.TemporaryDirectory() as folder:
    files = {"Q4_1": source}
    for name, ftype in TYPES.items():
        files[name] = Path(folder) / f"smollm2-135m.{name}.gguf"
        copy_as(source, files[name], ftype)
    reference = None
    for name, path in files.items():
        for threads in (1, 2):
            record, probabilities = measure(path, threads)
            if reference is None:
                reference = probabilities
            record["max_probability_change_vs_Q4_1"] = float(np.max(np.abs(probabilities - reference)))
            records[f"{name}_t{threads}"] = record
print(json.dumps(records, indent=1))
