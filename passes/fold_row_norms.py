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

And at one row, where the target's rule ``matvec_rows.fold_one_row`` is False (a speculative plan's
``exact_verify_rules``): no one-row chain is left folded that the verify's rows run unfolded. Fuse's rule 7 is
undone (``matmul`` / ``moe_down``, ``add_rmsnorm``, then ``matmul`` / ``matmul_swiglu`` / ``moe_gate_up`` of the
norm) wherever a floating-point matrix or a MoE block is in the chain, as a verify's few-rows matvec and MoE
kernels compute those rows, which have no folded form (the folded one-row kernels take the norm's mean square
from the producer's partial sums, or apply its factor after the product: other roundings). Only the q4 chains
the tensor-core kernel folds at the verify's rows stay folded.

After quantize (it needs the matrices' precision) and with the build's target; select_kernels then gives
the folded ops the kernel's ``q4mma_add`` / ``q4mma_norm(_swiglu)`` (``bf16mma_...``) launches and sizes the
partials.
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import IRError, Op, Program, TensorType, Value, Weight, is_q4
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


UNFOLD_PRODUCERS = {"matmul_add": "matmul", "moe_down_add": "moe_down"}
UNFOLD_CONSUMERS = {"rmsnorm_matmul": "matmul", "rmsnorm_matmul_swiglu": "matmul_swiglu",
                    "rmsnorm_moe_gate_up": "moe_gate_up"}


def _fp(op: Op) -> bool:
    """The op's matrices (its ins past the first) are floating point, not q4."""
    return all(not is_q4(w.type.dtype) for w in op.ins if isinstance(w, Weight))


def _rows_fold(producer: Op, consumers: list[Op]) -> bool:
    """A one-row chain whose form at the verify's rows is folded too: a q4 product and q4 ``rmsnorm_matmul(_swiglu)``
    consumers (the tensor-core few-rows kernel's pair). Any floating-point matrix, or a MoE block on either side
    (its rows kernels have no folded form), and the verify runs the chain unfolded."""
    return (producer.kind == "matmul_add" and not _fp(producer)
            and all(u.kind != "rmsnorm_moe_gate_up" and not _fp(u) for u in consumers))


def _users(p: Program) -> dict[int, list[Op]]:
    """The ops reading each value (by id), in program order."""
    users: dict[int, list[Op]] = {}
    for op in p.ops:
        for v in op.ins:
            users.setdefault(id(v), []).append(op)
    return users


def unfold_one_row_norms(p: Program) -> int:
    """Fuse's rule 7 undone at one row where the verify's rows run the chain unfolded (``_rows_fold``):
    ``matmul_add`` / ``moe_down_add`` (s, ss) -> ``matmul`` / ``moe_down`` then ``add_rmsnorm``, its
    ``rmsnorm_matmul(_swiglu)`` / ``rmsnorm_moe_gate_up`` consumers -> ``matmul(_swiglu)`` / ``moe_gate_up`` of the
    norm, as the few-rows matvec and the MoE kernels run a verify's rows (the folded one-row kernels apply the norm
    by tile from the producer's partial sums: another order of the sum of squares, so other bits). Returns the
    chains unfolded."""
    users = _users(p)
    n = 0
    for op in list(p.ops):
        if op.kind not in UNFOLD_PRODUCERS or len(op.ins[0].type.shape) != 1:
            continue
        s, ss = op.outs
        *mm_ins, r = op.ins
        consumers = users.get(id(ss), [])
        if not consumers or any(u.kind not in UNFOLD_CONSUMERS or u.ins[0] is not s or u.ins[1] is not ss
                                for u in consumers) or len({(id(u.ins[2]), u.attrs["eps"]) for u in consumers}) != 1:
            continue
        if _rows_fold(op, consumers):
            continue
        nw, eps = consumers[0].ins[2], consumers[0].attrs["eps"]
        y, normed = Value(TensorType("f32", s.type.shape)), Value(TensorType("f32", s.type.shape))
        i = p.ops.index(op)
        p.ops[i:i + 1] = [Op(UNFOLD_PRODUCERS[op.kind], [y], mm_ins, {}),
                          Op("add_rmsnorm", [s, normed], [r, y, nw], {"eps": eps})]
        for u in consumers:
            p.ops[p.ops.index(u)] = Op(UNFOLD_CONSUMERS[u.kind], u.outs, [normed, *u.ins[3:]],
                                       {k: v for k, v in u.attrs.items() if k != "eps"})
        n += 1
    return n


def _unfolds(target: str) -> bool:
    return target in TARGETS and not TARGETS[target].rules["matvec_rows"].fold_one_row


def fold_row_norms(program: Program, target: str) -> Program:
    p = copy.deepcopy(program)
    if _folds(target):
        fold_norms_into_matmuls(p, rows=True, accept=_accept(TARGETS[target]))
    if _unfolds(target):
        unfold_one_row_norms(p)
    return p


def check(program: Program, target: str) -> None:
    """Nothing left to fold: the rewrite, run again on the result, finds no chain."""
    p = copy.deepcopy(program)
    if _folds(target) and (n := fold_norms_into_matmuls(p, rows=True, accept=_accept(TARGETS[target]))):
        raise IRError(f"fold_row_norms: {n} add_rmsnorm chains at M rows left after the pass")
    if _unfolds(target) and (n := unfold_one_row_norms(p)):
        raise IRError(f"fold_row_norms: {n} folded norms at one row that the verify's rows run unfolded left after "
                      "the pass")
