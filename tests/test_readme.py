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


def test_exit_code_table_lists_every_error_kind():
    from kestrel.artifacts import errors

    text = open(os.path.join(REPO, "README.md")).read()
    section = re.search(r"^### Exit codes\n(.*?)^## ", text, re.S | re.M).group(1)
    listed = {int(m) for m in re.findall(r"^\| (\d+) \|", section, re.M)}
    kinds = {cls.exit_code for cls in vars(errors).values()
             if isinstance(cls, type) and issubclass(cls, errors.KestrelError) and cls is not errors.KestrelError}
    assert listed == kinds | {0, 2}, (listed, kinds)
