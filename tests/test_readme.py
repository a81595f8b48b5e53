"""The README's Quick start has exactly two commands, and .ci/run runs the test one verbatim."""
import os
import re

from conftest import REPO


def quick_start_commands():
    text = open(os.path.join(REPO, "README.md")).read()
    section = re.search(r"^## Quick start\n(.*?)^## ", text, re.S | re.M).group(1)
    return [l.strip() for l in section.splitlines() if l.startswith("    ")]


def test_two_commands_and_ci_runs_the_test_one():
    cmds = quick_start_commands()
    assert len(cmds) == 2
    assert "kestrelc build tiny" in cmds[0] and "kestrel-run tiny.plan" in cmds[0]
    assert "pytest" in cmds[1]
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert cmds[1] in ci.splitlines()
