"""select_kernels: map every op to a kernel of kernels/ for the target, with its launch configuration.

Invariant established: every op that moves data carries ``launch`` = {kernel, grid, num_warps,
and the kernel's constexpr tiles in UPPER case}; views carry none. On ``cpu`` the kernel is the op's
torch reference (``torch.<op>``). On GPU targets the kernel and its launch rule are the op's record
in compiler/ops.py (the rule's constants per target: kernels/targets.py); the kernel id names the
family and the operand dtypes (``matvec_q4g128``, ``attn_step_bf16``). GPU targets take the fused
program: an op with no GPU kernel (an unfused elementwise op) is an error that names it.

A matmul whose result is MoE routing logits (moe_topk reads it) keeps fp32 activations at every M: at M
rows it runs the matvec's few-rows form (each row computed as the one-token matvec computes it), never the
tensor-core GEMM, whose bf16 activations can flip the choice between near-tied experts (a discrete choice:
the M-row prefill then routes otherwise than the one-token step would).

Target-dependent shapes are decided here too: the attention scratch states (made by fuse with one
split) get the target's number of sequence splits (attn_step's, and each M-row program's attn_rows_q's
partials and tickets), the sampling partials (made by the lowering with
one row) a row per program of the target's sampling kernel, the speculative sampler's partials (spec_filter's)
(K + 1) blocks of G + 1 such rows, and Qwen3-Next's grouped experts' chunk table the chunk size their
kernels take (16 pairs for the tensor-core q4 kernel, kernels/q4_mma.py; else 4). plan_memory runs after
this pass.
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import IRError, Program
from kestrel.compiler.ops import OPS, NotApplicable, attn_heads, is_view, moe_grouped_rows, routing_logits
from kestrel.kernels import matvec
from kestrel.kernels.attention import attn_rows_launch, attn_rows_scratch, attn_splits
from kestrel.kernels.moe import grouped_chunks
from kestrel.kernels.sample import sample_scratch_shape
from kestrel.kernels.speculative import spec_scratch_shape
from kestrel.kernels.targets import ALL_TARGETS, TARGETS


def _size_attention_scratch(p: Program, target) -> None:
    """Each attn_step's partials state (operand 8; one state shared by every layer) gets the target's
    split count; each attn_rows_q's partials and tickets (operands 6, 7; shared by the program's layers) the
    size its launch needs."""
    for op in p.ops:
        if op.kind == "attn_step":
            nh, nkv, d = attn_heads(op)
            part = op.ins[8]
            part.type = type(part.type)("f32", (nh, attn_splits(nkv, op.ins[5].type.shape[0], target), d + 2))
        elif op.kind == "attn_rows_q":
            (rows, width), (s, nkv, d) = op.ins[0].type.shape, op.ins[2].type.shape
            _, launch = attn_rows_launch(rows, width, op.attrs["heads"], nkv, d, s, op.ins[2].type.dtype, target)
            shapes = attn_rows_scratch(launch, d)
            for st, dtype, shape in zip(op.ins[6:8], ("f32", "i32"), shapes):
                st.type = type(st.type)(dtype, shape)


def _size_sample_scratch(p: Program, target) -> None:
    """The sample op's partials state (operand 7) gets a row per program of the target's kernel."""
    for op in p.ops:
        if op.kind == "sample":
            part = op.ins[7]
            part.type = type(part.type)("f32", sample_scratch_shape(op.ins[0].type.shape[0], target))


def _size_spec_scratch(p: Program, target) -> None:
    """The speculative sampler's partials (spec_filter's operand 5; made by the lowering with one row): (K + 1)
    blocks of G + 1 rows of the target's sampler (spec_scratch_shape; K + 1 = its tickets), the same in the
    speculative prefill and the iteration (they share the state)."""
    for op in p.ops:
        if op.kind == "spec_filter":
            part, tickets = op.ins[5], op.ins[6]
            part.type = type(part.type)("f32", spec_scratch_shape(tickets.type.shape[0], op.ins[0].type.shape[-1],
                                                                  target))


def _size_moe_chunks(p: Program, target) -> None:
    """Each moe_group's chunk (its attribute, and the chunk table's rows) as the grouped experts' kernels on
    the target take them (ops.moe_grouped_rows: 16 pairs for the tensor-core q4 kernel, else 4)."""
    for op in p.ops:
        if op.kind != "moe_group":
            continue
        table = op.outs[2]
        gate_up = next(c for c in p.ops if c.kind == "moe_gate_up_grouped" and c.ins[2] is table)
        down = next(c for c in p.ops if c.kind == "moe_down_grouped" and c.ins[1] is table)
        e = op.attrs["experts"]
        rows = moe_grouped_rows(e, gate_up.ins[3], down.ins[2], target)
        for o in (op, gate_up, down):
            o.attrs["chunk"] = rows
        table.type = type(table.type)("i32", (grouped_chunks(op.outs[0].type.shape[0], e, rows), 4))


def _size_norm_partials(p: Program, target) -> None:
    """Each matmul_add's (moe_down_add's) partials (result 1, read by the rmsnorm matmuls after it) get one
    entry per program of its kernel: partial_rows = the launch's rows per program."""
    for op in p.ops:
        if op.kind in ("matmul_add", "moe_down_add"):
            rows = OPS[op.kind].kernel.launch(op, target)["constexprs"]["BLOCK_N"]
            *m, n = op.outs[0].type.shape  # (at M rows, fold_row_norms: the partials of each row)
            op.attrs["partial_rows"] = rows
            op.outs[1].type = type(op.outs[1].type)("f32", (*m, (n + rows - 1) // rows))


def _router_at_rows(op, routing: set[int]) -> bool:
    """The router's matmul (its result in ``routing_logits``) at M rows."""
    return op.kind == "matmul" and len(op.ins[0].type.shape) == 2 and id(op.outs[0]) in routing


def _routing_launch(op, target) -> dict:
    """The router's matmul at M rows: the few-rows matvec (fp32 activations), whatever M. (quantize keeps the
    router bf16 / f32: never q4.)"""
    (m, k), (n, _) = op.ins[0].type.shape, op.ins[1].type.shape
    return {"kernel": "matvec_rows_" + op.ins[1].type.dtype, **matvec.matvec_rows_launch(m, n, k, 0, target)}


def select_kernels(program: Program, target: str) -> Program:
    if target not in ALL_TARGETS:
        raise IRError(f"unknown target {target!r}; known: {', '.join(ALL_TARGETS)}")
    p = copy.deepcopy(program)
    p.target = target
    if target != "cpu":
        _size_attention_scratch(p, TARGETS[target])
        _size_sample_scratch(p, TARGETS[target])
        _size_spec_scratch(p, TARGETS[target])
        _size_norm_partials(p, TARGETS[target])
        _size_moe_chunks(p, TARGETS[target])
    routing = routing_logits(p)
    for op in p.ops:
        if is_view(op):
            op.launch = None
        elif target == "cpu":
            op.launch = {"kernel": f"torch.{op.kind}"}
        else:
            kernel = OPS[op.kind].kernel
            if isinstance(kernel, NotApplicable):
                raise IRError(f"op {op.kind!r} has no GPU kernel for {target}: {kernel.why}")
            if _router_at_rows(op, routing):
                launch = _routing_launch(op, TARGETS[target])
            else:
                launch = kernel.launch(op, TARGETS[target])
            op.launch = {k: v for k, v in launch.items() if k != "constexprs"} | launch.get("constexprs", {})
    return p


def check(program: Program) -> None:
    """Every op that moves data has a launch (a kernel id; on GPU targets a 3-d grid and a warp count);
    views have none."""
    if program.target not in ALL_TARGETS:
        raise IRError(f"select_kernels: the program's target is {program.target!r}")
    routing = routing_logits(program)
    for i, op in enumerate(program.ops):
        where = f"select_kernels: op #{i} ({op.kind})"
        if is_view(op):
            if op.launch is not None:
                raise IRError(f"{where} is a view but carries a launch")
            continue
        launch = op.launch or {}
        if not launch.get("kernel"):
            raise IRError(f"{where} moves data but has no kernel")
        if program.target != "cpu":
            grid, warps = launch.get("grid"), launch.get("num_warps")
            if not (isinstance(grid, list) and len(grid) == 3 and all(isinstance(g, int) and g > 0 for g in grid)):
                raise IRError(f"{where}: launch grid {grid!r} is not three positive integers")
            if not (isinstance(warps, int) and warps > 0):
                raise IRError(f"{where}: num_warps {warps!r} is not a positive integer")
            if _router_at_rows(op, routing) and not launch["kernel"].startswith("matvec_rows_"):
                raise IRError(f"{where}: the router's logits at M rows must come from the few-rows matvec (fp32 "
                              f"activations), not {launch['kernel']}")
