"""How much of a warm 28-field fill on llama.cpp is ``llama_decode``, and how much is Python around it.

    PYTHONPATH=. python examples/llamacpp_profile.py torch=1 rep=2

Wraps llama-cpp-python's ``llama_decode`` with a clock, warms the embedded model on llama.cpp (and
on torch with ``torch=1``) with one fill of the bundled support_ticket case, then prints per repeat the
fill's total milliseconds, the milliseconds inside ``llama_decode`` with each batch's token count, the
highest KV position in use, and torch's time for the same fill right after. The rest of the total is
what pcd-engine's own code adds: building the batch, the log-softmax of each query, the decoding.
``fa=0`` turns flash attention off and ``ubatch=N`` sets the context's micro-batch.
"""

import sys
import time

import llama_cpp

import pcd_core.backends.llamacpp_backend as lb
from pcd_core.engine import Engine
from pcd_integrations.commands.bench import load_cases

variant = dict(a.split("=") for a in sys.argv[1:])
orig = llama_cpp.llama_context_default_params


def params():
    p = orig()
    if "fa" in variant:
        p.flash_attn_type = int(variant["fa"])
    if "ubatch" in variant:
        p.n_ubatch = int(variant["ubatch"])
    return p


llama_cpp.llama_context_default_params = params
dec = llama_cpp.llama_decode
log = []


def timed_decode(ctx, batch):
    t = time.perf_counter()
    r = dec(ctx, batch)
    log.append((batch.n_tokens, time.perf_counter() - t))
    return r


lb.llama.llama_decode = timed_decode
case = load_cases(["support_ticket"], None)[0]
eng = Engine.load("smollm2-135m", backend="llamacpp")
tor = Engine.load("smollm2-135m", backend="torch") if "torch" in variant else None
eng.fill(case.schema, case.text, task=case.task)
if tor:
    tor.fill(case.schema, case.text, task=case.task)
for _ in range(int(variant.get("rep", 2))):
    log.clear()
    t = time.perf_counter()
    eng.fill(case.schema, case.text, task=case.task)
    total = time.perf_counter() - t
    d = sum(x[1] for x in log)
    batches = [(n, round(s * 1000)) for n, s in log]
    top = max(eng.backend.live_sequences().values())
    print(f"llamacpp total {total * 1000:.0f} ms decode {d * 1000:.0f} ms {batches} live max pos {top}")
    if tor:
        t = time.perf_counter()
        tor.fill(case.schema, case.text, task=case.task)
        tt = time.perf_counter() - t
        print(f"torch total {tt * 1000:.0f} ms ratio torch/llama {tt / total:.2f}")
