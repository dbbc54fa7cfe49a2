"""``pcd bench``: PCD against token-by-token generation on the same model, prompt and cached head.

``checks`` judges outputs, ``baselines`` holds the competitors, ``measure`` times them, ``runner``
makes one record per schema and backend, ``report`` prints and plots, ``command`` is the CLI.
"""

from .checks import agreement, is_valid, parse_lenient, valid_output
from .command import add_bench_parser, main, run_bench
from .runner import BenchCase, bench_case, bench_throughput

__all__ = [
    "BenchCase",
    "add_bench_parser",
    "agreement",
    "bench_case",
    "bench_throughput",
    "is_valid",
    "main",
    "parse_lenient",
    "run_bench",
    "valid_output",
]
