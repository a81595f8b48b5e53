"""quantize: give every weight the precision ``--quant`` asks for its role.

Invariant established: every weight read as a matrix (``MATRIX_OPERANDS``: the matmul family; all
projections and lm_head) has the requested precision; the embedding table is f32 (none) or bf16;
small tensors (norms, A_log, dt_bias, conv taps) stay f32; the MoE router and the shared expert's gate
(``BF16_MATRIX_OPERANDS``) are bf16 under bf16 and q4; KV caches are bf16 unless --quant none.
Weights change only their declared dtype and source recipe: the bytes are made when the plan is
written, one weight at a time (compiler/weights.py), so a 27B checkpoint converts with bounded memory.

Modes:
  * ``none``: fp32 everything, for exact comparison with the reference;
  * ``bf16``: matrices and the embedding table in bf16 (the default for GPU targets);
  * ``q4``:   weight-only int4 with one f16 scale per group of ``group`` inputs (layout and rounding
    in kernels/matvec.py). Default group 128: for a memory-bound decode step the bytes are the
    cost, and 128 halves the scale traffic of 64 (4.125 vs 4.25 bits per weight) while top-1
    agreement with fp32 is the same within noise (tests/test_numerics.py reports both). When a matrix's input size is not a
    multiple of the group, the largest of 128 / 64 / 32 that divides it is used; if none does, the
    matrix stays bf16. With tied embeddings, lm_head gets its own q4 copy and the table stays bf16.

``draft``: the precision of the draft model's matrices (the MTP head's, ``DRAFT_PREFIX``, and the copy
of lm_head its drafts read: ``--draft-quant``), when it differs from ``mode``: only ``q4``, the head's MoE router
and shared expert gate bf16 as under ``q4`` (drafts are
proposals that the verify accepts or rejects by the model's own logits, so their precision changes how
many are accepted, never the output).
"""
from __future__ import annotations

import copy

from kestrel.compiler.ir import Q4_GROUPS, IRError, Program, Weight, is_q4
from kestrel.compiler.ops import routing_logits

QUANT_MODES = ("none", "bf16", "q4")
DEFAULT_Q4_GROUP = 128
MATRIX_OPERANDS = {"matmul": (1,), "matmul_swiglu": (1, 2), "matmul_add": (1,), "rmsnorm_matmul": (3,),
                   "rmsnorm_matmul_swiglu": (3, 4), "moe_experts": (3, 4, 5, 6, 7, 8), "moe_gate_up": (2, 3, 4, 5),
                   "moe_down": (3, 4), "rmsnorm_moe_gate_up": (4, 5, 6, 7), "moe_down_add": (3, 4),
                   "moe_gate_up_grouped": (3, 4), "moe_down_grouped": (2,)}
# matrices kept at bf16 under q4 (f32 under none): the MoE router, whose top-k choice 4-bit noise could flip
# (llama.cpp keeps ffn_gate_inp unquantised too), and the shared expert's one-row gate
BF16_MATRIX_OPERANDS = {"moe_router": (1,), "moe_experts": (9,), "moe_gate_up": (6,), "rmsnorm_moe_gate_up": (8,),
                        "moe_combine": (4,)}
TABLE_OPS = ("embedding", "embedding_rmsnorm", "embedding_rows")  # operand 0 is an embedding table
DRAFT_PREFIX = "mtp."  # the draft model's weights (compiler/qwen3_5.py's MTP head and its draft lm_head)
DRAFT_QUANT_MODES = ("q4",)


def _q4_group_for(k: int, group: int) -> int | None:
    for g in sorted({group, *Q4_GROUPS}, reverse=True):
        if g <= group and k % g == 0:
            return g
    return None


def _roles(p: Program) -> tuple[list[Weight], set[int]]:
    """The weights read as matrices (in first-use order) and the ids of the embedding tables."""
    matrices: list[Weight] = []
    for op in p.ops:
        for i in MATRIX_OPERANDS.get(op.kind, ()):
            if op.ins[i] not in matrices:
                matrices.append(op.ins[i])
    return matrices, {id(op.ins[0]) for op in p.ops if op.kind in TABLE_OPS}


def _draft(w: Weight, draft: str | None) -> bool:
    return draft is not None and w.name.startswith(DRAFT_PREFIX)


def _bf16_matrices(p: Program) -> set[int]:
    """BF16_MATRIX_OPERANDS', and the router after fuse split it: the matmul (rmsnorm_matmul, the norm
    folded in) whose logits moe_topk reads."""
    logits = routing_logits(p)
    weight = {"matmul": 1, "rmsnorm_matmul": 3}
    return {id(op.ins[i]) for op in p.ops for i in BF16_MATRIX_OPERANDS.get(op.kind, ())} | {
        id(op.ins[weight[op.kind]]) for op in p.ops if op.kind in weight and id(op.outs[0]) in logits}


def quantize(program: Program, mode: str = "none", group: int = DEFAULT_Q4_GROUP, draft: str | None = None) -> Program:
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quant mode {mode!r}")
    if draft is not None and draft not in DRAFT_QUANT_MODES:
        raise ValueError(f"unknown draft quant mode {draft!r}")
    if group not in Q4_GROUPS:
        raise ValueError(f"q4 group must be one of {Q4_GROUPS}")
    p = copy.deepcopy(program)
    matrices, tables = _roles(p)
    bf16_only = _bf16_matrices(p)
    for w in p.weights.values():  # the draft model's matrices as q4 gives them (its MoE router and shared gate:
        if not _draft(w, draft) or id(w) in tables:  # bf16; never a table: the MTP head has its own lm_head)
            continue
        if id(w) in bf16_only:
            w.type, w.source = type(w.type)("bf16", w.type.shape), ["cast", "bf16", w.source]
        elif w in matrices and (g := _q4_group_for(w.type.shape[1], group)) is not None:
            w.type, w.source = type(w.type)(f"q4g{g}", w.type.shape), ["q4", g, w.source]
    if mode == "none":
        return p
    matrices = [w for w in matrices if not is_q4(w.type.dtype)]
    for w in p.weights.values():
        if len(w.type.shape) == 2 and w.type.dtype == "f32" and (id(w) in tables or w in matrices or id(w) in bf16_only):
            w.type, w.source = type(w.type)("bf16", w.type.shape), ["cast", "bf16", w.source]
    for s in p.states.values():
        if s.name.endswith(("k_cache", "v_cache")):
            s.type = type(s.type)("bf16", s.type.shape)
    if mode == "q4":
        for w in matrices:
            if id(w) in bf16_only:
                continue
            g = _q4_group_for(w.type.shape[1], group)
            if g is None:
                continue
            src = w.source[2]  # under the bf16 cast: quantise from the checkpoint's values
            if id(w) in tables:  # tied: lm_head gets its own quantised copy
                copy_name = "lm_head" if "lm_head" not in p.weights else w.name + ".q4"
                q = p.add_weight(copy_name, f"q4g{g}", w.type.shape, ["q4", g, src])
                for op in p.ops:
                    if op.kind in MATRIX_OPERANDS:
                        op.ins = [q if (x is w and i in MATRIX_OPERANDS[op.kind]) else x for i, x in enumerate(op.ins)]
            else:
                w.type, w.source = type(w.type)(f"q4g{g}", w.type.shape), ["q4", g, src]
    return p


def check(program: Program, mode: str, group: int = DEFAULT_Q4_GROUP, draft: str | None = None) -> None:
    """Every weight and KV cache has the dtype its role gets in ``mode`` (the module docstring), the
    draft model's matrices the one ``draft`` gives them."""
    matrices, tables = _roles(program)
    matrix_ids = {id(w) for w in matrices}
    bf16_only = _bf16_matrices(program)

    def want(w: Weight) -> str:
        if _draft(w, draft) and id(w) in bf16_only:
            return "bf16"
        if _draft(w, draft) and id(w) in matrix_ids and id(w) not in tables:
            g = _q4_group_for(w.type.shape[1], group)
            if g:
                return f"q4g{g}"
        if mode != "none" and id(w) in bf16_only:
            return "bf16"
        if mode == "none" or (id(w) not in matrix_ids and id(w) not in tables):
            return "f32"
        if mode == "q4" and id(w) in matrix_ids and id(w) not in tables:
            g = _q4_group_for(w.type.shape[1], group)
            return f"q4g{g}" if g else "bf16"
        return "bf16"

    bad = [f"{w.name} is {w.type.dtype}, expected {want(w)}" for w in program.weights.values()
           if w.type.dtype != want(w)]
    kv = "f32" if mode == "none" else "bf16"
    bad += [f"{s.name} is {s.type.dtype}, expected {kv}" for s in program.states.values()
            if s.name.endswith(("k_cache", "v_cache")) and s.type.dtype != kv]
    if bad:
        raise IRError(f"quantize --quant {mode}: {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
