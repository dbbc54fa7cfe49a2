"""The seven-field double-billing ticket, raw and debiased, on one model: JSON on stdout."""

import json
import sys
from pathlib import Path

from pcd_core import Engine

right = {
    "sentiment": "NEGATIVE",
    "topic": "BILLING",
    "wants_refund": True,
    "is_spam": False,
    "deadline": "12_HOURS",
    "plan": "PREMIUM",
    "route_to": "BILLING_TEAM",
}
schema = json.loads(Path("examples/ticket_schema.json").read_text())
text = Path("examples/ticket.txt").read_text()
engine = Engine.load(sys.argv[1])
out = {"model": engine.model_name, "right": right}
for debias in (False, True):
    result = engine.fill(schema, text, debias=debias)
    key = "debiased" if debias else "raw"
    out[key] = {
        "values": result.values,
        "n_right": sum(result.values[k] == v for k, v in right.items()),
        "probability": {k: round(f.probability, 3) for k, f in result.fields.items()},
        "candidate_mass": {k: round(f.candidate_mass, 3) for k, f in result.fields.items()},
    }
json.dump(out, sys.stdout, indent=2)
print()
