"""The FileCheck the golden tests use (tests/filecheck.py): each directive can fail."""
import pytest

from filecheck import CheckFailure, filecheck

OUT = """header
%0 : f32[8] = matmul %a, w launch{kernel="matvec_bf16", grid=[4,1,1]}
%1 : f32[8] = rmsnorm %0, n {eps=1e-06} launch{kernel="rmsnorm", grid=[1,1,1]}
dyn.sampled = sample %1 launch{kernel="sample"}
"""


def test_passing_checks():
    filecheck(OUT, """
        CHECK: matmul
        CHECK-SAME: kernel="matvec_{{bf16|q4g128}}"
        CHECK-NEXT: = rmsnorm
        CHECK-NOT: add_rmsnorm
        CHECK: sample
    """)


@pytest.mark.parametrize("checks, why", [
    ("CHECK: attn_step", "matches no later line"),
    ("CHECK: rmsnorm\nCHECK: matmul", "matches no later line"),  # order matters
    ("CHECK: matmul\nCHECK-NEXT: sample", "does not match the next line"),
    ("CHECK: matmul\nCHECK-SAME: kernel=\"rmsnorm\"", "rest of the previous match's line"),
    ("CHECK: header\nCHECK-NOT: rmsnorm\nCHECK: sample", "CHECK-NOT"),
    ("CHECK: sample\nCHECK-NOT: {{grid=\\[4}}", None),  # nothing after sample: passes
    ("CHECK: header\nCHECK-NOT: {{grid=\\[4}}", "CHECK-NOT"),
])
def test_each_directive_fails(checks, why):
    if why is None:
        filecheck(OUT, checks)
        return
    with pytest.raises(CheckFailure, match=why if why != "CHECK-NOT" else "CHECK-NOT"):
        filecheck(OUT, checks)


def test_checks_without_a_positive_directive_are_refused():
    with pytest.raises(ValueError, match="no positive CHECK"):
        filecheck(OUT, "CHECK-NOT: attn_step")
    with pytest.raises(ValueError, match="not a directive"):
        filecheck(OUT, "CHEK: matmul")
