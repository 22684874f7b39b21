"""The README's two set-up commands are the ones .ci/run runs, verbatim; the slow tier it names (``-m slow``) is
marked where each test is defined, and every mark names the default-tier test that stands in for it."""

import glob
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


def test_ci_runs_the_readme_aot_tier():
    """The README's aot tier (every kernel through the TPU's and the H100's compilers) is a line of .ci/run."""
    text = open(os.path.join(REPO, "README.md")).read()
    tier = r"`(\.venv/bin/pip install -e \"\.\[aot\]\" && [^`]*-m aot tests/aot)`"
    commands = [" ".join(command.split()) for command in re.findall(tier, text)]  # one line, wrapped in the README
    assert len(commands) == 1, commands
    assert commands[0] in [line.strip() for line in open(os.path.join(REPO, ".ci", "run"))]


SLOW_MARK = re.compile(r"pytest\.mark\.slow\b")
STAND_IN = re.compile(r"default[ -]tier")
STAND_IN_WITHIN = 6  # lines above a mark (a decorator's comment, a parametrize list's head)


def unexplained_slow_marks(path: str) -> list[str]:
    """Each line of ``path`` that marks a test slow with no "default tier: ..." on it or in the lines just above."""
    lines = open(path).read().splitlines()
    return [f"{os.path.relpath(path, REPO)}:{i + 1}: {line.strip()}" for i, line in enumerate(lines)
            if SLOW_MARK.search(line)
            and not any(STAND_IN.search(above) for above in lines[max(0, i - STAND_IN_WITHIN):i + 1])]


def test_every_slow_test_names_its_default_tier_stand_in():
    paths = glob.glob(os.path.join(REPO, "tests", "**", "test_*.py"), recursive=True)
    marked = [path for path in paths if any(SLOW_MARK.search(line) for line in open(path))]
    assert len(marked) > 20, marked  # the slow tier is marked in the test modules themselves
    unexplained = [line for path in sorted(paths) for line in unexplained_slow_marks(path)]
    assert not unexplained, "slow marks without the default-tier test standing in for them:\n" + "\n".join(unexplained)


def test_the_stand_in_check_sees_an_unexplained_mark(tmp_path):
    module = tmp_path / "test_x.py"
    mark = "pytest.mark." + "slow"
    module.write_text(f"# slow: a; default tier: test_b\n@{mark}\ndef test_a():\n    pass\n\n\n\n\n\n\n\n"
                      f"@{mark}  # no stand-in named\ndef test_c():\n    pass\n")
    assert [line.split(": ", 1)[1] for line in unexplained_slow_marks(str(module))] == [
        f"@{mark}  # no stand-in named"]
