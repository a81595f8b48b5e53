"""Golden files, one pass per file (LLVM lit style): tests/golden/<pass>/<case>.in.ir is parsed, the
one pass runs (options from its `# pass-options:` line), and the printed result must equal
<case>.out.ir. KESTREL_UPDATE_GOLDEN=1 rewrites the expected files; read the diff before committing.
Inputs come from tests/golden/make_inputs.py."""
import glob
import json
import os

import pytest

from kestrel.compiler.ir import verify
from kestrel.compiler.ir_text import parse_program, print_program
from kestrel.compiler.pipeline import PASS_NAMES
from kestrel.passes.fuse import fuse
from kestrel.passes.hoist_dynamic import hoist_dynamic
from kestrel.passes.plan_memory import plan_memory
from kestrel.passes.quantize import quantize
from kestrel.passes.select_kernels import select_kernels

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
PASSES = {
    "fuse": lambda p, o: fuse(p),
    "quantize": lambda p, o: quantize(p, o.get("quant", "none"), o.get("q4_group", 128)),
    "hoist_dynamic": lambda p, o: hoist_dynamic(p),
    "plan_memory": lambda p, o: plan_memory(p),
    "select_kernels": lambda p, o: select_kernels(p, o.get("target", "cpu")),
}
CASES = sorted(glob.glob(os.path.join(HERE, "*", "*.in.ir")))


def test_every_pass_has_three_cases():
    for name in PASS_NAMES:
        assert len(glob.glob(os.path.join(HERE, name, "*.in.ir"))) >= 3, name


@pytest.mark.parametrize("path", CASES, ids=[os.path.relpath(c, HERE)[:-6] for c in CASES])
def test_golden(path):
    pass_name = os.path.basename(os.path.dirname(path))
    text = open(path).read()
    first = text.splitlines()[0]
    opts = json.loads(first.split(":", 1)[1]) if first.startswith("# pass-options:") else {}
    program = parse_program(text)
    result = PASSES[pass_name](program, opts)
    verify(result)
    got = print_program(result)
    assert print_program(parse_program(got)) == got  # the output round-trips too
    expected_path = path[: -len(".in.ir")] + ".out.ir"
    if os.environ.get("KESTREL_UPDATE_GOLDEN") == "1":
        with open(expected_path, "w") as f:
            f.write(got)
        return
    assert os.path.exists(expected_path), f"no expected file: run with KESTREL_UPDATE_GOLDEN=1 and review it"
    expected = open(expected_path).read()
    if got != expected:
        import difflib

        diff = "".join(difflib.unified_diff(expected.splitlines(True), got.splitlines(True), "expected", "got"))
        pytest.fail(f"{pass_name} output differs from {os.path.relpath(expected_path)}:\n{diff}")
