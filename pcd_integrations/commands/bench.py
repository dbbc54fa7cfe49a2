"""``pcd bench``: arguments, the loop over schemas, field counts and backends, and the outputs.

Arguments and schema files are checked before any model loads. A backend that cannot load (the mlx
extra missing, say) is reported on stderr and skipped, so ``--backend all`` still measures the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from pcd_core import BACKENDS, DEFAULT_LIMITS, LoadOptions, PcdError, parse_schema
from pcd_core.bench.choices import bench_choices
from pcd_core.bench.report import write_json, write_plot, write_table
from pcd_core.bench.runner import BASELINES, BenchCase, bench_case, bench_throughput
from pcd_core.bench.session_memory import bench_session_memory
from pcd_core.bench.sessions import bench_session, load_conversation
from pcd_core.bench.widths import bench_widths
from pcd_core.loading.dummy_weights import check_architecture
from pcd_integrations.commands import common
from pcd_integrations.commands.bench_clients import bench_clients
from pcd_integrations.commands.bench_hangup import bench_hangup

#: what ``--backend all`` runs, in turn
LOCAL_BACKENDS = tuple(name for name in BACKENDS if name != "vllm")
DATA_DIR = Path(str(resources.files("pcd_core") / "benchdata"))  # the bundled cases, in an installed package too


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the ``pcd`` subparsers; ``run_bench`` is set as its ``run``."""
    bench = subparsers.add_parser(
        "bench", help="measure PCD against token-by-token generation on the same model and prompt"
    )
    bench.add_argument(
        "--schema",
        action="append",
        metavar="FILE_OR_CASE",
        help="a JSON Schema file, a case file (json_schema + input) or the name of a "
        "bundled case; repeatable (default: every bundled case with a json_schema)",
    )
    bench.add_argument("--input", metavar="FILE", help="the text for a --schema file that carries none")
    bench.add_argument(
        "--versus",
        choices=LOCAL_BACKENDS,
        help="also time PCD on this backend (same model) in the same repeats: a cross-backend ratio",
    )
    bench.add_argument("--repeat", type=int, default=3, help="timed repeats per method; medians are reported")
    bench.add_argument(
        "--fields",
        metavar="N,N,...",
        help="run each schema truncated to its first N fields, once per N (e.g. 4,8,16,28)",
    )
    bench.add_argument(
        "--baselines",
        default=",".join(BASELINES),
        help="which competitors to run, from ar,arc,seq (default: all three)",
    )
    bench.add_argument("--ar-cap", type=int, default=None, help="cap on AR's new tokens (default: 16 x fields + 32)")
    bench.add_argument(
        "--throughput",
        type=int,
        default=0,
        metavar="N",
        help="instead, fill N inputs against the first schema one at a time, then with fill_many (read "
        "together), and report documents/s of each and their ratio",
    )
    bench.add_argument(
        "--throughput-inputs",
        metavar="FILE",
        help="the --throughput inputs, taken in turn: one text per line, or JSON lines with a 'text' "
        "(pcd eval's data.jsonl); default: numbered copies of the case's input",
    )
    bench.add_argument(
        "--clients",
        type=int,
        default=0,
        metavar="N",
        help="instead, serve the engine on a loopback port and time one HTTP client, then N at once, on "
        "/v1/chat/completions (generated tokens/s) and /v1/decisions (requests/s)",
    )
    bench.add_argument(
        "--client-requests", type=int, default=8, metavar="R", help="--clients: requests each client sends"
    )
    bench.add_argument(
        "--client-tokens", type=int, default=32, metavar="M", help="--clients: max_tokens of each chat reply"
    )
    bench.add_argument(
        "--hangup",
        type=int,
        nargs="?",
        const=200,
        default=0,
        metavar="N",
        help="instead, serve the engine on a loopback port, start a decide of N questions (default 200), hang "
        "up once its pass is under way and time a short decide sent then, with the in-pass cancellation "
        "check off and on (--repeat drops each)",
    )
    bench.add_argument(
        "--choices",
        metavar="N,N,...",
        help="instead, time one choice question of N options per N (e.g. 64,128,255): ms, passes, row tokens",
    )
    bench.add_argument(
        "--widths",
        metavar="N,N,...",
        help="instead, time one pass of K short requests after a fixed prefix per K (e.g. 1,2,4,8,16): "
        "tokens/s per width, the most a batch can gain over reading its requests one at a time",
    )
    bench.add_argument(
        "--auto",
        nargs="?",
        const=",".join(AUTO_MODELS),
        metavar="MODEL,MODEL,...",
        help="instead, time every backend and dtype backend=auto could pick for each model (default: the "
        f"embedded ones, {', '.join(AUTO_MODELS)}), warm, on the closed 28-field ticket and the mixed one "
        f"({', '.join(AUTO_CASES)}; --schema replaces them), and record what auto picks",
    )
    bench.add_argument(
        "--auto-bfloat16", action="store_true", help="--auto: time torch in bfloat16 too, where auto would not pick it"
    )
    bench.add_argument(
        "--session",
        metavar="CONVERSATION.json",
        help="instead, follow a conversation turn by turn (a JSON file with 'schema' and 'turns', e.g. "
        "examples/support_conversation.json): a session's appends against re-reading the whole "
        "conversation at each turn, same engine, same run",
    )
    bench.add_argument(
        "--session-questions",
        metavar="FILE",
        help="with --session, ask the conversation these questions (a question file as pcd decide takes) "
        "instead of filling its schema",
    )
    bench.add_argument(
        "--session-memory",
        type=int,
        default=0,
        metavar="N",
        help="with --session, instead open N sessions of --session-tokens tokens each (the file's turns in "
        "a cycle) and record the RSS they hold against the stated bound, evictions beyond max_sessions, "
        "and the first session's re-read after its eviction",
    )
    bench.add_argument(
        "--session-tokens",
        type=int,
        default=2000,
        metavar="T",
        help="--session-memory: tokens of each session's conversation (default 2000)",
    )
    bench.add_argument("--json", metavar="OUT.json", help="write the records here")
    bench.add_argument("--plot", metavar="OUT.png", help="plot ms per request against fields here")
    # --backend all: every local backend in turn; vllm: PCD against vLLM's own JSON (--base-url)
    common.add_model_options(bench, opt_in=("dummy_weights",), more_backends=("all",))
    bench.set_defaults(run=run_bench)
    return bench


#: ``--auto``'s models and cases: the embedded models, the closed ticket and its mixed variant
AUTO_MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
AUTO_CASES = ("support_ticket", "docs/bench/support_ticket_mixed.json")


def run_auto_bench(args: argparse.Namespace) -> int:
    """``pcd bench --auto``: ``pcd_core/bench/auto_pick.py``'s table, printed and written as JSON."""
    from pcd_core.bench.auto_pick import bench_auto

    cases = load_cases(args.schema or list(AUTO_CASES), args.input)
    models = [name.strip() for name in args.auto.split(",") if name.strip()]
    command = "pcd " + " ".join(arg for arg in sys.argv[1:] if arg not in ("-v", "--verbose"))

    def write(report: dict[str, Any]) -> None:
        report["meta"]["command"] = command
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")

    report = bench_auto(
        models,
        {case.name: (case.schema, case.text) for case in cases},
        repeat=args.repeat,
        bfloat16=args.auto_bfloat16,
        on_record=write,
    )
    for record in report["records"]:
        if "skipped" in record:
            print(f"{record['model']}: skipped ({record['skipped']})")
            continue
        auto = record["auto"]
        print(
            f"{record['model']} ({record['size_bytes'] / 1e6:.0f} MB {record['format']}): auto picks {auto['backend']} {auto['dtype'] or ''}"
        )
        for label, choice in record["choices"].items():
            medians = ", ".join(f"{case} {ms:.0f} ms" for case, ms in choice["median_ms"].items())
            print(f"  {label:<16} {medians}  (ran {choice['ran']['backend']} {choice['ran']['dtype']})")
    return 0


def load_cases(paths: list[str] | None, input_path: str | None, fallback: str | None = None) -> list[BenchCase]:
    """The cases to run, each schema parsed now so that a bad file fails before the model loads."""
    if not paths:
        paths = sorted(str(p) for p in DATA_DIR.glob("*.json") if "json_schema" in json.loads(p.read_text()))
    text = Path(input_path).read_text(encoding="utf-8") if input_path else None
    cases = []
    for given in paths:
        path = Path(given) if Path(given).exists() else DATA_DIR / f"{given}.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as error:
            raise PcdError(f"cannot read schema {given!r}: {error}") from error
        schema, case_text = (data["json_schema"], data.get("input")) if "json_schema" in data else (data, None)
        task = data.get("task", "") if "json_schema" in data else ""
        if not isinstance(schema, dict) or not isinstance(schema.get("properties"), dict):
            raise PcdError(f"{given!r}: pcd bench takes a JSON Schema with 'properties'")
        parse_schema(schema)
        given_text = text or case_text or fallback  # a schema file's text: --input, else the first --throughput-inputs
        if not isinstance(given_text, str):
            raise PcdError(f"{given!r} carries no input; give --input FILE")
        cases.append(BenchCase(path.stem, schema, given_text, task))
    return cases


def throughput_inputs(path: str | None) -> list[str]:
    """The texts of ``--throughput-inputs``: each line, or each JSON line's ``text``; read before any load."""
    if path is None:
        return []
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        texts = [json.loads(line)["text"] if line.lstrip().startswith("{") else line for line in lines]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise PcdError(
            f"--throughput-inputs {path!r}: {error!r}; give one text per line or JSON lines with 'text'"
        ) from error
    if not texts or not all(isinstance(text, str) and text.strip() for text in texts):
        raise PcdError(f"--throughput-inputs {path!r}: every input must be a non-empty text")
    return texts


def _field_counts(
    spec: str | None, flag: str = "--fields", example: str = "4,8,16,28", least: int = 1
) -> list[int] | None:
    if spec is None:
        return None
    try:
        counts = sorted({int(n) for n in spec.split(",") if n.strip()})
    except ValueError as error:
        raise PcdError(f"{flag} {spec!r}: give comma-separated whole numbers, e.g. {example}") from error
    if not counts or counts[0] < least:
        raise PcdError(f"{flag} {spec!r}: every count must be at least {least}")
    return counts


def choice_counts(args: argparse.Namespace) -> list[int]:
    """The option counts of ``--choices`` (none without it), each a choice the engine admits."""
    counts = _field_counts(args.choices, "--choices", "64,128,255", least=2) or []
    if counts and counts[-1] > DEFAULT_LIMITS.max_options:
        raise PcdError(f"--choices {args.choices}: a choice has at most {DEFAULT_LIMITS.max_options} options")
    if counts and args.backend == "vllm":
        raise PcdError("--choices runs on a local backend, not vllm")
    return counts


def _check(args: argparse.Namespace) -> tuple[list[BenchCase], tuple[str, ...]]:
    if args.repeat < 1:
        raise PcdError(f"--repeat {args.repeat}: at least 1")
    if args.clients < 0:
        raise PcdError(f"--clients {args.clients}: 1 or more")
    for flag, value in (("--client-requests", args.client_requests), ("--client-tokens", args.client_tokens)):
        if value < 1:
            raise PcdError(f"{flag} {value}: at least 1")
    if args.clients and (args.throughput or args.choices or args.versus or args.backend in ("all", "vllm")):
        raise PcdError("--clients runs alone, on one local backend (not with --throughput, --choices or --versus)")
    if args.widths and (args.throughput or args.choices or args.clients or args.versus or args.backend == "vllm"):
        raise PcdError(
            "--widths runs alone, on local backends (not with --throughput, --choices, --clients or --versus)"
        )
    if args.hangup < 0 or args.hangup > DEFAULT_LIMITS.max_questions:
        raise PcdError(f"--hangup {args.hangup}: from 1 to {DEFAULT_LIMITS.max_questions} questions")
    if (
        args.hangup
        and (args.throughput or args.choices or args.clients or args.widths or args.session or args.versus)
        or (args.hangup and args.backend in ("all", "vllm"))
    ):
        raise PcdError(
            "--hangup runs alone, on one local backend (not with --throughput, --choices, --clients, --widths, "
            "--session or --versus)"
        )
    if args.session and (args.throughput or args.choices or args.clients or args.widths or args.versus):
        raise PcdError("--session runs alone (not with --throughput, --choices, --clients, --widths or --versus)")
    if args.session_memory < 0 or args.session_tokens < 1:
        raise PcdError(
            f"--session-memory {args.session_memory} --session-tokens {args.session_tokens}: "
            "a whole number of sessions, each at least 1 token"
        )
    if args.session_questions and (not args.session or args.session_memory):
        raise PcdError("--session-questions goes with --session CONVERSATION.json, and not with --session-memory")
    if args.session_memory and not args.session:
        raise PcdError("--session-memory needs --session CONVERSATION.json: the turns each session reads")
    if args.session and args.backend == "vllm":
        raise PcdError("--session runs on a local backend; vLLM re-reads the text and caches prefixes itself")
    if args.ar_cap is not None and args.ar_cap < 1:
        raise PcdError(f"--ar-cap {args.ar_cap}: at least 1")
    baselines = tuple(b.strip() for b in args.baselines.split(",") if b.strip())
    unknown = set(baselines) - set(BASELINES)
    if unknown:
        raise PcdError(f"--baselines: unknown {sorted(unknown)}; choose from {', '.join(BASELINES)}")
    inputs = throughput_inputs(args.throughput_inputs)
    cases = load_cases(args.schema, args.input, inputs[0] if inputs else None)
    counts = _field_counts(args.fields)
    if counts is not None:
        cases = [case.truncated(n) for case in cases for n in counts if n <= case.n_fields]
        if not cases:
            raise PcdError(f"--fields {args.fields}: every count is above every schema's field count")
    return cases, baselines


def _processor() -> str:
    """The CPU's model name where Linux tells it (figures differ between CPUs), else what platform says."""
    return _cpuinfo("model name") or platform.processor() or platform.system()


#: the CPU's matrix and vector extensions that move a record's ratios: two VMs both named "Intel(R)
#: Xeon(R) Processor" differ in AMX, which makes a wide bfloat16 pass several times cheaper
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def _cpu_features() -> list[str] | None:
    """Which of ``CPU_FEATURES`` the CPU has (Linux's flags); None where the flags cannot be read."""
    flags = _cpuinfo("flags")
    return None if flags is None else [name for name in CPU_FEATURES if name in flags.split()]


def _cpuinfo(key: str) -> str | None:
    """The first value of ``key`` in /proc/cpuinfo, or None (not Linux, or no such line)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == key:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


#: what a run on dummy weights says beside its table and in its JSON
DUMMY_NOTE = (
    "dummy weights: the model's answers are meaningless and left out; only times, pass counts and "
    "token counts compare (the generators write PCD's answer, token by token)"
)


def _options(args: argparse.Namespace) -> tuple[LoadOptions, ...]:
    """The options of each backend to run, all checked before any model loads."""
    backends = LOCAL_BACKENDS if args.backend == "all" else (args.backend,)
    if args.dummy_weights:
        check_architecture(args.dummy_weights)  # a shape without a tokenizer here fails now, not after a load
    return tuple(common.options_from_args(args, backend=backend) for backend in backends)


def run_bench(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pcd_core import Engine

    if args.auto:
        return run_auto_bench(args)
    cases, baselines = _check(args)
    inputs = throughput_inputs(args.throughput_inputs)  # read twice: _check only needed its first text
    choices = choice_counts(args)
    widths = _field_counts(args.widths, "--widths", "1,2,4,8,16") or []
    conversation = load_conversation(args.session) if args.session else None
    questions = None
    if args.session_questions:
        questions = common.read_questions(args.session_questions)["questions"]
        common.check_questions(args.session_questions, "", questions)  # before the model loads
    chosen = _options(args)
    if args.backend == "vllm":
        return run_vllm_bench(args, chosen[0], cases)
    rival = engine = None
    if args.versus:
        if args.versus == args.backend or args.backend == "all":
            raise PcdError(f"--versus {args.versus}: name a backend other than --backend {args.backend}")
        rival = Engine.load(args.model, backend=args.versus, max_tokens_per_pass=args.max_tokens_per_pass)
    steps = 2 + args.repeat * (2 + len(baselines))  # warm-up, repeats, the memory runs
    per_backend = (
        1
        if args.throughput or args.clients or args.hangup or widths or conversation
        else len(choices)
        if choices
        else len(cases) * steps
    )
    total = len(chosen) * per_backend
    records: list[dict[str, Any]] = []
    meta = {
        "command": "pcd " + " ".join(getattr(args, "argv", None) or sys.argv[1:]),
        "model": args.model,
        "machine": f"{platform.machine()} {_processor()}, {os.cpu_count()} CPUs",
        "cpu_features": _cpu_features(),
        "python": platform.python_version(),
        "arc_engine": "pcd-grammar-mask",
        "max_tokens_per_pass": args.max_tokens_per_pass,
        # a torch backend's placement sets the dtype it computes in; llama.cpp reads the GGUF's own types
        "dtype": args.dtype,
    }
    if args.dummy_weights:
        meta.update(model=f"dummy:{args.dummy_weights}", note=DUMMY_NOTE)
        print(f"pcd bench: {DUMMY_NOTE}", file=sys.stderr)
    with tqdm(total=total, desc="pcd bench", unit="run", file=sys.stderr, disable=None) as progress:
        for options in chosen:
            backend = options.backend
            try:
                engine = Engine.load(options)
                meta.update(getattr(engine.backend, "placement", {}))  # the torch device and dtype used
            except (PcdError, ImportError) as error:
                print(f"pcd bench: skipping backend {backend!r}: {error}", file=sys.stderr)
                progress.update(per_backend)
                continue
            if args.throughput:
                records.append(bench_throughput(engine, cases[0], args.throughput, inputs))
                progress.update(1)
                continue
            if args.clients:
                records.extend(bench_clients(engine, args.clients, args.client_requests, args.client_tokens))
                progress.update(1)
                continue
            if args.hangup:
                records.extend(bench_hangup(engine, args.hangup, args.repeat))
                progress.update(1)
                continue
            if widths:
                records.extend(bench_widths(engine, widths, args.repeat))
                progress.update(1)
                continue
            if conversation is not None:
                progress.set_postfix_str(f"{backend} {len(conversation[1])} turns")
                schema, turns = conversation

                def save(partial: dict[str, Any]) -> None:
                    if args.json:
                        write_json([*records, partial], args.json, meta)

                if args.session_memory:
                    records.append(
                        bench_session_memory(
                            engine, schema, turns, args.session_memory, args.session_tokens, on_session=save
                        )
                    )
                else:
                    records.append(
                        bench_session(
                            engine, schema, turns, name=Path(args.session).name, on_turn=save, questions=questions
                        )
                    )
                progress.update(1)
                if args.json:
                    write_json(records, args.json, meta)
                continue
            for n_options in choices:
                progress.set_postfix_str(f"{backend} a choice of {n_options} options")
                records.append(bench_choices(engine, n_options, args.repeat))
                progress.update(1)
                if args.json:
                    write_json(records, args.json, meta)
            if choices:
                continue
            for case in cases:
                progress.set_postfix_str(f"{backend} {case.name} {case.n_fields} fields")
                records.append(
                    bench_case(
                        engine,
                        case,
                        repeat=args.repeat,
                        baselines=baselines,
                        cap=args.ar_cap,
                        tick=lambda: progress.update(1),
                        scripted=bool(args.dummy_weights),
                        rival=rival,
                    )
                )
                if args.json:  # after every record: a long run interrupted still leaves its results
                    write_json(records, args.json, meta)
    if rival is not None and engine is not None and not choices and not args.throughput and not args.clients:
        print("pcd bench: plain generation, then each backend's cold load in a fresh process", file=sys.stderr)
        records.append(_versus_record(args, engine, rival, cases[0]))
    if args.dummy_weights:
        print(f"{DUMMY_NOTE}\n")
    write_table(records, sys.stdout)
    _print_versus(records)
    if args.json:
        write_json(records, args.json, meta)
    if args.plot:
        write_plot(records, args.plot, f"pcd bench, {args.model}")
    return 0 if records else 1


def _versus_record(args: argparse.Namespace, engine: Any, rival: Any, case: BenchCase) -> dict[str, Any]:
    """``--versus``'s lines beyond the fills: plain generation in this process, then the cold load and
    the RSS of each backend in a fresh process of its own (``pcd_core/bench/versus.py``).
    """
    from pcd_core.bench.versus import bench_cold, bench_generation

    record: dict[str, Any] = {
        "mode": "versus",
        "backend": engine.backend.name,
        "rival_backend": rival.backend.name,
        "model": engine.model_name,
        "repeat": args.repeat,
    }
    record.update(bench_generation(engine, rival, args.repeat))
    record.update(bench_cold(args.model, engine.backend.name, rival.backend.name, case.schema, case.text))
    return record


def _print_versus(records: list[dict[str, Any]]) -> None:
    """The cross-backend ratios under the table: each fill, then generation, cold load and memory."""
    for record in records:
        if record.get("mode") is None and "rival_backend" in record:
            print(
                f"{record['schema']} {record['fields']} fields: PCD on {record['rival_backend']} "
                f"{record['rival_pcd_ms']:.0f} ms, on {record['backend']} {record['pcd_ms']:.0f} ms "
                f"({record['rival_ratio']:.2f}x)"
            )
        if record.get("mode") == "versus":
            ours, theirs = record["backend"], record["rival_backend"]
            print(
                f"plain generation: {record['generation_tokens_per_s']:.1f} tokens/s on {ours}, "
                f"{record['rival_generation_tokens_per_s']:.1f} on {theirs} ({record['generation_ratio']:.2f}x)\n"
                f"cold load (empty cache): {record['cold_load_ms']:.0f} ms on {ours}, "
                f"{record['rival_cold_load_ms']:.0f} ms on {theirs} ({record['load_ratio']:.2f}x faster)\n"
                f"RSS after a warm load and one fill: {record['rss_mb']:.0f} MB on {ours}, "
                f"{record['rival_rss_mb']:.0f} MB on {theirs} ({record['rss_ratio']:.2f} of it)"
            )


def run_vllm_bench(args: argparse.Namespace, options: LoadOptions, cases: list[BenchCase]) -> int:
    """The ``--backend vllm`` branch of ``pcd bench``: one record per case, a table, ``--json``."""
    # here, not at the top: the vLLM client needs httpx, which a plain install of the torch extra lacks
    from pcd_core import Engine
    from pcd_core.bench.vllm_baselines import bench_vllm_case, write_vllm_table

    engine = Engine.load(options)
    records = [bench_vllm_case(engine, case, repeat=args.repeat, cap=args.ar_cap) for case in cases]
    write_vllm_table(records, sys.stdout)
    if args.json:
        meta = {"command": "pcd " + " ".join(sys.argv[1:]), "model": args.model, "base_url": args.base_url}
        write_json(records, args.json, meta)
    return 0 if records else 1
