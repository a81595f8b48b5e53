"""Qwen3-Next's sparse mixture-of-experts MLP, routed on the device inside the static step.

Semantics (transformers' Qwen3NextSparseMoeBlock, Qwen3NextTopKRouter, Qwen3NextExperts; checked
against transformers 5.24's modeling_qwen3_next.py), for one row x [H] after the layer's
post-attention norm:

    logits = Wr @ x                                  router ``mlp.gate`` [E, H]
    p      = softmax(logits) in fp32
    ids, w = the k largest p (k = num_experts_per_tok), largest first
    w      = w / sum(w)                              when norm_topk_prob
    y      = sum_j w_j * down_{ids_j}(silu(gate_{ids_j} x) * up_{ids_j} x)
             + sigmoid(Ws . x) * shared_down(silu(shared_gate x) * shared_up x)

**The routing buffer.** ``moe_router`` (on the GPU: fuse splits it into the router's ``matmul``, the
logits on the matvec kernel's many programs, and ``moe_topk``, one program per row: a router that
read its [E, H] weight in one program took 147 us a layer at E = 512, H = 2048 on the H200) writes ids
(i32 [k]) and weights (f32 [k]) of its layer into
two arena buffers (at M rows [M, k]); the expert kernels read the expert ids from there and index
the layer's *stacked* expert weights: every expert's gate (and up) projection is one [E * I, H]
matrix, every down projection one [E * H, I] matrix (expert e's rows at e * I / e * H; for q4 the
scales of all rows follow all the nibbles, so a row index of the stacked matrix finds both). No
expert id is ever a kernel argument: the launch list is the same for every token whichever experts
run (hoist_dynamic's ``check_routing`` proves it on every build).

**Ties.** Among equal probabilities the lower expert index ranks first (a stable descending sort;
``moe_topk_kernel`` implements the same rule on distinct 64-bit keys, the probability's bits above the complement
of the index: the k largest keys, by one bitonic top-k or by k maxima, are the k first in that order). torch.topk on the CPU does *not* follow a fixed rule for ties (its order depends on the
vector length and k: ``tests/test_kernels_moe.py`` shows a case), so the transformers oracle can choose
another of several exactly tied experts; with real-valued logits exact ties of fp32 probabilities do
not occur in practice, and where none occurs the sets and their order are torch.topk's.

**The sum.** The routing weights are renormalised by their sum taken in rank order; the routed
experts' contributions are summed in rank order, then the gated shared expert is added: a fixed
order, no atomics (the GPU kernel sums per output row in the same order; with q4 experts gathered into
one tile, the MoeRule's ``down_gather``, as a tree over the ranks: another fixed order, the same at one
row and at a verify's K + 1).

The step runs the block as four launches: the router's matmul and ``moe_topk``; ``moe_gate_up`` (one grouped matvec over
the k selected experts and the shared expert: silu(gate) * up for each, plus the shared gate's
logit; result ``act`` = [k * I | Is | 1]); ``moe_down`` (each output row: the k routed down
projections weighted, plus sigmoid(gate logit) times the shared down projection). The unfused op
``moe_experts`` (what the lowering emits) is the composition of the last two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.matvec import (_INTERPRET, _Q4_WORD_DOT, FEW_ROWS, NORM_NONE, NORM_PARTIALS, _matvec_few_rows,
                                    _matvec_rows, _matvec_tile, _partials_rstd, _q4_words_interpreted, matvec_launch,
                                    matvec_ref)
from kestrel.kernels.pdl import pdl_wait
from kestrel.kernels.rmsnorm import rmsnorm_ref
from kestrel.kernels.targets import pow2_at_least


def weight_rows(w: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows lo..hi of a weight as the references take it (a q4 weight keeps its codes and scales, so
    ``matvec_ref`` computes the q4 product exactly as the GPU does)."""
    part = w[lo:hi]  # a new view object: its own attributes
    q4 = getattr(w, "q4", None)
    if q4 is not None:
        q, scales, group = q4
        part.q4 = (q[lo:hi], scales[lo:hi], group)
    return part


def route_ref(probs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k largest of probs [E] (of each row of [.., E]), largest first, the lower index first among
    equal values."""
    vals, idx = torch.sort(probs, descending=True, stable=True)
    return idx[..., :top_k], vals[..., :top_k]


def moe_router_ref(x: torch.Tensor, w: torch.Tensor, top_k: int, norm_topk: int):
    """(ids i32 [k], weights f32 [k]) of x [H] (rows of x [M, H]: [M, k] each, row by row): the
    logits W x as the matvec computes them, then ``moe_topk_ref``."""
    return moe_topk_ref(matvec_ref(x, w), top_k, norm_topk)


def moe_topk_ref(logits: torch.Tensor, top_k: int, norm_topk: int):
    """(ids i32 [k], weights f32 [k]) of the router's logits [E] (rows [M, E]: [M, k]): softmax in fp32,
    the top_k largest (``route_ref``), renormalised by their sum in rank order when norm_topk."""
    if logits.dim() == 2:
        rows = [moe_topk_ref(r, top_k, norm_topk) for r in logits]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    probs = torch.softmax(logits.float(), dim=-1)
    idx, vals = route_ref(probs, top_k)
    if norm_topk:
        total = vals[0].clone()
        for j in range(1, top_k):  # in rank order (the kernel's order)
            total = total + vals[j]
        vals = vals / total
    return idx.to(torch.int32), vals.float()


def moe_shapes(x, wg, wd, sd) -> tuple[int, int, int, int]:
    """(E, H, I, Is) from the operands: x [.., H], stacked gate [E * I, H], stacked down [E * H, I],
    shared down [H, Is]."""
    h = x.shape[-1]
    e, i = wd.shape[0] // h, wd.shape[1]
    return e, h, i, sd.shape[1]


def moe_gate_up_ref(x, ids, wg, wu, sg, su, sgate, experts: int) -> torch.Tensor:
    """act = [silu(Wg_e x) * (Wu_e x) for e in ids] | silu(Sg x) * (Su x) | Ws . x, as one f32 vector
    of k * I + Is + 1 (rows of x: one such row each); I = rows of the stacked Wg / ``experts``."""
    if x.dim() == 2:
        return torch.stack([moe_gate_up_ref(r, i, wg, wu, sg, su, sgate, experts) for r, i in zip(x, ids)])
    inter = wg.shape[0] // experts
    parts = []
    for e in ids.tolist():
        g = matvec_ref(x, weight_rows(wg, e * inter, (e + 1) * inter))
        u = matvec_ref(x, weight_rows(wu, e * inter, (e + 1) * inter))
        parts.append(torch.nn.functional.silu(g) * u)
    parts.append(torch.nn.functional.silu(matvec_ref(x, sg)) * matvec_ref(x, su))
    parts.append(matvec_ref(x, sgate))
    return torch.cat(parts).float()


def moe_down_ref(act, ids, weights, wd, sd) -> torch.Tensor:
    """y = sum_j weights_j * (Wd_{ids_j} @ act_j) in rank order, + sigmoid(act[-1]) * (Sd @ act_shared)."""
    if act.dim() == 2:
        return torch.stack([moe_down_ref(a, i, w, wd, sd) for a, i, w in zip(act, ids, weights)])
    h, inter, s = sd.shape[0], wd.shape[1], sd.shape[1]
    k = ids.shape[0]
    y = torch.zeros(h, dtype=torch.float32)
    for j, e in enumerate(ids.tolist()):
        y = y + weights[j] * matvec_ref(act[j * inter:(j + 1) * inter], weight_rows(wd, e * h, (e + 1) * h))
    shared = matvec_ref(act[k * inter:k * inter + s], sd)
    return y + torch.sigmoid(act[k * inter + s]) * shared


def moe_down_add_ref(act, ids, weights, wd, sd, r, partial_rows: int):
    """(s, ss) of the MoE block's output and the residual r, as ``matvec_add_ref`` makes them for a matmul:
    s = r + moe_down_ref(...), ss[i] = the sum of s^2 over rows [i * partial_rows, (i + 1) * partial_rows)
    (the next rmsnorm's partial sums)."""
    s = r + moe_down_ref(act, ids, weights, wd, sd)
    ss = torch.stack([(s[i:i + partial_rows].float() ** 2).sum() for i in range(0, s.shape[0], partial_rows)])
    return s, ss


def rmsnorm_moe_gate_up_ref(s, ss, nw, ids, wg, wu, sg, su, sgate, experts: int, eps: float) -> torch.Tensor:
    """moe_gate_up_ref of rmsnorm(s) (kernels/rmsnorm.py's zero-centred norm); ss (the producer's partial sums
    of s^2) is how the GPU gets the mean square, the reference takes it from s as the unfused norm does."""
    return moe_gate_up_ref(rmsnorm_ref(s, nw, eps), ids, wg, wu, sg, su, sgate, experts)


def moe_experts_ref(x, ids, weights, wg, wu, wd, sg, su, sd, sgate) -> torch.Tensor:
    """The MoE block after its router: moe_down_ref(moe_gate_up_ref(...)) (fuse splits it so)."""
    act = moe_gate_up_ref(x, ids, wg, wu, sg, su, sgate, wd.shape[0] // x.shape[-1])
    return moe_down_ref(act, ids, weights, wd, sd)


# --- M rows, grouped by expert ----------------------------------------------------------------------------
#
# At M rows (the M-row step prefilling a prompt) every row routed on its own reads its k experts for itself:
# at 256 rows and k = 10 of E = 512 that is 2,560 expert reads a layer where each expert serves ~5 rows. The
# grouped form (fuse emits it from GROUPED_MIN_ROWS rows) sorts the M k (row, slot) pairs by expert once
# (``moe_group``: stable, so within an expert the pairs keep their (row, slot) order) and cuts each expert's
# run into chunks of at most ``chunk`` (FEW_ROWS) pairs; ``moe_gate_up_grouped`` / ``moe_down_grouped`` run
# one program per (chunk, block of weight rows), reading the weight tile once for the chunk's rows (the
# matvec's few-rows form, kernels/matvec.py, x rows gathered); ``moe_combine`` sums each row's k results in
# rank order and adds the gated shared expert (itself two ordinary M-row matmuls). Each (row, expert)
# product is the per-row path's, so the result is the ungrouped one's (moe_experts_ref) op for op.
#
# The chunk table [C, 4] (expert, first pair, pairs, 0): C = grouped_chunks(P, E, chunk) bounds the chunk
# count of any routing (P = M k pairs), rows past the used ones hold 0 pairs (their programs return).


GROUPED_CHUNK = FEW_ROWS  # pairs a chunk at most: the few-rows matvec's rows a program


def grouped_chunks(pairs: int, experts: int, chunk: int) -> int:
    """The most chunks any routing of ``pairs`` pairs over ``experts`` experts makes: sum over the experts
    used of ceil(n_e / chunk) <= (P + min(E, P) (chunk - 1)) / chunk."""
    return -(-(pairs + min(experts, pairs) * (chunk - 1)) // chunk)


def moe_group_ref(ids: torch.Tensor, experts: int, chunk: int):
    """(src i32 [P], pos i32 [P], chunks i32 [C, 4]) of the routing ids [M, k]: the pairs p = row k + slot
    stably sorted by expert; src[i] the row of sorted pair i, pos[p] the sorted index of pair p; chunks
    (expert, start, count, 0), each expert's run cut every ``chunk`` pairs, in sorted order, then zeros."""
    m, k = ids.shape
    flat = ids.reshape(-1).long().clamp(0, experts - 1)
    order = torch.sort(flat, stable=True).indices
    src = (order // k).to(torch.int32)
    pos = torch.empty_like(src)
    pos[order] = torch.arange(m * k, dtype=torch.int32)
    chunks = torch.zeros(grouped_chunks(m * k, experts, chunk), 4, dtype=torch.int32)
    c, i = 0, 0
    se = flat[order]
    while i < m * k:
        e = int(se[i])
        n = 1
        while n < chunk and i + n < m * k and int(se[i + n]) == e:
            n += 1
        chunks[c] = torch.tensor([e, i, n, 0], dtype=torch.int32)
        c, i = c + 1, i + n
    return src, pos, chunks


def _chunk_pairs(chunks: torch.Tensor):
    """(expert, sorted pair index) of every pair the chunk table covers."""
    for e, start, n, _ in chunks.tolist():
        for i in range(start, start + n):
            yield e, i


def moe_gate_up_grouped_ref(x, src, chunks, wg, wu, experts: int, chunk: int = 0) -> torch.Tensor:
    """act_s [P, I]: sorted pair i's silu(Wg_e x[src[i]]) * (Wu_e x[src[i]]) (e its chunk's expert; ``chunk``,
    the pairs a chunk may hold, does not change the result)."""
    inter = wg.shape[0] // experts
    act = torch.zeros(src.shape[0], inter)
    for e, i in _chunk_pairs(chunks):
        xr = x[int(src[i])]
        g = matvec_ref(xr, weight_rows(wg, e * inter, (e + 1) * inter))
        u = matvec_ref(xr, weight_rows(wu, e * inter, (e + 1) * inter))
        act[i] = torch.nn.functional.silu(g) * u
    return act


def moe_down_grouped_ref(act, chunks, wd, experts: int, chunk: int = 0) -> torch.Tensor:
    """y_s [P, H]: sorted pair i's Wd_e act_s[i] (e its chunk's expert; H = rows of the stacked Wd / E)."""
    h = wd.shape[0] // experts
    y = torch.zeros(act.shape[0], h)
    for e, i in _chunk_pairs(chunks):
        y[i] = matvec_ref(act[i], weight_rows(wd, e * h, (e + 1) * h))
    return y


def moe_combine_ref(y_s, pos, weights, x, sgate, shared) -> torch.Tensor:
    """y [M, H]: row r's sum_j weights[r, j] y_s[pos[r k + j]] in rank order, + sigmoid(Ws . x[r]) shared[r]
    (moe_down_ref's order: the routed products from zero, then the gated shared expert)."""
    m, k = weights.shape
    out = []
    for r in range(m):
        y = torch.zeros(y_s.shape[1])
        for j in range(k):
            y = y + weights[r, j] * y_s[int(pos[r * k + j])]
        out.append(y + torch.sigmoid(matvec_ref(x[r], sgate)[0]) * shared[r])
    return torch.stack(out)


# --- launch rules (constants: kernels/targets.py, the "moe" and "matvec" rows) --------------------------


def moe_topk_launch(rows: int, e: int, top_k: int, target) -> dict:
    """One program per row, the E logits in registers (BLOCK_E = pow2(E)); SORT from the moe rule's topk_sort."""
    r = target.rules["moe"]
    return {"grid": [rows, 1, 1], "num_warps": r.router_warps,
            "constexprs": {"E": e, "TOPK": top_k, "BLOCK_E": pow2_at_least(e),
                           "BLOCK_T": pow2_at_least(max(2, top_k)), "SORT": r.topk_sort}}


def _tiles(n: int, k: int, group: int, target, cap: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of the matvec launch rule for an [n, k] matrix, BLOCK_N at most
    ``cap`` (a power of two)."""
    m = matvec_launch(n, k, group, target)
    c = m["constexprs"]
    return min(c["BLOCK_N"], cap), c["BLOCK_K"], m["num_warps"]


def moe_gate_up_launch(rows: int, e: int, h: int, inter: int, shared: int, top_k: int, groups: tuple, target,
                       partials: int = 0) -> dict:
    """Programs over (slot, row block): top_k slots of ceil(I / BLOCK_N) blocks, the shared expert's
    ceil(Is / BLOCK_N), one for the shared gate's logit; a grid row per input row. The moe rule's tiles:
    BLOCK_N rows (at most the smaller expert width), the whole input in one tile up to ``gate_up_max_k``
    (a multiple of every q4 group). ``partials`` (rmsnorm_moe_gate_up): the producer's partial sums of
    squares, P and BLOCK_P as the rmsnorm matvec's."""
    rule = target.rules["moe"]
    block_n = min(rule.gate_up_block_n, pow2_at_least(min(inter, shared)))
    block_k = max(max(groups), min(rule.gate_up_max_k, pow2_at_least(h)))
    nb_i, nb_s = -(-inter // block_n), -(-shared // block_n)
    consts = {"E": e, "H": h, "I": inter, "IS": shared, "TOPK": top_k, "GROUP_G": groups[0], "GROUP_S": groups[1],
              "GROUP_GATE": groups[2], "BLOCK_N": block_n, "BLOCK_K": block_k}
    if partials:
        consts |= {"P": partials, "BLOCK_P": pow2_at_least(partials)}
    return {"grid": [top_k * nb_i + nb_s + 1, rows, 1], "num_warps": max(1, min(rule.gate_up_warps,
                                                                                 block_n * block_k // 1024)),
            "constexprs": consts}


def moe_down_launch(rows: int, e: int, h: int, inter: int, shared: int, top_k: int, groups: tuple, target) -> dict:
    """Programs over blocks of the H output rows (a grid row per input row); each sums the k routed
    products in rank order (_moe_down_sum: unrolled, or pipelined when ``down_stages``; q4 experts gathered
    into one tile and summed as a tree when ``down_gather``), then the gated shared one. Tiles from the matvec
    rule for one expert's [H, I] down projection (the gathered form's from ``down_gather``). EARLY (the gathered
    form where the rule's ``down_early``): the routing and the routed rows loaded before the PDL wait."""
    rule = target.rules["moe"]
    block_n, block_kd, warps = _tiles(h, inter, groups[0], target, rule.max_block_n)
    stages = rule.down_stages
    if rule.down_gather and groups[0] > 0:  # q4: the gathered form (_moe_down_gathered), all of I in its tile
        block_n, warps = min(rule.down_gather[0], pow2_at_least(h)), rule.down_gather[1]
        block_kd, stages = pow2_at_least(inter), -1
    _, block_ks, _ = _tiles(h, shared, groups[1], target, block_n)
    return {"grid": [-(-h // block_n), rows, 1], "num_warps": warps,
            "constexprs": {"E": e, "H": h, "I": inter, "IS": shared, "TOPK": top_k, "GROUP_D": groups[0],
                           "GROUP_S": groups[1], "BLOCK_N": block_n, "BLOCK_KD": block_kd, "BLOCK_KS": block_ks,
                           "BLOCK_T": pow2_at_least(max(2, top_k)), "STAGES": stages,
                           "EARLY": stages < 0 and rule.down_early}}


def moe_group_launch(pairs: int, e: int, top_k: int, chunk: int, target) -> dict:
    """One program per expert (its pairs' sorted places and chunks; all P ids read by each), the moe rule's
    group_warps. BLOCK_E: the histogram's bins (at least a warp's 32), BLOCK_J: an expert's chunks at most."""
    c = grouped_chunks(pairs, e, chunk)
    return {"grid": [e, 1, 1], "num_warps": target.rules["moe"].group_warps,
            "constexprs": {"P": pairs, "TOPK": top_k, "E": e, "C": c, "R": chunk, "BLOCK_P": pow2_at_least(pairs),
                           "BLOCK_C": pow2_at_least(c), "BLOCK_E": max(32, pow2_at_least(e)),
                           "BLOCK_J": pow2_at_least(-(-pairs // chunk))}}


def moe_grouped_launch(pairs: int, e: int, n: int, k: int, group: int, chunk: int, target, pair: bool = False) -> dict:
    """moe_gate_up_grouped's (``pair``: n = I, k = H) and moe_down_grouped's (n = H, k = I) launch: grid
    [C chunks, ceil(n / BLOCK_N)], the moe rule's grouped tiles (BLOCK_N rows of one expert's [n, k] matrix,
    BLOCK_K inputs a tile, a multiple of the q4 group) for ``chunk`` rows."""
    bn, bk, warps = target.rules["moe"].grouped_gate_up if pair else target.rules["moe"].grouped_down
    bn, bk = min(bn, pow2_at_least(n)), max(group, min(bk, pow2_at_least(k)))
    return {"grid": [grouped_chunks(pairs, e, chunk), -(-n // bn), 1], "num_warps": warps,
            "constexprs": {"P": pairs, "E": e, "N": n, "K": k, "GROUP": group, "BLOCK_N": bn, "BLOCK_K": bk, "R": chunk}}


def moe_combine_launch(m: int, h: int, top_k: int, target) -> dict:
    """Programs over (row, block of H columns)."""
    block = min(target.rules["moe"].combine_block, pow2_at_least(h))
    return {"grid": [m, -(-h // block), 1], "num_warps": 4,
            "constexprs": {"H": h, "TOPK": top_k, "BLOCK": block, "BLOCK_H": pow2_at_least(h)}}


# --- Triton kernels ------------------------------------------------------------------------------------


@triton.jit
def moe_topk_kernel(logits_ptr, ids_ptr, wts_ptr, top_k, norm_topk, E: tl.constexpr, TOPK: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, SORT: tl.constexpr = False, PDL: tl.constexpr = False):
    """Row program_id(0) of the router's logits [M, E] (the matvec's): softmax in fp32, the TOPK largest
    probabilities, renormalised by their sum in rank order when norm_topk; ids [M, TOPK] (i32) and weights
    [M, TOPK] (f32) of the row written. Each rank is one max over a 64-bit key per expert: the
    probability's bits (a non-negative float orders as its bit pattern) above BLOCK_E - 1 - index, so the
    largest key is the largest probability and, among equal ones, the lower index (the tie rule). SORT: the
    BLOCK_T largest keys at once by Triton's bitonic top-k (``tl.topk``: compare-and-swap stages, most of them
    inside a thread's registers) instead of TOPK serial max rounds; the keys are distinct, so both forms give the
    same ids in the same order, and the sum runs in rank order either way (bit-identical results)."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    es = tl.arange(0, BLOCK_E)
    emask = es < E
    logits = tl.load(logits_ptr + row * E + es, mask=emask, other=float("-inf"))
    ex = tl.exp(logits - tl.max(logits, axis=0))
    p = ex / tl.sum(ex, axis=0)
    key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - es).to(tl.int64)
    key = tl.where(emask, key, -1)
    ts = tl.arange(0, BLOCK_T)
    if SORT:
        top = tl.topk(key, BLOCK_T)  # the BLOCK_T largest keys, largest first
        ids = BLOCK_E - 1 - (top & 0xFFFFFFFF).to(tl.int32)
        vals = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        total = tl.sum(tl.where(ts == 0, vals, 0.0), axis=0)
        for j in tl.static_range(1, TOPK):  # in rank order (x + 0 is exact: each sum picks one value)
            total = total + tl.sum(tl.where(ts == j, vals, 0.0), axis=0)
    else:
        ids = tl.zeros([BLOCK_T], tl.int32)
        vals = tl.zeros([BLOCK_T], tl.float32)
        total = 0.0
        for j in tl.static_range(TOPK):
            top = tl.max(key, axis=0)
            idx = BLOCK_E - 1 - (top & 0xFFFFFFFF).to(tl.int32)
            m = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            ids = tl.where(ts == j, idx, ids)
            vals = tl.where(ts == j, m, vals)
            if j == 0:
                total = m
            else:
                total = total + m
            key = tl.where(es == idx, -1, key)
    if norm_topk != 0:
        vals = vals / total
    tl.store(ids_ptr + row * TOPK + ts, ids, mask=ts < TOPK)
    tl.store(wts_ptr + row * TOPK + ts, vals, mask=ts < TOPK)


@triton.jit
def _moe_gate_up(x_ptr, ids_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, sgate_ptr, act_ptr, nw_ptr, rstd, eps,
                 E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, IS: tl.constexpr, TOPK: tl.constexpr,
                 GROUP_G: tl.constexpr, GROUP_S: tl.constexpr, GROUP_GATE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    """moe_gate_up_kernel's program (NORM: its input x normed per tile, kernels/matvec.py's _matvec_tile)."""
    pid = tl.program_id(0)
    row = tl.program_id(1)
    NB_I: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
    NB_S: tl.constexpr = (IS + BLOCK_N - 1) // BLOCK_N
    ACT: tl.constexpr = TOPK * I + IS + 1
    x = x_ptr + row * H
    out = act_ptr + row * ACT
    ns = tl.arange(0, BLOCK_N)
    if pid < TOPK * NB_I:
        j = pid // NB_I
        r = (pid % NB_I) * BLOCK_N + ns
        e = tl.load(ids_ptr + row * TOPK + j)
        e = tl.minimum(tl.maximum(e, 0), E - 1)
        rows = e * I + tl.minimum(r, I - 1)
        g = _matvec_rows(x, wg_ptr, rows, E * I, H, GROUP_G, BLOCK_N, BLOCK_K, nw_ptr, rstd, eps, NORM)
        u = _matvec_rows(x, wu_ptr, rows, E * I, H, GROUP_G, BLOCK_N, BLOCK_K, nw_ptr, rstd, eps, NORM)
        tl.store(out + j * I + r, g / (1.0 + tl.exp(-g)) * u, mask=r < I)
    elif pid < TOPK * NB_I + NB_S:
        r = (pid - TOPK * NB_I) * BLOCK_N + ns
        rows = tl.minimum(r, IS - 1)
        g = _matvec_rows(x, sg_ptr, rows, IS, H, GROUP_S, BLOCK_N, BLOCK_K, nw_ptr, rstd, eps, NORM)
        u = _matvec_rows(x, su_ptr, rows, IS, H, GROUP_S, BLOCK_N, BLOCK_K, nw_ptr, rstd, eps, NORM)
        tl.store(out + TOPK * I + r, g / (1.0 + tl.exp(-g)) * u, mask=r < IS)
    else:
        y = _matvec_rows(x, sgate_ptr, ns * 0, 1, H, GROUP_GATE, BLOCK_N, BLOCK_K, nw_ptr, rstd, eps, NORM)
        tl.store(out + TOPK * I + IS + ns, y, mask=ns < 1)


@triton.jit
def moe_gate_up_kernel(x_ptr, ids_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, sgate_ptr, act_ptr, experts,
                       E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, IS: tl.constexpr, TOPK: tl.constexpr,
                       GROUP_G: tl.constexpr, GROUP_S: tl.constexpr, GROUP_GATE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """act[row] = [silu(Wg_e x) * (Wu_e x) for e in ids[row]] | silu(Sg x) * (Su x) | Ws . x (x = x[row],
    row = program_id(1)). Program p < TOPK * NB_I: slot p // NB_I, rows block p % NB_I of the expert read
    from the routing buffer (clamped into 0..E-1: no read outside the stacked weights whatever the buffer
    holds) at rows e * I .. of the stacked [E * I, H] matrices; then the shared expert's blocks; the last
    program the shared gate's logit. The matvec inner loop is kernels/matvec.py's (bf16 / f32 / q4)."""
    pdl_wait(PDL)
    _moe_gate_up(x_ptr, ids_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, sgate_ptr, act_ptr, None, 1.0, 0.0, E, H, I, IS, TOPK,
                 GROUP_G, GROUP_S, GROUP_GATE, BLOCK_N, BLOCK_K, NORM_NONE)


@triton.jit
def rmsnorm_moe_gate_up_kernel(x_ptr, ss_ptr, nw_ptr, ids_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, sgate_ptr, act_ptr,
                               experts, eps, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, IS: tl.constexpr,
                               TOPK: tl.constexpr, GROUP_G: tl.constexpr, GROUP_S: tl.constexpr,
                               GROUP_GATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               P: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    """moe_gate_up_kernel of rmsnorm(x) (one row: the layer's post-attention norm, fused): the mean square
    from the producer's P partial sums of x^2 (matvec_add_kernel's), summed in index order by every
    program, and x * rstd * (1 + nw) made per tile (kernels/matvec.py's NORM_PARTIALS).

    The normed input made before the PDL wait and a routed program's gate / up words and scales loaded at once
    after its id (stop 43: two memory round trips after the wait instead of six) was even at 80B-A3B q4 (1.7283 /
    1.7256 against 1.7255 / 1.7259 ms/token, H200, stop 45): removed, in the tree at commit 2e5c32b."""
    pdl_wait(PDL)
    rstd = _partials_rstd(ss_ptr, eps, H, P, BLOCK_P)
    _moe_gate_up(x_ptr, ids_ptr, wg_ptr, wu_ptr, sg_ptr, su_ptr, sgate_ptr, act_ptr, nw_ptr, rstd, eps, E, H, I, IS,
                 TOPK, GROUP_G, GROUP_S, GROUP_GATE, BLOCK_N, BLOCK_K, NORM_PARTIALS)


@triton.jit
def _moe_routing(ids_ptr, wts_ptr, E: tl.constexpr, TOPK: tl.constexpr, BLOCK_T: tl.constexpr):
    """(live, ids, wts) of one row's routing buffer: the ranks j < TOPK, the expert ids clamped into 0..E-1 (no read
    outside the stacked weights whatever the buffer holds) and their weights."""
    ts = tl.arange(0, BLOCK_T)
    live = ts < TOPK
    ids = tl.load(ids_ptr + ts, mask=live, other=0)
    ids = tl.minimum(tl.maximum(ids, 0), E - 1)
    wts = tl.load(wts_ptr + ts, mask=live, other=0.0)
    return live, ids, wts


@triton.jit
def _moe_down_sum(act, ids_ptr, wts_ptr, wd_ptr, sd_ptr, rc, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                  IS: tl.constexpr, TOPK: tl.constexpr, GROUP_D: tl.constexpr, GROUP_S: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_KD: tl.constexpr, BLOCK_KS: tl.constexpr, BLOCK_T: tl.constexpr,
                  STAGES: tl.constexpr, early=None):
    """sum_j wts_j * (Wd_{ids_j} act_j)[rc] in rank order, + sigmoid(gate logit) * (Sd act_shared)[rc], for
    one row (ids_ptr / wts_ptr / act at that row), the ids and weights loaded once before the experts'
    products. STAGES = 0: the k experts unrolled, one matvec each (kernels/matvec.py's, its own K loop);
    STAGES > 0: one software-pipelined loop over (expert, K tile), each tile's products summed and weighted
    at once (on the H200 at the 80B-A3B shape the unrolled form was the faster: bench/results/stop23);
    STAGES < 0 (q4, BLOCK_KD >= I): ``_moe_down_gathered``, the k products summed as a tree over the ranks, on
    ``early`` = (live, ids, wts, words, scales) where the caller loaded them (before its PDL wait), else loaded
    here."""
    if GROUP_D > 0:
        CHUNK: tl.constexpr = 32
        SCALE: tl.constexpr = 64.0  # Q4_X_SCALE (kernels/matvec.py)
    else:
        BITS: tl.constexpr = wd_ptr.dtype.element_ty.primitive_bitwidth
        CHUNK: tl.constexpr = 128 // BITS if BLOCK_KD >= 128 // BITS else BLOCK_KD
        SCALE: tl.constexpr = 1.0
    KT: tl.constexpr = (I + BLOCK_KD - 1) // BLOCK_KD
    acc = tl.zeros([BLOCK_N], tl.float32)
    if STAGES < 0:  # q4, every expert's rows in one gathered tile
        if early is None:
            live, ids, wts = _moe_routing(ids_ptr, wts_ptr, E, TOPK, BLOCK_T)
            words, scale = _moe_down_gathered_loads(ids, live, wd_ptr, rc, E, H, I, GROUP_D, BLOCK_N, BLOCK_KD,
                                                    BLOCK_T)
        else:
            live, ids, wts, words, scale = early
        acc = _moe_down_gathered(act, wts, live, words, scale, I, BLOCK_N, BLOCK_KD, BLOCK_T)
    else:
        ts = tl.arange(0, BLOCK_T)
        live, ids, wts = _moe_routing(ids_ptr, wts_ptr, E, TOPK, BLOCK_T)
        if STAGES == 0:  # the experts unrolled, each one matvec (the compiler may issue their loads together)
            for j in tl.static_range(TOPK):
                e = tl.sum(tl.where(ts == j, ids, 0), axis=0)
                w = tl.sum(tl.where(ts == j, wts, 0.0), axis=0)
                acc = acc + w * _matvec_rows(act + j * I, wd_ptr, e * H + rc, E * H, I, GROUP_D, BLOCK_N, BLOCK_KD)
        else:  # one software-pipelined loop over (expert, K tile), STAGES tiles in flight
            for t in tl.range(0, TOPK * KT, num_stages=STAGES):
                j = t // KT
                e = tl.sum(tl.where(ts == j, ids, 0), axis=0)
                w = tl.sum(tl.where(ts == j, wts, 0.0), axis=0)
                part, _ = _matvec_tile(act + j * I, wd_ptr, e * H + rc, (t % KT) * BLOCK_KD, None, 1.0, 0.0, E * H,
                                       I, GROUP_D, BLOCK_N, BLOCK_KD, CHUNK, I % BLOCK_KD != 0, NORM_NONE)
                acc = acc + w * (tl.sum(part, axis=1) * SCALE)
    s = _matvec_rows(act + TOPK * I, sd_ptr, rc, H, IS, GROUP_S, BLOCK_N, BLOCK_KS)
    gate = tl.load(act + TOPK * I + IS)
    return acc + s / (1.0 + tl.exp(-gate))


@triton.jit
def _moe_down_gathered_loads(ids, live, wd_ptr, rc, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                             GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
                             BLOCK_T: tl.constexpr):
    """The weights ``_moe_down_gathered`` multiplies: every routed expert's rows [BLOCK_N, I] of a q4 stacked Wd
    [E * H, I] as one gathered tile [BLOCK_T, BLOCK_N, I / 8] of words, and their f16 scales [BLOCK_T, BLOCK_N,
    I / 32] (one per 32-input chunk, as f32), so the loads of all k experts are issued together."""
    tl.static_assert(GROUP > 0 and BLOCK_I >= I and I % GROUP == 0)
    W: tl.constexpr = BLOCK_I // 8
    jw = tl.arange(0, W)
    rows = (ids[:, None] * H + rc[None, :]).to(tl.int64)  # [T, N] rows of the stacked matrix
    words = tl.load(wd_ptr.to(tl.pointer_type(tl.int32)) + rows[:, :, None] * (I // 8) + jw[None, None, :],
                    mask=live[:, None, None] & (jw < I // 8)[None, None, :], other=0)
    c = tl.arange(0, W // 4)
    sp = (wd_ptr + E * H * I // 2).to(tl.pointer_type(tl.float16)) + rows[:, :, None] * (I // GROUP)
    scale = tl.load(sp + (c * 32 // GROUP)[None, None, :], mask=live[:, None, None] & (c < I // 32)[None, None, :],
                    other=0.0)
    return words, scale.to(tl.float32)


@triton.jit
def _moe_down_gathered(act, wts, live, words, scale, I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    """sum_j wts_j * (Wd_{ids_j} act_j)[rc] over the ranks j < TOPK (``live``), on the words and scales of
    ``_moe_down_gathered_loads``: each row's product as ``_matvec_tile`` makes it (``_Q4_WORD_DOT`` per word,
    32-input chunks scaled, then x 64), the ranks' weighted products summed as a tree (a fixed order: the same at
    one row and at a verify's K + 1)."""
    W: tl.constexpr = BLOCK_I // 8
    ts = tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_I)
    xq = tl.load(act + ts[:, None] * I + ks[None, :], mask=live[:, None] & (ks < I)[None, :], other=0.0)
    xq = xq * (1.0 / 64.0)  # Q4_X_SCALE
    shape: tl.constexpr = [BLOCK_T, BLOCK_N, W]
    if _INTERPRET:
        xh = tl.reshape(tl.broadcast_to(xq.to(tl.float16)[:, None, :], [BLOCK_T, BLOCK_N, BLOCK_I]),
                        [BLOCK_T * BLOCK_N, BLOCK_I])
        d = tl.reshape(_q4_words_interpreted(tl.reshape(words, [BLOCK_T * BLOCK_N, W]), xh, BLOCK_T * BLOCK_N,
                                             BLOCK_I), shape)
    else:  # kernels/matvec.py's _x_pairs for each rank's x
        xl, xh = tl.split(tl.reshape(xq, [BLOCK_T, W, 4, 2]))
        xp = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [xl, xh], dtype=tl.int32,
                                       is_pure=True, pack=1)
        xa, xb = tl.split(tl.reshape(xp, [BLOCK_T, W, 2, 2]))  # pairs (0, 2), (1, 3)
        x0, x2 = tl.split(xa)
        x1, x3 = tl.split(xb)
        d = tl.inline_asm_elementwise(_Q4_WORD_DOT, "=f,r,r,r,r,r",
                                      [words, tl.broadcast_to(x0[:, None, :], shape),
                                       tl.broadcast_to(x1[:, None, :], shape), tl.broadcast_to(x2[:, None, :], shape),
                                       tl.broadcast_to(x3[:, None, :], shape)], dtype=tl.float32, is_pure=True, pack=1)
    part = tl.sum(tl.reshape(d, [BLOCK_T, BLOCK_N, W // 4, 4]), axis=3)  # one sum per 32-input chunk
    y = tl.sum(part * scale, axis=2) * 64.0  # Q4_X_SCALE
    return tl.sum(y * wts[:, None], axis=0)


@triton.jit
def moe_down_kernel(act_ptr, ids_ptr, wts_ptr, wd_ptr, sd_ptr, y_ptr, E: tl.constexpr, H: tl.constexpr,
                    I: tl.constexpr, IS: tl.constexpr, TOPK: tl.constexpr, GROUP_D: tl.constexpr,
                    GROUP_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KD: tl.constexpr, BLOCK_KS: tl.constexpr,
                    BLOCK_T: tl.constexpr, STAGES: tl.constexpr, EARLY: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """y[row, r] = sum_j wts_j * (Wd_{ids_j} act_j)[r] in rank order j = 0..TOPK-1, then
    + sigmoid(gate logit) * (Sd act_shared)[r]: BLOCK_N output rows per program (row = program_id(1)),
    stacked Wd [E * H, I] read at rows e * H + r; no atomics, a fixed order (_moe_down_sum). EARLY: the
    routing and the routed experts' rows loaded before the PDL wait (``_down_early``)."""
    row = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.minimum(r, H - 1)
    early = _down_early(ids_ptr + row * TOPK, wts_ptr + row * TOPK, wd_ptr, rc, E, H, I, TOPK, GROUP_D, BLOCK_N,
                        BLOCK_KD, BLOCK_T, STAGES, EARLY)
    pdl_wait(PDL)
    acc = _moe_down_sum(act_ptr + row * (TOPK * I + IS + 1), ids_ptr + row * TOPK, wts_ptr + row * TOPK, wd_ptr,
                        sd_ptr, rc, E, H, I, IS, TOPK, GROUP_D, GROUP_S, BLOCK_N, BLOCK_KD, BLOCK_KS, BLOCK_T, STAGES,
                        early)
    tl.store(y_ptr + row * H + r, acc, mask=r < H)


@triton.jit
def _down_early(ids_ptr, wts_ptr, wd_ptr, rc, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr,
                GROUP_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KD: tl.constexpr, BLOCK_T: tl.constexpr,
                STAGES: tl.constexpr, EARLY: tl.constexpr):
    """With EARLY (the gathered q4 form only), what a moe_down program may read before its PDL wait: the routing
    buffer and the routed experts' down rows (``_moe_down_gathered_loads``), else None. The routing is written by
    moe_topk two launches back: the step runs the router's top-k, then moe_gate_up, then moe_down (fuse's
    split), and a programmatic launch of moe_down starts only once every moe_gate_up program has passed its own
    wait, which returns once moe_topk has completed with its writes visible (kernels/pdl.py); without programmatic
    edges the launches run one after another. Weights are written by no kernel of the step."""
    if EARLY:
        tl.static_assert(STAGES < 0, "EARLY: the gathered q4 form only")
        live, ids, wts = _moe_routing(ids_ptr, wts_ptr, E, TOPK, BLOCK_T)
        words, scale = _moe_down_gathered_loads(ids, live, wd_ptr, rc, E, H, I, GROUP_D, BLOCK_N, BLOCK_KD, BLOCK_T)
        return live, ids, wts, words, scale
    else:
        return None


@triton.jit
def moe_down_add_kernel(act_ptr, ids_ptr, wts_ptr, wd_ptr, sd_ptr, r_ptr, s_ptr, ss_ptr, partial_rows,
                        E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, IS: tl.constexpr, TOPK: tl.constexpr,
                        GROUP_D: tl.constexpr, GROUP_S: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_KD: tl.constexpr, BLOCK_KS: tl.constexpr, BLOCK_T: tl.constexpr,
                        STAGES: tl.constexpr, EARLY: tl.constexpr = False, PDL: tl.constexpr = False):
    """s = r + moe_down (one row: the residual add after the MoE block, fused as matvec_add_kernel fuses it
    after a matmul) and ss[program] = the sum of s^2 over the program's BLOCK_N rows (``partial_rows``,
    the op's attribute; not read): the next rmsnorm's partial sums. EARLY as moe_down_kernel's."""
    r = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rc = tl.minimum(r, H - 1)
    early = _down_early(ids_ptr, wts_ptr, wd_ptr, rc, E, H, I, TOPK, GROUP_D, BLOCK_N, BLOCK_KD, BLOCK_T, STAGES,
                        EARLY)
    pdl_wait(PDL)
    y = _moe_down_sum(act_ptr, ids_ptr, wts_ptr, wd_ptr, sd_ptr, rc, E, H, I, IS, TOPK, GROUP_D, GROUP_S, BLOCK_N,
                      BLOCK_KD, BLOCK_KS, BLOCK_T, STAGES, early)
    live = r < H
    s = tl.load(r_ptr + r, mask=live, other=0.0) + y
    tl.store(s_ptr + r, s, mask=live)
    tl.store(ss_ptr + tl.program_id(0), tl.sum(tl.where(live, s * s, 0.0), axis=0))


# --- M rows, grouped by expert (the kernels; the references and the chunk table above) ------------------


@triton.jit
def moe_group_kernel(ids_ptr, src_ptr, pos_ptr, chunks_ptr, experts, chunk, P: tl.constexpr, TOPK: tl.constexpr,
                     E: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr = False):
    """``moe_group_ref``, one program per expert e (grid [E]), each reading all P routing ids: e's pairs go to
    sorted positions base + rank (base: the pairs of smaller experts; rank: the pair's place among e's, by pair
    index: the stable sort), so src / pos get e's entries; its chunks go to rows cbase + j (cbase: the chunks
    of smaller experts, sum of ceil(n / R) over the expert histogram), j-th chunk (e, base + j R,
    min(R, n - j R), 0); program e zeroes the unused table rows c = used .. C - 1 with c % E = e. No program
    reads what another writes; deterministic."""
    pdl_wait(PDL)
    e = tl.program_id(0)
    i = tl.arange(0, BLOCK_P)
    live = i < P
    ids = tl.load(ids_ptr + i, mask=live, other=0)
    ids = tl.minimum(tl.maximum(ids, 0), E - 1)  # no expert outside the stacked weights whatever the buffer holds
    eq = live & (ids == e)
    base = tl.sum((live & (ids < e)).to(tl.int32), axis=0)
    n = tl.sum(eq.to(tl.int32), axis=0)
    dst = base + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    tl.store(src_ptr + dst, i // TOPK, mask=eq)
    tl.store(pos_ptr + i, dst, mask=eq)
    per = (tl.histogram(ids, BLOCK_E, mask=live) + (R - 1)) // R  # chunks of each expert (bins >= E: none)
    cbase = tl.sum(tl.where(tl.arange(0, BLOCK_E) < e, per, 0), axis=0)
    used = tl.sum(per, axis=0)
    j = tl.arange(0, BLOCK_J)
    mine = j * R < n
    row = chunks_ptr + (cbase + j) * 4
    tl.store(row, j * 0 + e, mask=mine)
    tl.store(row + 1, base + j * R, mask=mine)
    tl.store(row + 2, tl.minimum(n - j * R, R), mask=mine)
    tl.store(row + 3, j * 0, mask=mine)
    c = tl.arange(0, BLOCK_C)
    rest = (c >= used) & (c < C) & (c % E == e)
    for f in tl.static_range(4):
        tl.store(chunks_ptr + c * 4 + f, c * 0, mask=rest)


@triton.jit
def _chunk(chunks_ptr, P: tl.constexpr, E: tl.constexpr):
    """(expert, first sorted pair, pairs) of program_id(0)'s chunk (clamped into range)."""
    c = chunks_ptr + tl.program_id(0) * 4
    e = tl.minimum(tl.maximum(tl.load(c), 0), E - 1)
    return e, tl.minimum(tl.maximum(tl.load(c + 1), 0), P - 1), tl.load(c + 2)


@triton.jit
def _store_pairs(y_ptr, y0, y1, y2, y3, cols, s, n, N: tl.constexpr):
    """Rows s .. s + n - 1 (n <= 4) of y [P, N] at columns ``cols``."""
    live = cols < N
    tl.store(y_ptr + s * N + cols, y0, mask=live)
    tl.store(y_ptr + (s + 1) * N + cols, y1, mask=live & (n > 1))
    tl.store(y_ptr + (s + 2) * N + cols, y2, mask=live & (n > 2))
    tl.store(y_ptr + (s + 3) * N + cols, y3, mask=live & (n > 3))


@triton.jit
def moe_gate_up_grouped_kernel(x_ptr, src_ptr, chunks_ptr, wg_ptr, wu_ptr, act_ptr, experts, chunk, P: tl.constexpr,
                               E: tl.constexpr, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr,
                               PDL: tl.constexpr = False):
    """act_s rows of chunk program_id(0): silu(Wg_e x) * (Wu_e x) for its pairs' rows x[src[i]] (the few-rows
    matvec: each tile of the expert's gate / up rows read once for the chunk), N = I, K = H; an unused chunk
    (0 pairs) does nothing."""
    pdl_wait(PDL)
    e, s, n = _chunk(chunks_ptr, P, E)
    if n > 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = e * N + tl.minimum(cols, N - 1)
        g0, g1, g2, g3 = _matvec_few_rows(x_ptr, wg_ptr, rows, s, P, E * N, K, GROUP, BLOCK_N, BLOCK_K, R, src_ptr)
        u0, u1, u2, u3 = _matvec_few_rows(x_ptr, wu_ptr, rows, s, P, E * N, K, GROUP, BLOCK_N, BLOCK_K, R, src_ptr)
        _store_pairs(act_ptr, g0 / (1.0 + tl.exp(-g0)) * u0, g1 / (1.0 + tl.exp(-g1)) * u1,
                     g2 / (1.0 + tl.exp(-g2)) * u2, g3 / (1.0 + tl.exp(-g3)) * u3, cols, s, n, N)


@triton.jit
def moe_down_grouped_kernel(act_ptr, chunks_ptr, wd_ptr, y_ptr, experts, chunk, P: tl.constexpr, E: tl.constexpr,
                            N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr = False):
    """y_s rows of chunk program_id(0): Wd_e act_s[i] for its pairs (rows s .. of act_s, contiguous), N = H,
    K = I."""
    pdl_wait(PDL)
    e, s, n = _chunk(chunks_ptr, P, E)
    if n > 0:
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = e * N + tl.minimum(cols, N - 1)
        y0, y1, y2, y3 = _matvec_few_rows(act_ptr, wd_ptr, rows, s, P, E * N, K, GROUP, BLOCK_N, BLOCK_K, R)
        _store_pairs(y_ptr, y0, y1, y2, y3, cols, s, n, N)


@triton.jit
def moe_combine_kernel(ys_ptr, pos_ptr, wts_ptr, x_ptr, sgate_ptr, sh_ptr, y_ptr, H: tl.constexpr,
                       TOPK: tl.constexpr, BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """y[row, cols] = sum_j wts[row, j] y_s[pos[row TOPK + j], cols] in rank order + sigmoid(Ws . x[row])
    sh[row, cols] (the shared gate's logit made by each program: one H-long dot)."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = cols < H
    hs = tl.arange(0, BLOCK_H)
    xv = tl.load(x_ptr + row * H + hs, mask=hs < H, other=0.0)
    gl = tl.sum(xv * tl.load(sgate_ptr + hs, mask=hs < H, other=0.0).to(tl.float32), axis=0)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOPK):
        p = tl.load(pos_ptr + row * TOPK + j)
        w = tl.load(wts_ptr + row * TOPK + j)
        acc = acc + w * tl.load(ys_ptr + p.to(tl.int64) * H + cols, mask=live, other=0.0)
    sh = tl.load(sh_ptr + row * H + cols, mask=live, other=0.0)
    tl.store(y_ptr + row * H + cols, acc + sh / (1.0 + tl.exp(-gl)), mask=live)
