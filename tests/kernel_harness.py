"""Running Triton kernels in Triton's interpreter inside the normal test process, and checking them.

``interpret(jitfn)[grid](*args, **constexprs)`` runs a @triton.jit kernel on CPU torch tensors
(TRITON_INTERPRET=1 would have to be set before import and would break AOT compilation in the
same process). Pass dyn slots as 1-element torch.int32 / torch.float32 tensors.
"""
from __future__ import annotations

import torch


def interpret(jitfn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(jitfn.fn)


def assert_close(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float, what: str = ""):
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    assert torch.isfinite(ref).all(), f"{what}: reference has non-finite values (bad test inputs)"
    assert ref.abs().max() > 0, f"{what}: reference is all zeros (a test that cannot fail)"
    err = (got - ref).abs().max().item()
    bound = atol + rtol * ref.abs().max().item()
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"
