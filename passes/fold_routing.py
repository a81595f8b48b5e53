"""fold_routing: at one row, the router's top-k folded into the normed gate / up kernel of its experts.

Invariant established: where the target's rule ``moe.route_in_gate_up`` holds, no one-row ``moe_topk`` is
left whose routing buffer (ids, weights) the layer's normed gate / up (``rmsnorm_moe_gate_up``, fuse's rule 7)
reads and only expert kernels after it read otherwise: each such pair is one ``rmsnorm_moe_topk_gate_up``,
whose routed programs take their experts from the router's logits themselves (kernels/moe.py ``_route_row``,
the same code as moe_topk's, run once in each program that needs it) and whose last program writes the
routing buffer that ``moe_down(_add)`` reads. The step loses the top-k's launch and its link in the chain
between the router's matmul and the experts (3.2 us a layer in the 80B-A3B q4 graph, bench/results/stop38
call 4). Elsewhere nothing changes: M rows (a routing buffer per row, then grouped or few-rows kernels), a
gate / up left unfolded (a speculative plan's one-row step, fold_row_norms), the CPU path, and
``KESTREL_RULES="moe.route_in_gate_up=False"``.

After fold_row_norms (which settles which one-row MoE chains stay folded) and before hoist_dynamic (whose
routing check then sees the new producer of the routing buffer).
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import IRError, Op, Program
from kestrel.kernels.targets import TARGETS


def _folds(target: str) -> bool:
    return target in TARGETS and TARGETS[target].rules["moe"].route_in_gate_up


def fold_topk(p: Program) -> int:
    """Each one-row moe_topk whose ids the next rmsnorm_moe_gate_up reads (operand 3), all its other readers
    after that one -> rmsnorm_moe_topk_gate_up (act, ids, weights) in the gate / up's place. Returns the
    number folded."""
    index = {id(op): i for i, op in enumerate(p.ops)}
    users: dict[int, list[Op]] = {}
    for op in p.ops:
        for v in op.ins:
            users.setdefault(id(v), []).append(op)
    n = 0
    for topk in list(p.ops):
        if topk.kind != "moe_topk" or len(topk.ins[0].type.shape) != 1:
            continue
        ids, wts = topk.outs
        gates = [u for u in users.get(id(ids), []) if u.kind == "rmsnorm_moe_gate_up" and u.ins[3] is ids]
        if len(gates) != 1:
            continue
        (gate,) = gates
        later = [u for v in (ids, wts) for u in users.get(id(v), []) if u is not gate]
        if any(index[id(u)] <= index[id(gate)] for u in later):
            continue
        s, ss, nw, _, *weights = gate.ins
        fused = Op("rmsnorm_moe_topk_gate_up", [gate.outs[0], ids, wts], [s, ss, nw, topk.ins[0], *weights],
                   {**gate.attrs, **topk.attrs})
        p.ops[p.ops.index(gate)] = fused
        p.ops.remove(topk)
        n += 1
    return n


def fold_routing(program: Program, target: str) -> Program:
    p = copy.deepcopy(program)
    if _folds(target):
        fold_topk(p)
    return p


def check(program: Program, target: str) -> None:
    """Nothing left to fold: the rewrite, run again on the result, finds no pair."""
    p = copy.deepcopy(program)
    if _folds(target) and (n := fold_topk(p)):
        raise IRError(f"fold_routing: {n} one-row moe_topk left before the normed gate / up that reads its experts")
