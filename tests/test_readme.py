"""The README's commands are the ones that run: CI's test command and the example files exist.

Its python blocks run in ``tests/test_docs.py``, with those of the documentation pages.
"""

import re
from pathlib import Path

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
    """The README is what a newcomer reads first (issue 31): short, and every relative link resolves
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
