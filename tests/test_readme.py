"""The README's commands are the ones that run: CI's test command and the example files exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_exactly_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"TEST_COMMAND='(.+)'", ci).group(1)
    assert readme_commands()[1] == command


def test_the_main_command_uses_shipped_examples():
    main = readme_commands()[0]
    for path in re.findall(r"examples/\S+", main):
        assert (ROOT / path).is_file(), path
