"""The pass pipeline: every pass as a registered object ``Pass(name, run, check)``, in one list.

``PASSES`` is the single list that drives the build (compiler/build.py), ``--dump-ir-after``, the
ONNX export (the passes up to ``quantize``) and the golden tests. After every pass the pipeline runs
the op verifier (compiler/ops.py) and that pass's own ``check``, which proves the invariant its
docstring states; a violation is an IRError naming the pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kestrel.compiler.ir import Program
from kestrel.compiler.ops import verify
from kestrel.passes import fold_row_norms, fuse, hoist_dynamic, plan_memory, quantize, select_kernels


@dataclass(frozen=True)
class PassOptions:
    """What the passes are told by the build: the target, the weight precision, and for a plan's
    second program (the M-row step) the planned program it shares the arena with."""

    target: str = "cpu"
    quant: str = "none"
    q4_group: int = quantize.DEFAULT_Q4_GROUP
    shares_arena_with: Program | None = None
    draft_quant: str | None = None  # the MTP head's matrices (speculative programs), if not ``quant``


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Program, PassOptions], Program]
    check: Callable[[Program, PassOptions], None]


PASSES = (
    Pass("fuse", lambda p, o: fuse.fuse(p), lambda p, o: fuse.check(p)),
    Pass("quantize", lambda p, o: quantize.quantize(p, o.quant, o.q4_group, o.draft_quant),
         lambda p, o: quantize.check(p, o.quant, o.q4_group, o.draft_quant)),
    Pass("fold_row_norms", lambda p, o: fold_row_norms.fold_row_norms(p, o.target),
         lambda p, o: fold_row_norms.check(p, o.target)),
    Pass("hoist_dynamic", lambda p, o: hoist_dynamic.hoist_dynamic(p), lambda p, o: hoist_dynamic.check(p)),
    Pass("select_kernels", lambda p, o: select_kernels.select_kernels(p, o.target),
         lambda p, o: select_kernels.check(p)),
    Pass("plan_memory", lambda p, o: plan_memory.plan_memory(p, o.shares_arena_with), lambda p, o: plan_memory.check(p)),
)
PASS_NAMES = tuple(p.name for p in PASSES)


def pass_named(name: str) -> Pass:
    return PASSES[PASS_NAMES.index(name)]


def run_pass(ps: Pass, program: Program, options: PassOptions) -> Program:
    """One pass, then the verifier and the pass's check."""
    program = ps.run(program, options)
    verify(program)
    ps.check(program, options)
    return program


def run_passes(program: Program, options: PassOptions, until: str | None = None, on_pass=None) -> Program:
    """The passes in order, each verified and checked; ``on_pass(name, program)`` sees the program
    after each; ``until`` stops after that pass."""
    for ps in PASSES:
        program = run_pass(ps, program, options)
        if on_pass is not None:
            on_pass(ps.name, program)
        if ps.name == until:
            break
    return program
