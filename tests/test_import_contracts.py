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
INTEGRATIONS = "integrations: the commands over the HTTP server"
INDEPENDENT_DOORS = "integrations: the HTTP server, each framework adapter"

# (module, the import planted in it, the start of the contract it breaks)
VIOLATIONS = [
    ("pcd_core/reading/readout.py", "import pcd_integrations.http", CORE_ALONE),
    ("pcd_core/engine.py", "import argparse", CORE_ALONE),
    ("pcd_core/result.py", "import fastapi", CORE_ALONE),
    ("pcd_core/backends/base.py", "from pcd_core.request import schema", FLOW),
    ("pcd_core/prompting/compiler.py", "from pcd_core import engine", FLOW),
    ("pcd_core/request/limits.py", "from pcd_core.planning import planner", FLOW),
    ("pcd_integrations/langchain/chat_model.py", "from pcd_core.backends import torch_backend", ADAPTERS),
    ("mcp_server/server.py", "import pcd_core.backends.base", ADAPTERS),
    ("pcd_core/request/schema.py", "from pcd_core.request import questions", "request:"),
    ("pcd_core/prompting/trie.py", "from pcd_core.prompting import compiler", "prompting:"),
    ("pcd_core/reading/rounds.py", "from pcd_core.reading import read_path", "reading:"),
    ("pcd_core/planning/filling.py", "from pcd_core.planning import deciding", "planning:"),
    ("pcd_core/concurrency/model_lock.py", "from pcd_core.concurrency import pass_join", "concurrency:"),
    ("pcd_core/trust/heads.py", "from pcd_core.trust import calibration", "trust:"),
    ("pcd_core/loading/options.py", "from pcd_core.loading import model_files", "loading:"),
    ("pcd_core/backends/base.py", "from pcd_core.backends import torch_backend", "backends:"),
    ("pcd_integrations/serving/guards.py", "from pcd_integrations.http import errors", INTEGRATIONS),
    ("pcd_integrations/llama_index/text.py", "import pcd_integrations.langchain.decisions", INDEPENDENT_DOORS),
    ("pcd_integrations/http/errors.py", "from pcd_integrations.http import calls", "http:"),
    ("pcd_integrations/serving/guards.py", "from pcd_integrations.serving import operations", "serving:"),
    ("pcd_integrations/langchain/decisions.py", "from pcd_integrations.langchain import chat_model", "langchain:"),
    ("pcd_integrations/llama_index/text.py", "from pcd_integrations.llama_index import llm", "llama_index:"),
]


#: packages of pcd_integrations whose modules no layer contract orders yet (the commands, the wire models)
NO_CONTRACT = {"commands", "wire"}


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


def _children(folder: Path) -> set[str]:
    """The modules and the packages directly inside a package."""
    modules = {path.stem for path in folder.glob("*.py") if path.stem != "__init__"}
    return modules | {path.name for path in folder.iterdir() if (path / "__init__.py").is_file()}


def test_every_module_has_a_layer():
    """A module left out of the layers is checked by no layer contract: each of the core's modules must be
    placed in the flow, and each module or package inside a container (a core concept package,
    ``pcd_integrations`` and its packages) must be placed in that container's own contract."""
    placed = _placed(CONTRACTS[0]["layers"])
    core = {f"pcd_core.{name}" for name in _children(ROOT / "pcd_core")}
    assert core <= placed, sorted(core - placed)
    by_container = {c["containers"][0]: _placed(c["layers"]) for c in CONTRACTS if "containers" in c}
    core_packages = {name for name in core if (ROOT / name.replace(".", "/")).is_dir()} - {
        "pcd_core.bench",
        "pcd_core.evaluation",
    }
    integrations = {"pcd_integrations"} | {
        f"pcd_integrations.{name}" for name in _children(ROOT / "pcd_integrations") if name not in NO_CONTRACT
    }
    integrations = {name for name in integrations if (ROOT / name.replace(".", "/")).is_dir()}
    containers = core_packages | integrations
    assert containers <= set(by_container), sorted(containers - set(by_container))
    for container, inside in by_container.items():
        present = _children(ROOT / container.replace(".", "/"))
        assert present == inside, (container, sorted(present ^ inside))
