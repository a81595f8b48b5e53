"""Golden files, one pass per case (LLVM lit style). tests/golden/<pass>/<case>.in.ir is parsed, the one
pass runs through the pipeline's own ``run_pass`` (options from its `# pass-options:` line; the op
verifier and the pass's check run after it, as in every build), and the result must meet each
expectation the case has:
  * <case>.out.ir   the whole printed result (short cases);
  * <case>.diff     a unified diff from the input to the result: what the pass did (longer cases);
  * <case>.checks   FileCheck lines (tests/filecheck.py) a person writes, for the lines a case is about
                    (select_kernels: which kernel each op gets, and the launch numbers only where the
                    case is about that rule, so a launch-rule retune does not rewrite unrelated goldens).
KESTREL_UPDATE_GOLDEN=1 rewrites the .out.ir and .diff files (never .checks); read the diff before
committing. Inputs come from tests/golden/make_inputs.py."""
import difflib
import glob
import json
import os

import pytest

from filecheck import filecheck
from kestrel.compiler.ir_text import parse_program, print_program
from kestrel.passes.pipeline import PASS_NAMES, PassOptions, pass_named, run_pass

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
CASES = sorted(glob.glob(os.path.join(HERE, "*", "*.in.ir")))
UPDATE = os.environ.get("KESTREL_UPDATE_GOLDEN") == "1"


def pass_diff(before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), "input", "output", n=1))


def test_every_pass_has_three_cases():
    for name in PASS_NAMES:
        assert len(glob.glob(os.path.join(HERE, name, "*.in.ir"))) >= 3, name


def test_every_case_has_an_expectation():
    for path in CASES:
        stem = path[: -len(".in.ir")]
        assert any(os.path.exists(stem + ext) for ext in (".out.ir", ".diff", ".checks")), stem


def _compare(expected_path: str, got: str, pass_name: str):
    if UPDATE:
        with open(expected_path, "w") as f:
            f.write(got)
        return
    expected = open(expected_path).read()
    if got != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), got.splitlines(True), "expected", "got"))
        pytest.fail(f"{pass_name} output differs from {os.path.relpath(expected_path)}:\n{diff}")


@pytest.mark.parametrize("path", CASES, ids=[os.path.relpath(c, HERE)[:-6] for c in CASES])
def test_golden(path):
    pass_name = os.path.basename(os.path.dirname(path))
    stem = path[: -len(".in.ir")]
    text = open(path).read()
    first = text.splitlines()[0]
    opts = json.loads(first.split(":", 1)[1]) if first.startswith("# pass-options:") else {}
    program = parse_program(text)
    result = run_pass(pass_named(pass_name), program, PassOptions(**opts))
    got = print_program(result)
    assert print_program(parse_program(got)) == got  # the output round-trips too
    if os.path.exists(stem + ".out.ir"):
        _compare(stem + ".out.ir", got, pass_name)
    if os.path.exists(stem + ".diff"):
        _compare(stem + ".diff", pass_diff(print_program(program), got), pass_name)
    if os.path.exists(stem + ".checks"):
        filecheck(got, open(stem + ".checks").read())
