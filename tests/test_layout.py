"""``docs/layout.md``'s package table names exactly the modules the tree holds."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "pcd_core"
ROW = re.compile(r"^\| (?P<where>[^|]+) \| [^|]+ \| (?P<modules>[^|]+) \|$")


def _table() -> dict[str, set[str]]:
    """Each row's first cell (a package folder or module files) and the modules it names."""
    rows: dict[str, set[str]] = {}
    for line in (ROOT / "docs/layout.md").read_text(encoding="utf-8").splitlines():
        match = ROW.match(line)
        if match and match["where"].startswith("`"):
            rows[match["where"]] = set(re.findall(r"`([a-z_]+)`", match["modules"]))
    return rows


def test_every_package_row_names_its_modules():
    rows = _table()
    for where, modules in rows.items():
        for folder in re.findall(r"`([a-z_]+)/`", where):
            if folder in ("bench", "evaluation"):
                continue
            present = {p.stem for p in (CORE / folder).glob("*.py") if p.stem != "__init__"}
            assert present == modules, (folder, sorted(present ^ modules))


def test_every_core_module_and_package_has_a_row():
    rows = _table()
    named_files = {m for where in rows for m in re.findall(r"`([a-z_]+)\.py`", where)}
    named_folders = {m for where in rows for m in re.findall(r"`([a-z_]+)/`", where)}
    files = {p.stem for p in CORE.glob("*.py") if p.stem != "__init__"}
    folders = {p.name for p in CORE.iterdir() if (p / "__init__.py").is_file()}
    assert files == named_files, sorted(files ^ named_files)
    assert folders == named_folders, sorted(folders ^ named_folders)
