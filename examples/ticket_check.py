"""The seven-field double-billing ticket, raw and debiased, on one model: JSON on stdout.

python examples/ticket_check.py MODEL [BACKEND] > docs/eval/MODEL.ticket.json
The right answers are examples/ticket_answers.json (the same as tests/test_double_billing.py's).
"""

import json
import sys
from pathlib import Path

from pcd_core import Engine

EXAMPLES = Path(__file__).resolve().parent
right = json.loads((EXAMPLES / "ticket_answers.json").read_text())
schema = json.loads((EXAMPLES / "ticket_schema.json").read_text())
text = (EXAMPLES / "ticket.txt").read_text()
backend = {"backend": sys.argv[2]} if len(sys.argv) > 2 else {}  # else the default (PCD_BACKEND or torch)
engine = Engine.load(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m", **backend)
out = {"model": engine.model_name, "backend": engine.backend.name, "right": right}
for debias in (False, True):
    result = engine.fill(schema, text, debias=debias)
    out["debiased" if debias else "raw"] = {
        "values": result.values,
        "n_right": sum(result.values[k] == v for k, v in right.items()),
        "probability": {k: round(f.probability, 3) for k, f in result.fields.items()},
        "candidate_mass": {k: round(f.candidate_mass, 3) for k, f in result.fields.items()},
    }
json.dump(out, sys.stdout, indent=2)
print()
