"""fold_row_norms: at M rows, the residual add and the next norm folded into the q4 tensor-core products.

Invariant established: no ``add_rmsnorm`` at M rows is left between a q4 ``matmul`` that the target's
tensor-core q4 kernel runs (kernels/q4_mma.py's rule: the speculative verify's K + 1 rows, prefill chunks
up to its max_rows) and consumers (``matmul`` / ``matmul_swiglu``, q4) that it runs too: each such chain
is ``matmul_add`` (s = r + W x, and each row's partial sums of s^2 per 16 outputs, written by the warp that
stores them) then ``rmsnorm_matmul`` / ``rmsnorm_matmul_swiglu`` (each row's rstd from those partials, the
input normed while the kernel stages it in shared memory), as fuse's rule 7 folds them at one row. The
chain's own launch (128 of them at 27B, ~6 us each in the verify) goes away; the products read the same
bytes. Elsewhere (bf16 and fp32 matrices, the Triton few-rows and GEMM kernels, targets without the
kernel, the CPU path, ``KESTREL_RULES="q4_mma.fold_norms=False"``) nothing changes: the norm stays its own
launch.

After quantize (it needs the matrices' precision) and with the build's target; select_kernels then gives
the folded ops the kernel's ``q4mma_add`` / ``q4mma_norm(_swiglu)`` launches and sizes the partials.
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import IRError, Op, Program, is_q4, q4_group
from kestrel.kernels import q4_mma
from kestrel.kernels.targets import TARGETS
from kestrel.passes.fuse import fold_norms_into_matmuls


def _accept(target):
    """The fold's condition on ``target``: the producer and every consumer (still ``matmul`` /
    ``matmul_swiglu``: x, then the weights) run the tensor-core q4 kernel, the consumers with the norm."""
    def runs_mma(op: Op, norm: bool) -> bool:
        x, w, *more = op.ins
        if not is_q4(w.type.dtype) or any(v.type.dtype != w.type.dtype for v in more):
            return False
        (m, k), (n, _) = x.type.shape, w.type.shape
        return q4_mma.rule_launch(m, n, k, q4_group(w.type.dtype), target, pair=bool(more), norm=norm) is not None

    def accept(producer: Op, consumers: list[Op]) -> bool:
        return producer.kind == "matmul" and runs_mma(producer, False) and all(runs_mma(u, True) for u in consumers)
    return accept


def fold_row_norms(program: Program, target: str) -> Program:
    p = copy.deepcopy(program)
    if target in TARGETS and TARGETS[target].rules["q4_mma"].fold_norms:
        fold_norms_into_matmuls(p, rows=True, accept=_accept(TARGETS[target]))
    return p


def check(program: Program, target: str) -> None:
    """Nothing left to fold: the rewrite, run again on the result, finds no chain."""
    p = copy.deepcopy(program)
    if (target in TARGETS and TARGETS[target].rules["q4_mma"].fold_norms
            and (n := fold_norms_into_matmuls(p, rows=True, accept=_accept(TARGETS[target])))):
        raise IRError(f"fold_row_norms: {n} add_rmsnorm chains at M rows left after the pass")
