"""The import contracts in ``pyproject.toml`` hold, and a deliberate violation of each breaks ``lint-imports``.

One copy of the three packages carries every planted violation at once, so one real ``lint-imports`` run
shows that each contract notices its own: a contract that could not fail would leave its case out of the
broken list.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pcd_core", "pcd_integrations", "mcp_server")
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
CONTRACTS = CONFIG["tool"]["importlinter"]["contracts"]
FLOW = "Data flows one way"
CORE_ALONE = "The core imports no server, command, wire protocol or framework"
ADAPTERS = "Adapters and servers reach a backend only through the engine"

# (module, the import planted in it, the start of the contract it breaks)
VIOLATIONS = [
    ("pcd_core/reading/readout.py", "import pcd_integrations.http", CORE_ALONE),
    ("pcd_core/engine.py", "import argparse", CORE_ALONE),
    ("pcd_core/result.py", "import fastapi", CORE_ALONE),
    ("pcd_core/backends/base.py", "from pcd_core.request import schema", FLOW),
    ("pcd_core/prompting/compiler.py", "from pcd_core import engine", FLOW),
    ("pcd_core/request/limits.py", "from pcd_core.planning import planner", FLOW),
    ("pcd_integrations/langchain.py", "from pcd_core.backends import torch_backend", ADAPTERS),
    ("mcp_server/server.py", "import pcd_core.backends.base", ADAPTERS),
    ("pcd_core/request/schema.py", "from pcd_core.request import questions", "request:"),
    ("pcd_core/prompting/trie.py", "from pcd_core.prompting import compiler", "prompting:"),
    ("pcd_core/reading/rounds.py", "from pcd_core.reading import read_path", "reading:"),
    ("pcd_core/planning/filling.py", "from pcd_core.planning import deciding", "planning:"),
    ("pcd_core/concurrency/model_lock.py", "from pcd_core.concurrency import pass_join", "concurrency:"),
    ("pcd_core/trust/heads.py", "from pcd_core.trust import calibration", "trust:"),
    ("pcd_core/loading/options.py", "from pcd_core.loading import model_files", "loading:"),
    ("pcd_core/backends/base.py", "from pcd_core.backends import torch_backend", "backends:"),
]


def _copy(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _broken_sections(stdout: str) -> dict[str, str]:
    """Each broken contract's name (its first words) and the report under it."""
    report = stdout.split("Broken contracts", 1)[1]
    sections: dict[str, str] = {}
    for contract in CONTRACTS:
        name = contract["name"]
        start = report.find(name[:40])
        if start >= 0:
            ends = [i for other in CONTRACTS if (i := report.find(other["name"][:40], start + 1)) > start]
            sections[name] = report[start : min(ends, default=len(report))]
    return sections


def test_the_project_keeps_every_contract(tmp_path):
    run = _lint(_copy(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"{len(CONTRACTS)} kept, 0 broken" in run.stdout


def test_each_deliberate_violation_breaks_its_own_contract(tmp_path):
    root = _copy(tmp_path)
    for module, bad_import, _ in VIOLATIONS:
        path = root / module
        path.write_text(path.read_text(encoding="utf-8") + f"\n{bad_import}  # noqa\n", encoding="utf-8")
    run = _lint(root)
    assert run.returncode != 0
    sections = _broken_sections(run.stdout)
    for module, _, contract in VIOLATIONS:
        named = [name for name in sections if name.startswith(contract)]
        assert named, f"{contract!r} did not break: {sorted(sections)}"
        dotted = module.removesuffix(".py").replace("/", ".")
        assert any(dotted in sections[name] for name in named), (module, contract)


def _placed(layers: list[str], prefix: str = "") -> set[str]:
    return {prefix + name.strip() for layer in layers for name in layer.replace("|", ":").split(":")}


def test_every_core_module_has_a_layer():
    """A module left out of the layers is checked by no layer contract: each must be placed, and each
    module inside a concept package must be placed in its package's own contract."""
    core = ROOT / "pcd_core"
    placed = _placed(CONTRACTS[0]["layers"])
    modules = {f"pcd_core.{path.stem}" for path in core.glob("*.py") if path.stem != "__init__"}
    packages = {f"pcd_core.{path.name}" for path in core.iterdir() if (path / "__init__.py").is_file()}
    assert modules | packages <= placed, sorted((modules | packages) - placed)
    by_container = {c["containers"][0]: _placed(c["layers"]) for c in CONTRACTS if "containers" in c}
    for container, inside in by_container.items():
        folder = ROOT / container.replace(".", "/")
        present = {path.stem for path in folder.glob("*.py") if path.stem != "__init__"}
        assert present == inside, (container, sorted(present ^ inside))
