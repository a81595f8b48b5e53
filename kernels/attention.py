"""Gated attention decode over a KV cache of max_seq rows.

* ``rope_ref``: NeoX-style rotary embedding on the first ``rotary_dim`` dims of each head at ``pos``
  (partial RoPE), the rest passes through; cos/sin computed in fp32 as the reference model does;
* ``kv_append_ref``: write k, v into row ``pos`` of the caches;
* ``attention_ref``: softmax(q K[0..pos]^T * scale) V in fp32, query head h reading kv head h // (H / Hkv);
* ``attn_step_kernel``: the fused decode step ``attn_step_ref`` as one Triton kernel (launch: ``attn_step_launch``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.elementwise import sigmoid_gate_ref
from kestrel.kernels.rmsnorm import rmsnorm_ref
from kestrel.kernels.targets import TARGETS, pow2_at_least


def rope_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def rope_ref(x: torch.Tensor, pos: int, theta: float, rotary_dim: int) -> torch.Tensor:
    inv_freq = rope_inv_freq(theta, rotary_dim).to(x.device)
    freqs = torch.tensor([float(pos)], dtype=torch.float32, device=x.device)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[0]  # [rotary_dim]
    cos, sin = emb.cos(), emb.sin()
    rot, rest = x[:, :rotary_dim].float(), x[:, rotary_dim:].float()
    half = rotary_dim // 2
    rotated = torch.cat([-rot[:, half:], rot[:, :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def kv_append_ref(k_cache, v_cache, k, v, pos: int) -> None:
    k_cache[pos] = k.to(k_cache.dtype)
    v_cache[pos] = v.to(v_cache.dtype)


def attention_ref(q: torch.Tensor, k_cache, v_cache, pos: int, scale: float) -> torch.Tensor:
    h = q.shape[0]
    n = pos + 1
    rep = h // k_cache.shape[1]
    k = k_cache[:n].float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, n, D]
    v = v_cache[:n].float().repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,hnd->hn", q.float(), k) * scale
    p = torch.softmax(scores, dim=-1, dtype=torch.float32)
    return torch.einsum("hn,hnd->hd", p, v)


def attn_step_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos: int, eps: float, theta: float, rotary_dim: int,
                  scale: float) -> torch.Tensor:
    """The gated attention token mixer after its input projections, as one step: split q|gate per
    head, q/k RMSNorm, partial RoPE at pos, KV append at pos, GQA attention over 0..pos, sigmoid gate.
    Composed from the single-op references in the same order, so it matches them bit for bit."""

    _, hkv, d = k_cache.shape
    nh = qg.shape[0] // (2 * d)
    qg = qg.reshape(nh, 2 * d)
    q = rope_ref(rmsnorm_ref(qg[:, :d], q_norm, eps), pos, theta, rotary_dim)
    kr = rope_ref(rmsnorm_ref(k.reshape(hkv, d), k_norm, eps), pos, theta, rotary_dim)
    kv_append_ref(k_cache, v_cache, kr, v.reshape(hkv, d), pos)
    o = attention_ref(q, k_cache, v_cache, pos, scale).reshape(nh * d)
    return sigmoid_gate_ref(o, qg[:, d:].reshape(nh * d))


def attn_rows_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos: int, n_prompt: int, eps: float, theta: float,
                  rotary_dim: int, scale: float) -> torch.Tensor:
    """Gated attention over the M rows of a prompt chunk: row r (position pos + r, while < n_prompt)
    appends its k, v to the caches and attends over rows 0..pos + r (causal inside the chunk), exactly
    as the one-token step does at that position; invalid rows are left zero and write nothing."""
    rows = qg.shape[0]
    out = torch.zeros(rows, qg.shape[1] // 2, dtype=torch.float32)
    for r in range(max(0, min(rows, n_prompt - pos))):
        out[r] = attn_step_ref(qg[r], k[r], v[r], q_norm, k_norm, k_cache, v_cache, pos + r, eps, theta, rotary_dim,
                               scale)
    return out


# Largest dynamic shared memory a CTA may opt into, per compute capability (bytes): the targets'
# smem_optin (kernels/targets.py), keyed by cc for existing callers.
SMEM_OPTIN = {t.cc: t.smem_optin for t in TARGETS.values()}


def attn_splits(n_heads: int, max_seq: int, target) -> int:
    """Sequence splits per query head (a power of two), from ``target.rules["attention"]`` (sm_90:
    about 256 programs in all, at most 64, and at least 128 cache rows per split at max_seq).
    27B (24 heads): 8; 0.8B (8 heads): 32; 4B/9B: 16."""
    r = target.rules["attention"]
    cap = min(r.max_splits, max(1, r.split_programs // n_heads), max(1, max_seq // r.min_rows_per_split))
    return 1 << (cap.bit_length() - 1)


def attn_step_launch(n_heads: int, n_kv: int, head_dim: int, max_seq: int, splits: int, target) -> dict:
    """Grid [NH, SPLITS]: one CTA per query head and split of the sequence, walking its rows in
    BLOCK_S-row tiles (flash-decoding; see attn_step_kernel for the combine). Constants from
    ``target.rules["attention"]`` (kernels/targets.py); on sm_90: 8 warps, tiles of 8K elements,
    BLOCK_S in [16, 64].

    PIPE_BYTES (added key): shared memory the kernel's software pipeline may fill with K/V tiles in
    flight, at most pipe_bytes_max (128 KiB on sm_90: about what one SM can usefully keep in flight),
    leaving smem_reserve (16 KiB) of the target's ``smem_optin`` for the kernel's other scratch; the
    kernel derives its stage count from it and the cache's element size (which this rule is not
    told). Kernels above 48 KiB of dynamic shared memory need the opt-in attribute set at load time."""

    r = target.rules["attention"]
    block_d = pow2_at_least(head_dim)
    block_s = max(r.min_block_s, min(r.max_block_s, r.tile_elems // block_d))
    pipe = min(r.pipe_bytes_max, target.smem_optin - r.smem_reserve)
    return {"grid": [n_heads, splits, 1], "num_warps": r.num_warps,
            "constexprs": {"NH": n_heads, "NKV": n_kv, "D": head_dim, "S": max_seq, "SPLITS": splits,
                           "BLOCK_D": block_d, "BLOCK_S": block_s, "PIPE_BYTES": pipe}}


@triton.jit
def _round_bf16(x):
    """x rounded to the nearest bf16 (ties to even), kept in fp32: the value a bf16 store keeps, so the
    cast that follows is exact. (The GPU's conversion rounds the same way; Triton's interpreter
    truncates, hence the explicit rounding.) x is finite."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _norm_rope(x_ptr, w_ptr, d, dmask, eps, cos, sin, rotary_dim, D: tl.constexpr):
    """One head of ``rope(rmsnorm(x) * (1 + w))`` in fp32 registers, lane d holding element d.

    NeoX RoPE pairs element i with i +- rotary_dim/2, which lives in another lane; rather than move
    values between lanes, each lane re-loads its partner from the (read-only) input and normalises it
    with the same per-head factor, so no lane ever depends on another one."""
    x = tl.load(x_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * r * (1.0 + tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32))
    half = rotary_dim // 2
    rot = d < rotary_dim
    lo = d < half
    partner = tl.where(lo, d + half, d - half)
    xp = tl.load(x_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    yp = xp * r * (1.0 + tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32))
    yp = tl.where(lo, -yp, yp)  # rotate_half: [-x2, x1]
    return tl.where(rot, y * cos + yp * sin, y)


@triton.jit
def attn_step_kernel(qg_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, part_ptr,
                     ticket_ptr, out_ptr, eps, theta, rotary_dim, scale,
                     NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, S: tl.constexpr, SPLITS: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PIPE_BYTES: tl.constexpr):
    """Fused gated-attention decode step (``attn_step_ref``), kernel ids attn_step_bf16 / attn_step_f32.

    For query head h (kv head g = h // (NH / NKV)) at position p = clamp(*pos_ptr, 0, S - 1):
      q = rope(rmsnorm(qg[h, :D]) * (1 + q_norm)),  k = rope(rmsnorm(k[g]) * (1 + k_norm)),
      k_cache[p, g] = k,  v_cache[p, g] = v[g]   (stored in the cache dtype),
      out[h] = softmax(q . K[0..p, g]^T * scale) V[0..p, g] * sigmoid(qg[h, D:]),
    with every load cast to fp32 and fp32 accumulation. RoPE uses the reference's fp32 angles:
    inv_freq = 1 / theta^(2i / rotary_dim) (the power evaluated in fp64 and rounded, then an IEEE
    fp32 division), angle = p * inv_freq, full-range cos/sin (Triton compiles tl.cos/tl.sin to
    accurate code, not the approximate instructions). Offsets are int32: S * NKV * D < 2^31.

    Work split: grid [NH, SPLITS], program (h, j) for query head h and split j of rows 0..p-1. The
    splits with work are A = clamp(ceil(p / BLOCK_S), 1, SPLITS) (at least one tile each, so a short
    context runs on few programs), split j < A taking rows [j * C, min((j + 1) * C, p)) with
    C = ceil(ceil(p / A) / BLOCK_S) * BLOCK_S; all fixed by p alone. Split 0 also holds row p. Lane d of a [BLOCK_D] vector holds
    head element d (BLOCK_D = D rounded up to a power of two). A program walks its rows in BLOCK_S-row
    tiles [BLOCK_S, BLOCK_D], contiguous along D (16-byte cp.async copies), software-pipelined through
    shared memory: up to 4 K/V tile pairs in flight, as many as PIPE_BYTES holds for the cache's element
    size. Each tile row slot keeps its own online softmax (max, sum, fp32 accumulator), so the loop
    needs no reduction across warps; the slots are merged once at the end into the split's partial
    (m, l, acc[D]), stored in ``part`` [NH, SPLITS, D + 2] (a scratch state of the plan).

    Combine (deterministic, no floating-point atomics): after storing its partial, an active program
    takes a ticket from ``ticket[h]`` (an integer atomic, acquire-release at GPU scope, after a CTA
    barrier); the program that draws ticket A - 1 reads the A partials of head h back from L2 in split
    order (split 0 holds row p), merges them, applies the output gate, stores out[h] and resets the
    ticket to 0 for the next launch. Which program combines varies; what it computes does not (every
    partial is read from memory, in a fixed order), so runs repeat bit for bit.

    Ordering (race-free under any CTA schedule): row p is never read from memory. Every program
    computes its kv head's roped k and v in registers, rounds them to the cache dtype (what the
    reference reads back after the append) and seeds the online softmax with them; the tiles cover
    rows < p only, which no program of this launch writes. Row p of kv head g is stored by exactly
    one program, split 0 of the first query head of the group (h % (NH / NKV) == 0); the others of the
    group compute the same values but do not store them.
    """
    h = tl.program_id(0)
    sp = tl.program_id(1)
    REP: tl.constexpr = NH // NKV
    g = h // REP
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr), 0), S - 1)

    d = tl.arange(0, BLOCK_D)
    dmask = d < D

    # Splits with work: at least one BLOCK_S tile each, so a short context runs on few programs (and
    # few ticket atomics); the others exit at once. Every program derives the same count from pos.
    active = tl.maximum(tl.minimum(tl.cdiv(pos, BLOCK_S), SPLITS), 1)
    if sp < active:
        # RoPE angles for lane d (pairs share the frequency of index d mod rotary_dim/2).
        half = rotary_dim // 2
        fi = tl.where(d < half, d, tl.where(d < rotary_dim, d - half, 0))  # lanes past rotary_dim: unused
        expo = tl.div_rn((2 * fi).to(tl.float32), tl.full([BLOCK_D], rotary_dim, tl.int32).to(tl.float32))
        log2_theta = tl.log2(tl.full([BLOCK_D], theta, tl.float32).to(tl.float64))
        powr = tl.exp2(expo.to(tl.float64) * log2_theta).to(tl.float32)
        inv_freq = tl.div_rn(tl.full([BLOCK_D], 1.0, tl.float32), powr)
        angle = pos.to(tl.float32) * inv_freq
        cos = tl.cos(angle)
        sin = tl.sin(angle)

        q = _norm_rope(qg_ptr + h * 2 * D, q_norm_ptr, d, dmask, eps, cos, sin, rotary_dim, D)
        kr = _norm_rope(k_ptr + g * D, k_norm_ptr, d, dmask, eps, cos, sin, rotary_dim, D)
        vr = tl.load(v_ptr + g * D + d, mask=dmask, other=0.0).to(tl.float32)

        # Append row p (one writer per kv head) and use the cache-rounded values for it.
        if k_cache_ptr.dtype.element_ty == tl.bfloat16:
            kr = _round_bf16(kr)
        if v_cache_ptr.dtype.element_ty == tl.bfloat16:
            vr = _round_bf16(vr)
        row = pos * (NKV * D) + g * D
        writer = ((h % REP) == 0) & (sp == 0)
        tl.store(k_cache_ptr + row + d, kr.to(k_cache_ptr.dtype.element_ty), mask=dmask & writer)
        tl.store(v_cache_ptr + row + d, vr.to(v_cache_ptr.dtype.element_ty), mask=dmask & writer)

        # Row p's score (log2 domain: q pre-scaled by scale * log2(e), so exp2 gives the softmax weights).
        qs = q * (scale * 1.4426950408889634)
        s_p = tl.sum(qs * kr, axis=0)

        # This split's rows of 0..p-1: one online softmax per tile row slot j (rows j, j + BLOCK_S, ...),
        # so the loop needs no reduction across warps; the slots are combined once at the end.
        chunk = tl.cdiv(tl.cdiv(pos, active), BLOCK_S) * BLOCK_S
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, pos)
        s_off = tl.arange(0, BLOCK_S)
        m_j = tl.full([BLOCK_S], -1.0e30, tl.float32)  # finite: an empty slot has weight exp2(-1e30 - m) = 0
        l_j = tl.zeros([BLOCK_S], tl.float32)
        acc_j = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
        # K/V tiles in flight: as many as PIPE_BYTES of shared memory hold, at most 4 (cp.async pipeline).
        ELEM_BYTES: tl.constexpr = k_cache_ptr.dtype.element_ty.primitive_bitwidth // 8
        NBUF: tl.constexpr = PIPE_BYTES // (2 * BLOCK_S * BLOCK_D * ELEM_BYTES)
        STAGES: tl.constexpr = 1 + (NBUF if NBUF < 4 else 4)
        for start in tl.range(lo, hi, BLOCK_S, num_stages=STAGES):
            rows = start + s_off
            rmask = rows < hi
            offs = (rows * (NKV * D) + g * D)[:, None] + d[None, :]
            tmask = rmask[:, None] & dmask[None, :]
            kt = tl.load(k_cache_ptr + offs, mask=tmask, other=0.0).to(tl.float32)
            vt = tl.load(v_cache_ptr + offs, mask=tmask, other=0.0).to(tl.float32)
            s = tl.where(rmask, tl.sum(kt * qs[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m_j, s)
            alpha = tl.exp2(m_j - m_new)
            pr = tl.exp2(s - m_new)
            l_j = l_j * alpha + pr
            acc_j = acc_j * alpha[:, None] + pr[:, None] * vt
            m_j = m_new

        # The split's partial (m, l, acc); split 0 also holds row p (an empty split: -1e30, 0, 0).
        s_p = tl.where(sp == 0, s_p, -1.0e30)
        m_s = tl.maximum(tl.max(m_j, axis=0), s_p)
        w_j = tl.exp2(m_j - m_s)
        w_p = tl.where(sp == 0, tl.exp2(s_p - m_s), 0.0)
        part = part_ptr + (h * SPLITS + sp) * (D + 2)
        tl.store(part + d, tl.sum(acc_j * w_j[:, None], axis=0) + vr * w_p, mask=dmask)
        tl.store(part + D, m_s)
        tl.store(part + D + 1, tl.sum(l_j * w_j, axis=0) + w_p)
        tl.debug_barrier()  # every thread's stores precede the ticket (released at GPU scope)
        ticket = tl.atomic_add(ticket_ptr + h, 1, sem="acq_rel", scope="gpu")
        if ticket == active - 1:  # the last active split of head h merges their partials, in order
            j = tl.arange(0, SPLITS)
            jm = j < active
            rows_p = part_ptr + (h * SPLITS + j) * (D + 2)
            m_all = tl.load(rows_p + D, mask=jm, other=-1.0e30, cache_modifier=".cg")
            l_all = tl.load(rows_p + D + 1, mask=jm, other=0.0, cache_modifier=".cg")
            acc_all = tl.load(rows_p[:, None] + d[None, :], mask=jm[:, None] & dmask[None, :], other=0.0,
                              cache_modifier=".cg")
            m = tl.max(m_all, axis=0)  # finite: split 0 holds row p
            w = tl.exp2(m_all - m)
            o = tl.sum(acc_all * w[:, None], axis=0) / tl.sum(l_all * w, axis=0)
            gate = tl.load(qg_ptr + h * 2 * D + D + d, mask=dmask, other=0.0).to(tl.float32)
            tl.store(out_ptr + h * D + d, o * tl.sigmoid(gate), mask=dmask)
            tl.atomic_xchg(ticket_ptr + h, 0, sem="relaxed", scope="gpu")  # ready for the next launch
