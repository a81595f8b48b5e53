"""select_kernels: map every op to a kernel of kernels/ for the target, with its launch configuration.

Invariant established: every op that moves data carries ``launch`` = {kernel, grid, num_warps,
and the kernel's constexpr tiles in UPPER case}; views carry none. On ``cpu`` the kernel is the op's torch reference (``torch.<op>``).
On GPU targets the kernel id names the family and the operand dtypes (``matvec_q4g128``,
``attn_step_bf16``); launch rules come from the family's file in kernels/. GPU targets take the
fused program: an op with no GPU kernel (an unfused elementwise op) is an error that names it.
After this pass, ``launch_plan`` materialises the launch list the artifact stores.
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import IRError, Program, is_q4, is_view, q4_group
from kestrel.kernels.attention import attn_step_launch
from kestrel.kernels.embedding import embedding_launch
from kestrel.kernels.gated_delta import gdn_delta_launch, gdn_norm_launch
from kestrel.kernels.matvec import matvec_launch
from kestrel.kernels.rmsnorm import rmsnorm_launch
from kestrel.kernels.sample import sample_launch, step_end_launch
from kestrel.kernels.targets import ALL_TARGETS, TARGETS


def _gpu_launch(op, t) -> dict:
    k = op.kind
    if k in ("matmul", "matmul_swiglu"):
        w = op.ins[1]
        n, kk = w.type.shape
        name = ("matvec_swiglu_" if k == "matmul_swiglu" else "matvec_") + w.type.dtype
        group = q4_group(w.type.dtype) if is_q4(w.type.dtype) else 0
        return {"kernel": name, **matvec_launch(n, kk, group, t)}
    if k == "embedding":
        return {"kernel": f"embedding_{op.ins[0].type.dtype}", **embedding_launch(op.outs[0].type.shape[0], t)}
    if k in ("rmsnorm", "add_rmsnorm"):
        return {"kernel": k, **rmsnorm_launch(op.ins[0].type.shape, t)}
    if k == "gdn_delta":
        hv, dk, dv = op.ins[7].type.shape
        hk = (op.ins[0].type.shape[0] - hv * dv) // (2 * dk)
        return {"kernel": "gdn_delta", **gdn_delta_launch(hk, hv, dk, dv, op.ins[4].type.shape[1], t)}
    if k == "gdn_norm":
        dv = op.ins[3].type.shape[0]
        c, kc1 = op.ins[4].type.shape
        return {"kernel": "gdn_norm", **gdn_norm_launch(op.ins[0].type.shape[0] // dv, dv, c, kc1 + 1, t)}
    if k == "attn_step":
        kc = op.ins[5]
        s, nkv, d = kc.type.shape
        splits = op.ins[8].type.shape[1]
        return {"kernel": f"attn_step_{kc.type.dtype}",
                **attn_step_launch(op.outs[0].type.shape[0] // d, nkv, d, s, splits, t)}
    if k == "sample":
        return {"kernel": "sample", **sample_launch(op.ins[0].type.shape[0], t)}
    if k == "step_end":
        return {"kernel": "step_end", **step_end_launch(op.ins[3].type.shape[0], t)}
    raise IRError(f"op {k!r} has no GPU kernel for {t.name}: the fuse pass folds it into a fused kernel "
                  f"(gdn_delta + gdn_norm, attn_step, add_rmsnorm, matmul_swiglu)")


def select_kernels(program: Program, target: str) -> Program:
    if target not in ALL_TARGETS:
        raise IRError(f"unknown target {target!r}; known: {', '.join(ALL_TARGETS)}")
    p = copy.deepcopy(program)
    p.target = target
    for op in p.ops:
        if is_view(op):
            op.launch = None
        elif target == "cpu":
            op.launch = {"kernel": f"torch.{op.kind}"}
        else:
            launch = _gpu_launch(op, TARGETS[target])
            op.launch = {k: v for k, v in launch.items() if k != "constexprs"} | launch.get("constexprs", {})
    return p
