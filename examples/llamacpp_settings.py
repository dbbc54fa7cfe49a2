"""Where a warm 28-field fill on llama.cpp spends its time, by context setting, against torch fp32.

    PYTHONPATH=. python examples/llamacpp_settings.py REPEATS > out.txt

Loads the embedded model four times on llama.cpp (1 or 2 threads, flash attention automatic or
off) and once on torch, warms each with one fill of the bundled support_ticket case, then times
REPEATS rounds of one fill per engine, the engines one after another within a round, so that a busy
machine slows a round's engines together. Prints each fill's seconds as it ends, then one JSON line of
every engine's list of seconds. Flash attention is set by wrapping llama-cpp-python's
``llama_context_default_params``, which the backend calls when it makes its context.
"""

import json
import os
import sys
import time

import llama_cpp

from pcd_core.engine import Engine
from pcd_integrations.commands.bench import load_cases

orig = llama_cpp.llama_context_default_params
cur = {}


def params():
    p = orig()
    if "fa" in cur:
        p.flash_attn_type = cur["fa"]
    return p


llama_cpp.llama_context_default_params = params
case = load_cases(["support_ticket"], None)[0]
variants = {
    "t2": {"threads": "2"},
    "t1": {"threads": "1"},
    "t2_nofa": {"threads": "2", "fa": 0},
    "t1_nofa": {"threads": "1", "fa": 0},
}
engines = {}
for name, v in variants.items():
    cur.clear()
    cur.update({k: x for k, x in v.items() if k == "fa"})
    os.environ["PCD_LLAMACPP_THREADS"] = v["threads"]
    engines[name] = Engine.load("smollm2-135m", backend="llamacpp")
engines["torch"] = Engine.load("smollm2-135m", backend="torch")
for e in engines.values():
    e.fill(case.schema, case.text, task=case.task)
out = {n: [] for n in engines}
for _ in range(int(sys.argv[1])):
    for n, e in engines.items():
        t = time.perf_counter()
        e.fill(case.schema, case.text, task=case.task)
        out[n].append(time.perf_counter() - t)
        print(n, round(out[n][-1], 2), flush=True)
print(json.dumps(out))
