"""Running Triton kernels in Triton's interpreter inside the test process, and checking them.

The test suite runs with TRITON_INTERPRET=1 (set by conftest.py before anything imports triton),
so every @triton.jit kernel is an interpreted function; ``interpret(kernel)[grid](*args, **consts)``
runs it on CPU torch tensors (pass dyn slots as 1-element torch.int32 / torch.float32 tensors).
AOT compilation (kestrel.kernels.aot.compile_kernel) notices the mode and compiles in a clean
subprocess, so both work in one session.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

TESTS = os.path.dirname(os.path.abspath(__file__))


def interpret(kernel):
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError("kernels are not interpreted: TRITON_INTERPRET=1 must be set before triton is "
                           "imported (tests/conftest.py does it)")
    return kernel


def assert_close(got: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float, what: str = ""):
    got, ref = got.float(), ref.float()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    assert torch.isfinite(ref).all(), f"{what}: reference has non-finite values (bad test inputs)"
    assert ref.abs().max() > 0, f"{what}: reference is all zeros (a test that cannot fail)"
    err = (got - ref).abs().max().item()
    bound = atol + rtol * ref.abs().max().item()
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def run_aot_main(module: str, timeout: int = 900):
    """``tests/<module>.py``'s ``_aot_main()`` (its AOT compiles) in a clean process, without
    TRITON_INTERPRET; returns the JSON of the last line it prints."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {TESTS!r}); "
                        f"import {module} as t; t._aot_main()"],
                       capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])
