"""Check that a refactor changes no answer: record the same reads on two commits and compare them.

    git worktree add --detach ../before COMMIT
    python examples/same_answers.py record ../before OUT_BEFORE     # that commit's code
    python examples/same_answers.py record . OUT_AFTER              # this checkout's
    python examples/same_answers.py compare OUT_BEFORE OUT_AFTER

``record`` imports the engine from the checkout it is given (the inputs are this checkout's, so
that both sides read the same) and reads, on torch and on llama.cpp with the embedded SmolLM2: a decide of the bundled refund
question set (cold, warm, three orders), a ``decide_many`` of three states, closed and mixed fills of
the support ticket (cold, warm, and a ``fill_many``), a short reply, and ``pcd eval`` on 32 polarity
sentences batched and 12 one at a time, keeping their raw answers (``--answers``). ``compare`` checks
every count and word exactly and every probability to 1e-6, and skips times, memory and ratios of
times, which vary from run to run. A field only one side has (a ``Stats`` field added since) is
listed apart, since a new field is not a changed answer.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "pcd_core" / "benchdata" / "refund_request_questions.json"
TICKETS = {
    "closed": ROOT / "pcd_core" / "benchdata" / "support_ticket.json",
    "mixed": ROOT / "docs" / "bench" / "support_ticket_mixed.json",
}
STATES = ("The parcel came a day late but everything works. Thanks!", "I was charged twice for order #1; refund one.")
BACKENDS = ("torch", "llamacpp")
#: keys that hold a time, a memory size or a ratio of times, which vary between runs of the same code:
#: by how they end (``prefill_ms``, ``fit_s``), or by a word inside (``peak_mem_mb``, ``pcd_over_prefill``);
#: an ending, not a part, so that ``open_steps`` is still compared
VARYING_ENDS = ("_ms", "_s", "seconds")
VARYING_PARTS = ("mem", "ratio", "speedup", "time", "rss", "_over_")


def _counts(stats: Any) -> dict[str, Any]:
    return {k: v for k, v in stats.to_dict().items() if not _varies(k)}


def _varies(key: str) -> bool:
    return key.endswith(VARYING_ENDS) or any(part in key for part in VARYING_PARTS) or key == "meta"


def record_reads(out: Path, backend: str) -> None:
    """One backend's decides, fills and reply, as JSON in ``out``."""
    from pcd_core import Engine

    engine = Engine.load("smollm2-135m", backend=backend)
    asked = json.loads(QUESTIONS.read_text(encoding="utf-8"))
    state, questions = asked["state"], asked["questions"]
    reads: dict[str, Any] = {}
    for name, response in (
        ("decide_cold", engine.decide(state, questions)),
        ("decide_warm", engine.decide(state, questions)),
        ("decide_three_orders", engine.decide(state, questions, order_samples=3)),
    ):
        reads[name] = {"answers": response.model_dump(mode="json")["answers"], "stats": _counts(response.stats)}
    many = engine.decide_many([state, *STATES], questions)
    reads["decide_many"] = [{"answers": r.model_dump(mode="json")["answers"], "stats": _counts(r.stats)} for r in many]
    for name, path in TICKETS.items():
        case = json.loads(path.read_text(encoding="utf-8"))
        schema, task = case.get("json_schema", case), case.get("task", "")
        text = case["input"]
        for turn in ("cold", "warm"):
            filled = engine.fill(schema, text, task=task)
            reads[f"fill_{name}_{turn}"] = {"record": filled.to_dict(), "stats": _counts(filled.stats)}
        batch = engine.fill_many(schema, [text, *STATES], task=task)
        reads[f"fill_many_{name}"] = [{"record": f.to_dict(), "stats": _counts(f.stats)} for f in batch]
    reply = engine.generate("Say hello in five words.", max_new_tokens=16)
    reads["reply"] = {"text": reply.text, "stats": _counts(reply.stats)}
    (out / f"reads_{backend}.json").write_text(json.dumps(reads, indent=1, sort_keys=True), encoding="utf-8")


def record(tree: Path, out: Path) -> None:
    """Every read of the module docstring, with the engine of the checkout at ``tree``."""
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    for backend in BACKENDS:
        subprocess.run([sys.executable, __file__, "reads", str(out), backend], check=True, env=env, cwd=tree)
        for name, limit, batch in (("batched", 32, 8), ("one_by_one", 12, 1)):
            command = [sys.executable, "-m", "pcd_integrations.commands", "eval", "--data", "polarity"]
            command += ["--limit", str(limit), "--batch-size", str(batch), "--constrained-limit", "0"]
            command += ["--backend", backend, "--answers", str(out / f"answers_{name}_{backend}.jsonl")]
            command += ["--json", str(out / f"eval_{name}_{backend}.json")]
            subprocess.run(command, check=True, env=env, cwd=tree)


def _compare(a: Any, b: Any, where: str, found: dict[str, list[str]]) -> int:
    """How many values were compared; differences and one-sided keys go into ``found``."""
    if isinstance(a, dict) and isinstance(b, dict):
        total = 0
        for key in sorted(set(a) | set(b)):
            if _varies(str(key)):
                continue
            if key not in a or key not in b:
                found["one side"].append(f"{where}.{key}: only in {'the first' if key in a else 'the second'}")
                continue
            total += _compare(a[key], b[key], f"{where}.{key}", found)
        return total
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            found["differ"].append(f"{where}: {len(a)} items against {len(b)}")
        return sum(_compare(x, y, f"{where}[{i}]", found) for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, float) or isinstance(b, float):
        numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
        if not (numbers and (abs(a - b) <= 1e-6 or (math.isnan(a) and math.isnan(b)))):
            found["differ"].append(f"{where}: {a!r} against {b!r}")
    elif a != b:
        found["differ"].append(f"{where}: {a!r} against {b!r}")
    return 1


def _load(path: Path) -> Any:
    if path.suffix == ".jsonl":  # pcd eval's kept answers, one example per line, keyed by its hash
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return {line["key"]: line for line in lines}
    return json.loads(path.read_text(encoding="utf-8"))


def compare(first: Path, second: Path) -> int:
    found: dict[str, list[str]] = {"differ": [], "one side": []}
    total = 0
    for path in sorted(first.glob("*.json*")):
        if not (second / path.name).is_file():
            found["differ"].append(f"{path.name}: not in {second}")
            continue
        total += _compare(_load(path), _load(second / path.name), path.name, found)
    print(f"{total} values compared; {len(found['differ'])} differ")
    for kind, lines in found.items():
        for line in lines:
            print(f"  {kind}: {line}")
    return 1 if found["differ"] else 0


if __name__ == "__main__":
    match sys.argv[1:]:
        case ["record", tree, out]:
            record(Path(tree), Path(out))
        case ["reads", out, backend]:
            record_reads(Path(out), backend)
        case ["compare", first, second]:
            sys.exit(compare(Path(first), Path(second)))
        case _:
            sys.exit(__doc__)
