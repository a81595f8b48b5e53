"""fuse_router: the one-token MoE router and its top-k in one launch, where the target's rule says so.

Invariant established: where the target's moe rule ``router_topk`` is on, no one-row ``moe_topk`` reads logits
that an ``rmsnorm_matmul`` with a floating-point router (fuse's rule 7 folded the post-attention norm into it)
made for it alone: each such pair is one ``rmsnorm_moe_router`` (kernels/moe.py ``rmsnorm_moe_router_kernel``: the
matvec's programs make the logits, then the program that draws the last ticket takes the top-k), at the router's
place, with the scratch ticket ``scratch.router_ticket`` that all of them share (the layers' routers run one after
another and each launch leaves it zeroed). The logits stay a value (the fused op's first result) and the routing
buffer the same two values, so the expert kernels and hoist_dynamic's routing check read what they read before;
the arithmetic is the pair's (the same matvec and top-k code), so the CPU path gives the same bits either way.
Elsewhere nothing changes: the CPU path, targets whose rule is off, M rows (a prefill's rows route on one program
a row), and a speculative plan's one-token step (fold_row_norms unfolded its MoE chains: its router is a plain
``matmul`` of the norm, as the verify's rows compute it).

After fold_row_norms (which decides which one-row chains stay folded) and before hoist_dynamic (whose routing check
then sees the fused router).
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import SCRATCH_PREFIX, IRError, Op, Program, TensorType, is_q4
from kestrel.kernels.targets import TARGETS

ROUTER_TICKET = SCRATCH_PREFIX + "router_ticket"


def _on(target: str) -> bool:
    return target in TARGETS and TARGETS[target].rules["moe"].router_topk


def fuse_router_pairs(p: Program) -> int:
    """Each one-row ``rmsnorm_matmul`` (a floating-point router) whose logits only a ``moe_topk`` reads ->
    ``rmsnorm_moe_router``; returns the pairs fused."""
    producer = {id(o): op for op in p.ops for o in op.outs}
    readers: dict[int, int] = {}
    for op in p.ops:
        for x in op.ins:
            readers[id(x)] = readers.get(id(x), 0) + 1
    outputs = {id(v) for v in p.outputs.values()}
    n = 0
    for op in list(p.ops):
        if op.kind != "moe_topk" or len(op.ins[0].type.shape) != 1:
            continue
        logits = op.ins[0]
        mm = producer.get(id(logits))
        if (mm is None or mm.kind != "rmsnorm_matmul" or is_q4(mm.ins[3].type.dtype) or readers[id(logits)] != 1
                or id(logits) in outputs):
            continue
        if ROUTER_TICKET not in p.states:
            p.add_state(ROUTER_TICKET, "i32", (1,))
        p.ops[p.ops.index(mm)] = Op("rmsnorm_moe_router", [logits, *op.outs], [*mm.ins, p.states[ROUTER_TICKET]],
                                    {**op.attrs, "eps": mm.attrs["eps"]})
        p.ops.remove(op)
        n += 1
    return n


def fuse_router(program: Program, target: str) -> Program:
    p = copy.deepcopy(program)
    if _on(target):
        fuse_router_pairs(p)
    return p


def check(program: Program, target: str) -> None:
    """Nothing left to fuse where the rule is on: the rewrite, run again on the result, finds no pair; and the
    ticket is the one i32 the kernel counts on."""
    p = copy.deepcopy(program)
    if _on(target) and (n := fuse_router_pairs(p)):
        raise IRError(f"fuse_router: {n} one-row router / moe_topk pairs left after the pass")
    ticket = program.states.get(ROUTER_TICKET)
    if ticket is not None and ticket.type != TensorType("i32", (1,)):
        raise IRError(f"fuse_router: {ROUTER_TICKET} must be i32[1], not {ticket.type}")
