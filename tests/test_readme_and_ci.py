"""The README's two set-up commands are the ones .ci/run runs, verbatim."""

import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_setup_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_ci_runs_the_readme_commands():
    commands = readme_setup_commands()
    assert len(commands) == 2, commands
    ci_lines = [line.strip() for line in open(os.path.join(REPO, ".ci", "run"))]
    for command in commands:
        assert command in ci_lines, f"{command!r} is not in .ci/run"
