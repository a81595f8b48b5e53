"""fold_row_norms: at M rows, the residual add and the next norm folded into the tensor-core few-rows products.

Invariant established: no ``add_rmsnorm`` at M rows is left between a ``matmul`` that the target's
tensor-core few-rows kernel runs (kernels/q4_mma.py for q4 matrices, kernels/bf16_mma.py for bf16: the
speculative verify's K + 1 rows, prefill chunks up to the family rule's max_rows) and consumers (``matmul`` /
``matmul_swiglu`` of the same precision) that it runs too: each such chain is ``matmul_add`` (s = r + W x, and
each row's partial sums of s^2 per 16 outputs, written by the warp that stores them) then ``rmsnorm_matmul`` /
``rmsnorm_matmul_swiglu`` (each row's rstd from those partials, the input normed while the kernel stages it
in shared memory), as fuse's rule 7 folds them at one row. The chain's own launch (128 of them at 27B, ~6 us
each in the verify) goes away; the products read the same bytes. Elsewhere (fp32 matrices, the Triton
few-rows and GEMM kernels, targets without the kernel, the CPU path, ``KESTREL_RULES="q4_mma.fold_norms=False"``
or ``bf16_mma.fold_norms=False``) nothing changes: the norm stays its own launch.

After quantize (it needs the matrices' precision) and with the build's target; select_kernels then gives
the folded ops the kernel's ``q4mma_add`` / ``q4mma_norm(_swiglu)`` (``bf16mma_...``) launches and sizes the
partials.
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import IRError, Op, Program, is_q4
from kestrel.compiler.ops import mma_launch
from kestrel.kernels.targets import TARGETS
from kestrel.passes.fuse import fold_norms_into_matmuls


def _family(dtype: str) -> str | None:
    return "q4_mma" if is_q4(dtype) else "bf16_mma" if dtype == "bf16" else None


def _folds(target: str) -> bool:
    return target in TARGETS and any(TARGETS[target].rules[f].fold_norms for f in ("q4_mma", "bf16_mma"))


def _accept(target):
    """The fold's condition on ``target``: the producer and every consumer (still ``matmul`` /
    ``matmul_swiglu``: x, then the weights) run the tensor-core kernel of one family whose rule folds, the
    consumers with the norm."""
    def runs_mma(op: Op, norm: bool, family: str) -> bool:
        x, w, *more = op.ins
        if _family(w.type.dtype) != family or any(v.type.dtype != w.type.dtype for v in more):
            return False
        return mma_launch(x.type.shape, w.type.dtype, w.type.shape, target, pair=bool(more), norm=norm) is not None

    def accept(producer: Op, consumers: list[Op]) -> bool:
        family = _family(producer.ins[1].type.dtype)
        return (producer.kind == "matmul" and family is not None and target.rules[family].fold_norms
                and runs_mma(producer, False, family) and all(runs_mma(u, True, family) for u in consumers))
    return accept


def fold_row_norms(program: Program, target: str) -> Program:
    p = copy.deepcopy(program)
    if _folds(target):
        fold_norms_into_matmuls(p, rows=True, accept=_accept(TARGETS[target]))
    return p


def check(program: Program, target: str) -> None:
    """Nothing left to fold: the rewrite, run again on the result, finds no chain."""
    p = copy.deepcopy(program)
    if _folds(target) and (n := fold_norms_into_matmuls(p, rows=True, accept=_accept(TARGETS[target]))):
        raise IRError(f"fold_row_norms: {n} add_rmsnorm chains at M rows left after the pass")
