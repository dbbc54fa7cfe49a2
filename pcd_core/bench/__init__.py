"""``pcd bench``: PCD against token-by-token generation on the same model, prompt and cached head.

``checks`` judges outputs, ``baselines`` holds the competitors, ``measure`` times them, ``runner``
makes one record per schema and backend, ``report`` prints and plots. The ``pcd bench`` command that
parses arguments and drives them lives outside the core, in ``pcd_integrations/commands/bench.py``.
"""

from pcd_core.bench.checks import agreement, is_valid, parse_lenient, valid_output
from pcd_core.bench.runner import BenchCase, bench_case, bench_throughput

__all__ = [
    "BenchCase",
    "agreement",
    "bench_case",
    "bench_throughput",
    "is_valid",
    "parse_lenient",
    "valid_output",
]
