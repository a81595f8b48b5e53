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


def skip_redundant_lang_patches():
    """Triton 3.7.1's interpreter re-patches triton.language on every call of a jit helper inside a kernel
    (``InterpretedFunction.__call__`` calls ``_patch_lang`` and drops its scope): an ``inspect.getmembers``
    walk of tl, tl.tensor and tl.math per call, ~40% of an interpreted plan's time. Within a launch, once the
    modules a helper sees (its globals' tl / tl.core) are patched, that walk finds every builtin already
    replaced and re-sets the rest to equivalent functions that the launch's own restore then undoes: it
    changes nothing, so it is skipped. A helper that sees a module the launch has not patched yet (or none:
    the interpreter's assertion) still goes through the original. Returns a function that puts the original
    back; does nothing for another Triton version (the calling pattern is that version's)."""
    import inspect

    import triton
    import triton.language as tl
    import triton.runtime.interpreter as interp

    if triton.__version__ != "3.7.1" or not hasattr(interp, "_patch_lang"):
        return lambda: None
    original = interp._patch_lang
    active = []  # per launch in progress (GridExecutor keeps the first scope and restores it): modules patched

    class LaunchScope:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            active.pop()
            self.scope.restore()

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if active and langs and langs <= active[-1]:
            return None  # (a helper's call inside a launch: the interpreter ignores what it returns)
        scope = original(fn)
        if active:
            active[-1] |= langs
            return scope
        active.append(set(langs))
        return LaunchScope(scope)

    interp._patch_lang = patch_lang

    def restore():
        interp._patch_lang = original
    return restore


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


# A compile job: [key, "module:function", param types, constexprs, num_warps, cc, aligned (list or None)];
# the result per key: the cubin's facts the tests check, or the error's text.
COMPILE_SCRIPT = r"""
import json, sys
from kestrel.compiler.codegen import compile_kernel
res = {}
for key, fn, types, consts, num_warps, cc, aligned in json.loads(sys.stdin.read()):
    try:
        k = compile_kernel(key.split("/")[0], fn, types, consts, num_warps, cc, aligned)
        res[key] = {"size": len(k.cubin), "magic": k.cubin[:4].hex(), "name": k.name, "num_warps": k.num_warps,
                    "arch": k.arch, "shared": k.shared}
    except Exception as e:  # reported per job by the test
        res[key] = repr(e)[-2000:]
print(json.dumps(res))
"""


class SplitCompile:
    """``script`` (a JSON job list on stdin; one JSON object of results by key on its last line) run over
    ``jobs`` split between a few clean processes (no TRITON_INTERPRET), started at once: AOT compiles are
    single-threaded, so on a 2-core machine two processes halve the wait. ``result()`` waits and merges:
    (return codes, results by key, stderr of the processes that failed)."""

    def __init__(self, script: str, jobs: list, procs: int | None = None):
        import tempfile

        n = procs or max(1, min(4, len(os.sched_getaffinity(0))))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.procs = []
        for i in range(n):
            chunk = jobs[i::n]  # interleaved: each process gets every kind of kernel and every target
            if not chunk:
                continue
            job, out, err = (tempfile.TemporaryFile("w+") for _ in range(3))
            job.write(json.dumps(chunk))
            job.seek(0)
            self.procs.append((subprocess.Popen([sys.executable, "-c", script], stdin=job, stdout=out, stderr=err,
                                                env=env), out, err))

    def result(self, timeout: int = 900):
        rcs, res, errs = [], {}, []
        for p, out, err in self.procs:
            rcs.append(p.wait(timeout=timeout))
            out.seek(0)
            err.seek(0)
            text = out.read()
            if rcs[-1] == 0:
                res.update(json.loads(text.strip().splitlines()[-1]))
            else:
                errs.append(err.read()[-3000:])
        return rcs, res, errs

    def compiled(self, timeout: int = 900) -> dict:
        """result()'s results by key, once every process has exited 0 (else the failures' stderr)."""
        rcs, res, errs = self.result(timeout)
        assert all(rc == 0 for rc in rcs), errs
        return res

    def kill(self):
        for p, _, _ in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def split_compile_fixture(script: str, jobs_fn, test_prefix: str):
    """A module-scoped autouse fixture that starts ``SplitCompile(script, jobs_fn())`` when the module
    starts — if a test whose name starts with ``test_prefix`` is selected — so the compiles run beside
    the module's interpreter tests; it yields the SplitCompile (or None)."""
    import pytest

    @pytest.fixture(scope="module", autouse=True)
    def split_compile(request):
        selected = any(item.module is request.module and item.name.startswith(test_prefix)
                       for item in request.session.items)
        sc = SplitCompile(script, jobs_fn()) if selected else None
        yield sc
        if sc is not None:
            sc.kill()
    return split_compile
