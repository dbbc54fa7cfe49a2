"""``docs/layout.md``'s package tables name exactly the modules the tree holds: the engine's table
``pcd_core/``, the front doors' table ``pcd_integrations/``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (?P<where>[^|]+) \| [^|]+ \| (?P<modules>[^|]+) \|$")
#: each section of the page and the package its table describes
SECTIONS = {"## The engine, package by package": "pcd_core", "## The front doors": "pcd_integrations"}
#: rows that say "(their own modules)" instead of naming them
UNLISTED = {"bench", "evaluation"}


def _table(heading: str) -> dict[str, set[str]]:
    """Each row of the section's table: its first cell (a package folder or module files) and the modules
    (and, ending in ``/``, the packages) it names."""
    text = (ROOT / "docs/layout.md").read_text(encoding="utf-8")
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match and match["where"].startswith("`"):
            rows[match["where"]] = set(re.findall(r"`([a-z_]+)/?`", match["modules"]))
    return rows


def _modules(folder: Path) -> set[str]:
    """The modules and the packages directly inside a package."""
    files = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    return files | {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}


@pytest.mark.parametrize(("heading", "package"), SECTIONS.items())
def test_every_package_row_names_its_modules(heading: str, package: str):
    rows = _table(heading)
    assert rows, heading
    for where, modules in rows.items():
        for folder in re.findall(r"`([a-z_]+)/`", where):
            if folder in UNLISTED:
                continue
            present = _modules(ROOT / package / folder)
            assert present == modules, (package, folder, sorted(present ^ modules))


@pytest.mark.parametrize(("heading", "package"), SECTIONS.items())
def test_every_module_and_package_has_a_row(heading: str, package: str):
    rows = _table(heading)
    named_files = {m for where in rows for m in re.findall(r"`([a-z_]+)\.py`", where)}
    named_folders = {m for where in rows for m in re.findall(r"`([a-z_]+)/`", where)}
    root = ROOT / package
    files = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    folders = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    assert files == named_files, sorted(files ^ named_files)
    assert folders == named_folders, sorted(folders ^ named_folders)


#: file names the code cites that are not this project's: other libraries' sources the wire models and
#: adapters follow, files a user writes or a model folder holds, and the style guide beside the project
NOT_OURS = {
    "STYLE.md",
    "chat_completion.py",
    "chat_completion_chunk.py",
    "decision.py",
    "dspy/adapters/decision_state.py",
    "openai/types/chat/chat_completion.py",
    "openai/types/decision_create_params.py",
    "config.json",
    "settings.json",
    "schema.json",
    "claude_desktop_config.json",
    ".mcp.json",
    ".cursor/mcp.json",
    ".vscode/mcp.json",
    "/openapi.json",
}
CITED = re.compile(r"``?([A-Za-z0-9_./-]+\.(?:py|md|json|sh|toml))``?")


def test_every_cited_file_exists():
    """A docstring, comment or page that names a file (``model_lock.py``, ``docs/trust.md``) names
    one this tree holds, by its path or by its name, so that a move or a rename cannot leave a
    pointer behind.
    """
    tracked = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts]
    sources = [
        p
        for top in ("pcd_core", "pcd_integrations", "mcp_server", "tests", "examples")
        for p in (ROOT / top).rglob("*.py")
    ]
    sources += [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"]
    missing = {}
    for source in sources:
        for cited in CITED.findall(source.read_text(encoding="utf-8")):
            if cited in NOT_OURS or cited.startswith("..."):
                continue
            if not any(path == cited or path.endswith("/" + cited) for path in tracked):
                missing.setdefault(cited, []).append(source.relative_to(ROOT).as_posix())
    assert not missing, missing
