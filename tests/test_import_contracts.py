"""The layer contracts in ``pyproject.toml`` hold, and a deliberate violation of each breaks ``lint-imports``.

Each case copies the three packages and the configuration into a temporary folder, adds one bad import
to one module, and runs the real ``lint-imports`` there: a contract that could not fail would let the
copy pass.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pcd_core", "pcd_integrations", "mcp_server")
LAYERS = "Data flows one way"
CORE_ALONE = "The core imports no server, command, wire protocol or framework"
ADAPTERS = "Adapters and servers reach a backend only through the engine"


def _copy(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    command = [str(Path(sys.executable).with_name("lint-imports")), "--no-cache"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_project_keeps_every_contract(tmp_path):
    run = _lint(_copy(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 kept, 0 broken" in run.stdout


@pytest.mark.parametrize(
    ("module", "bad_import", "contract"),
    [
        ("pcd_core/readout.py", "import pcd_integrations.http", CORE_ALONE),
        ("pcd_core/schema.py", "import mcp_server.server", CORE_ALONE),
        ("pcd_core/engine.py", "import argparse", CORE_ALONE),
        ("pcd_core/result.py", "import fastapi", CORE_ALONE),
        ("pcd_core/backends/base.py", "from pcd_core import schema", LAYERS),
        ("pcd_core/compiler.py", "from pcd_core import engine", LAYERS),
        ("pcd_integrations/langchain.py", "from pcd_core.backends import torch_backend", ADAPTERS),
        ("mcp_server/server.py", "import pcd_core.backends.base", ADAPTERS),
    ],
)
def test_a_deliberate_violation_breaks_its_contract(tmp_path, module, bad_import, contract):
    root = _copy(tmp_path)
    path = root / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{bad_import}  # noqa\n", encoding="utf-8")
    run = _lint(root)
    assert run.returncode != 0
    assert f"{contract}" in run.stdout
    broken = run.stdout.split("Broken contracts", 1)[1]
    assert module.removesuffix(".py").replace("/", ".") in broken
