"""merge_gdn_norm: the one-token Gated DeltaNet step in one launch, where the target's rule says so.

Invariant established: on a target whose ``gdn_delta`` rule has ``fuse_norm``, no ``gdn_norm`` is left that
normalises a ``gdn_delta``'s result: each such pair (what fuse's rule 2 emits) is one ``gdn_step``
(kernels/gated_delta.py ``gdn_step_kernel``: the delta rule on ``gdn_delta``'s work split, then the gated
RMSNorm of a value head and the conv-state shift of a key head's q and k channels done by the program that
finishes last), with the tickets it counts in the scratch state ``scratch.gdn_tickets`` (i32, one per value
head and key head of the widest layer: layers run one after another and each launch leaves them zero). One
launch a Gated DeltaNet layer goes away (18 at 0.8B, 48 at 27B); the bytes are the same.

Elsewhere (the CPU target, a target whose rule does not fuse, ``KESTREL_RULES="gdn_delta.fuse_norm=False"``)
nothing changes, and the M-row programs' ``gdn_rows_delta`` / ``gdn_rows_norm`` are not touched. After fuse
(it matches fuse's pair) and before select_kernels (which gives ``gdn_step`` its launch).
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import SCRATCH_PREFIX, IRError, Op, Program
from kestrel.compiler.ops import gdn_layer_heads
from kestrel.kernels.targets import TARGETS

GDN_TICKETS = SCRATCH_PREFIX + "gdn_tickets"


def _merges(target: str) -> bool:
    return target in TARGETS and target != "cpu" and getattr(TARGETS[target].rules["gdn_delta"], "fuse_norm", False)


def _pairs(p: Program) -> list[tuple[Op, Op]]:
    made = {id(op.outs[0]): op for op in p.ops if op.kind == "gdn_delta"}
    return [(made[id(op.ins[0])], op) for op in p.ops if op.kind == "gdn_norm" and id(op.ins[0]) in made]


def merge_pairs(p: Program) -> int:
    """Rewrite every gdn_delta + gdn_norm pair of ``p`` (in place) into one gdn_step; returns how many."""
    pairs = _pairs(p)
    if not pairs:
        return 0
    need = max(sum(gdn_layer_heads(d.ins[0], d.ins[7])[:2]) for d, _ in pairs)
    if GDN_TICKETS not in p.states:
        p.add_state(GDN_TICKETS, "i32", (need,))
    tickets = p.states[GDN_TICKETS]
    if tickets.type.shape[0] < need:
        raise IRError(f"merge_gdn_norm: {GDN_TICKETS} holds {tickets.type.shape[0]} tickets, the layers need {need}")
    for delta, norm in pairs:
        qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec = delta.ins
        _, z, _, norm_w, _ = norm.ins
        step = Op("gdn_step", norm.outs, [qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec, tickets],
                  {"eps": norm.attrs["eps"], **delta.attrs})
        p.ops[p.ops.index(norm)] = step  # where the result is used; every operand is defined before delta
        p.ops.remove(delta)
    return len(pairs)


def merge_gdn_norm(program: Program, target: str) -> Program:
    p = copy.deepcopy(program)
    if _merges(target):
        merge_pairs(p)
    return p


def check(program: Program, target: str) -> None:
    """Nothing left to merge on a target that merges."""
    if _merges(target) and (n := len(_pairs(program))):
        raise IRError(f"merge_gdn_norm: {n} gdn_delta + gdn_norm pairs left after the pass")
