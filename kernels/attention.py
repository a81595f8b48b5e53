"""Gated attention decode over a KV cache of max_seq rows.

* ``rope_ref``: NeoX-style rotary embedding on the first ``rotary_dim`` dims of each head at ``pos``
  (partial RoPE), the rest passes through; cos/sin computed in fp32 as the reference model does;
* ``kv_append_ref``: write k, v into row ``pos`` of the caches;
* ``attention_ref``: softmax(q K[0..pos]^T * scale) V in fp32, query head h reading kv head h // (H / Hkv);
* ``attn_step_kernel``: the fused decode step ``attn_step_ref`` as one Triton kernel (launch: ``attn_step_launch``);
* ``attn_rows_kv_kernel`` / ``attn_rows_q_kernel``: the M-row (prefill) step's gated attention as two kernels,
  ``attn_rows_kv_ref`` then ``attn_rows_q_ref`` (launch: ``attn_rows_kv_launch`` / ``attn_rows_q_launch``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.elementwise import sigmoid_gate_ref
from kestrel.kernels.pdl import _INTERPRET, pdl_wait
from kestrel.kernels.rmsnorm import rmsnorm_ref
from kestrel.kernels.targets import TARGETS, fp_fusion, pow2_at_least


def rope_inv_freq(theta: float, rotary_dim: int, yarn=None) -> torch.Tensor:
    """RoPE's fp32 inverse frequencies [rotary_dim / 2]: 1 / theta^(2i / rotary_dim); with YaRN (``yarn`` =
    [factor, low, span, attention factor], ModelConfig.rope_yarn) the same divided by factor below the ramp
    (low .. low + span), undivided above it, blended linearly inside it, each step the fp32 operation
    transformers' ``_compute_yarn_parameters`` makes."""
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    if not yarn:
        return 1.0 / pos_freqs
    factor, low, span, _ = yarn
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / span, 0, 1)
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rope_ref(x: torch.Tensor, pos: int, theta: float, rotary_dim: int, yarn=None) -> torch.Tensor:
    """NeoX rotary of x [heads, D]'s first rotary_dim dims at pos (with YaRN, cos and sin times its attention
    factor, as transformers' rotary embedding scales them)."""
    inv_freq = rope_inv_freq(theta, rotary_dim, yarn).to(x.device)
    freqs = torch.tensor([float(pos)], dtype=torch.float32, device=x.device)[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[0]  # [rotary_dim]
    cos, sin = emb.cos(), emb.sin()
    if yarn:
        cos, sin = cos * yarn[3], sin * yarn[3]
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
                  scale: float, yarn=None) -> torch.Tensor:
    """The gated attention token mixer after its input projections, as one step: split q|gate per
    head, q/k RMSNorm, partial RoPE at pos, KV append at pos, GQA attention over 0..pos, sigmoid gate.
    Composed from the single-op references in the same order, so it matches them bit for bit."""

    _, hkv, d = k_cache.shape
    nh = qg.shape[0] // (2 * d)
    qg = qg.reshape(nh, 2 * d)
    q = rope_ref(rmsnorm_ref(qg[:, :d], q_norm, eps), pos, theta, rotary_dim, yarn)
    kr = rope_ref(rmsnorm_ref(k.reshape(hkv, d), k_norm, eps), pos, theta, rotary_dim, yarn)
    kv_append_ref(k_cache, v_cache, kr, v.reshape(hkv, d), pos)
    o = attention_ref(q, k_cache, v_cache, pos, scale).reshape(nh * d)
    return sigmoid_gate_ref(o, qg[:, d:].reshape(nh * d))


def attn_rows_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos: int, n_prompt: int, eps: float, theta: float,
                  rotary_dim: int, scale: float, yarn=None) -> torch.Tensor:
    """Gated attention over the M rows of a prompt chunk: row r (position pos + r, while < n_prompt)
    appends its k, v to the caches and attends over rows 0..pos + r (causal inside the chunk), exactly
    as the one-token step does at that position; invalid rows are left zero and write nothing."""
    rows = qg.shape[0]
    out = torch.zeros(rows, qg.shape[1] // 2, dtype=torch.float32)
    for r in range(max(0, min(rows, n_prompt - pos))):
        out[r] = attn_step_ref(qg[r], k[r], v[r], q_norm, k_norm, k_cache, v_cache, pos + r, eps, theta, rotary_dim,
                               scale, yarn)
    return out


def attn_rows_kv_ref(x, k_norm, k_cache, v_cache, pos: int, n_prompt: int, k: int, v: int, eps: float, theta: float,
                     rotary_dim: int, yarn=None) -> None:
    """First half of ``attn_rows_ref`` on the projection rows x [M, W] (columns k .. k + Hkv * D are
    the keys, v .. v + Hkv * D the values): each valid row's k RMSNormed and rotated at pos + r, and
    appended with its v to the caches (rows pos .. pos + valid - 1)."""
    _, hkv, d = k_cache.shape
    for r in range(max(0, min(x.shape[0], n_prompt - pos))):
        kr = rope_ref(rmsnorm_ref(x[r, k:k + hkv * d].reshape(hkv, d), k_norm, eps), pos + r, theta, rotary_dim,
                      yarn)
        kv_append_ref(k_cache, v_cache, kr, x[r, v:v + hkv * d].reshape(hkv, d), pos + r)


def attn_rows_q_ref(x, q_norm, k_cache, v_cache, pos: int, n_prompt: int, q: int, heads: int, eps: float,
                    theta: float, rotary_dim: int, scale: float, yarn=None) -> torch.Tensor:
    """Second half, after ``attn_rows_kv_ref`` wrote the chunk's rows: valid row r's queries (columns
    q .. q + 2 * heads * D, q|gate per head) RMSNormed, rotated at pos + r, attending over cache rows
    0 .. pos + r (causal inside the chunk), times sigmoid(gate). Returns [M, heads * D], zero on
    invalid rows."""
    _, hkv, d = k_cache.shape
    out = torch.zeros(x.shape[0], heads * d, dtype=torch.float32)
    for r in range(max(0, min(x.shape[0], n_prompt - pos))):
        qg = x[r, q:q + 2 * heads * d].reshape(heads, 2 * d)
        qr = rope_ref(rmsnorm_ref(qg[:, :d], q_norm, eps), pos + r, theta, rotary_dim, yarn)
        o = attention_ref(qr, k_cache, v_cache, pos + r, scale).reshape(heads * d)
        out[r] = sigmoid_gate_ref(o, qg[:, d:].reshape(heads * d))
    return out


# Largest dynamic shared memory a CTA may opt into, per compute capability (bytes): the targets'
# smem_optin (kernels/targets.py), keyed by cc for existing callers.
SMEM_OPTIN = {t.cc: t.smem_optin for t in TARGETS.values()}


def attn_splits(n_kv: int, max_seq: int, target) -> int:
    """Sequence splits per kv head (a power of two) for attn_step_kernel's grid [NKV, SPLITS], from
    ``target.rules["attention"]``: about split_programs programs in all (sm_90: 128, about one per
    SM of the H200: a program holds most of an SM's shared memory), at most max_splits (64), and at
    least min_rows_per_split (128) cache rows per split at max_seq. sm_90 from max_seq 8192: 0.8B
    and 2B (2 kv heads) 64 splits, 4B, 9B and 27B (4 kv heads) 32: 128 programs each; at max_seq
    4096 every preset gets 32 (64 and 128 programs)."""
    r = target.rules["attention"]
    cap = min(r.max_splits, max(1, r.split_programs // n_kv), max(1, max_seq // r.min_rows_per_split))
    return 1 << (cap.bit_length() - 1)


def attn_step_launch(n_heads: int, n_kv: int, head_dim: int, max_seq: int, splits: int, cache_dtype: str,
                     target) -> dict:
    """Grid [NKV, SPLITS]: one CTA per kv head and split of the sequence, taking all REP = n_heads /
    n_kv query heads of the kv head's group, walking its rows in BLOCK_S-row tiles (flash-decoding;
    see attn_step_kernel for the products and the combine). Constants from
    ``target.rules["attention"]`` (kernels/targets.py; sm_90 values in brackets), per cache dtype
    (bf16: tensor-core dots; f32: fp32 FMA dots), which is why the rule is told it:

    * BLOCK_H: REP rounded up to a power of two, with bf16 caches at least mma_min_heads [16] (the
      mma tile height: smaller tiles are padded by Triton anyway, at a cost in instructions);
    * BLOCK_Q: the query rows normed and roped (and, with one active split, divided and gated at the end): REP
      rounded up to a power of two with narrow_queries [True], repeated to BLOCK_H rows for the products (else
      BLOCK_H). H200, 0.8B q4, A B B A (bench/results/stop37 call 2): 0.4765 -> 0.468 ms/token with it and the
      kernel's loads issued together after the wait; a 16-row query tile had 0.4736;
    * BLOCK_S = tile_bytes [32 KiB] / (BLOCK_D * element size) within [min_block_s, max_block_s]
      [16, 64] (16: a dot's smallest K): 64 rows at D = 256 with bf16 caches, 32 with fp32; halved
      (down to min_block_s) until PIPE_BYTES holds min_tiles_in_flight [2] K/V tile pairs (with one,
      the next tile's copy would wait for the current tile's dots): on the 99 KiB targets 32 rows
      at D = 256 with bf16 caches, 16 with fp32;
    * num_warps [4] with bf16 caches (the mma tile [16, BLOCK_S] is split by columns over the warps,
      and every warp reads the whole query tile, 24 KiB of bf16 parts, from shared memory per K/V
      tile: with 4 warps 1.5x the tile's 64 KiB, with 8 warps 3x), fma_num_warps [8] with fp32 caches;
    * PIPE_BYTES (added key): shared memory the kernel's software pipeline may fill with K/V tiles
      in flight, at most pipe_bytes_max [128 KiB: about what one SM can usefully keep in flight],
      leaving the query tile (three bf16 parts, or fp32) and smem_reserve [8 KiB] of the target's
      ``smem_optin`` for the rest; the kernel derives its stage count from it and the element size;
    * SPLIT_ROWS = split_tiles [2] x BLOCK_S: the rows an active split takes at least (a shorter
      context runs on fewer splits; from 4096 rows at 27B all 32 splits work): with one split per
      tile, the partials, the ticket and the serial merge cost a short context's step 6-12 us per
      attention layer more than the per-query-head kernel this replaced (27B q4 5.67 against 5.52
      ms/token at positions 40-104, H200, bench/results/stop20 call 5);
    * MERGE_CH = min(SPLITS, merge_splits [32]) splits' partials a head summed at a time by the combine, with
      merge_stages [2] chunks in flight; MERGE_SMALL = merge_small [8] (with merge_small_stages [4] in flight)
      where SPLITS > MERGE_CH, else 0: at up to that many active splits the combine takes chunks of that many;
    * DOT_FP32: False (True only in interpreter tests, where Triton computes bf16 dots wrongly: the
      same bf16 parts then go through fp32 dots).

    At a short context the grouped form is a latency chain in 2-4 programs (stop 35: ~3,600 instructions a warp,
    8-9 us alone at position 44, 11 us a layer in the 80B-A3B step's graph, stop 42). One program a query head
    there instead (fp32 FMA products over 32-row tiles, the first loaded with the inputs) was built in stop 43 and
    lost in stops 45-46 (0.8B q4 +0.6%, 80B-A3B +0.4%, H200): removed, in the tree at commit 2e5c32b.

    At 27B on sm_90 (bf16, D = 256): grid [4, 32], BLOCK_H 16 (6 heads), BLOCK_S 64, 4 warps, two
    64 KiB tile pairs in flight plus the 24 KiB query parts: 158 KiB of shared memory (one CTA per
    SM), 168 registers and no spills (ptxas, Triton 3.7); per 64-row tile a warp issues 192
    m16n8k16 mma and ~600 instructions in all, against the ~3000 cycles an SM's share of HBM
    bandwidth takes to deliver the tile. Kernels above 48 KiB of dynamic shared memory need the
    opt-in attribute set at load time."""
    if cache_dtype not in ("bf16", "f32"):
        raise ValueError(f"attn_step: no kernel for {cache_dtype} caches (bf16 or f32)")
    r = target.rules["attention"]
    block_d = max(16, pow2_at_least(head_dim))
    mma = cache_dtype == "bf16"
    elem = 2 if mma else 4
    block_h = max(r.mma_min_heads if mma else 1, pow2_at_least(n_heads // n_kv))
    block_s = max(r.min_block_s, min(r.max_block_s, r.tile_bytes // (block_d * elem)))
    q_bytes = (3 * 2 if mma else 4) * block_h * block_d
    pipe = min(r.pipe_bytes_max, target.smem_optin - r.smem_reserve - q_bytes)
    while block_s > r.min_block_s and pipe < r.min_tiles_in_flight * 2 * block_s * block_d * elem:
        block_s //= 2
    return {"grid": [n_kv, splits, 1],
            **attn_step_warps(cache_dtype, target),
            "constexprs": {"NH": n_heads, "NKV": n_kv, "D": head_dim, "S": max_seq, "SPLITS": splits,
                           "BLOCK_H": block_h,
                           "BLOCK_Q": pow2_at_least(n_heads // n_kv) if r.narrow_queries else block_h,
                           "BLOCK_D": block_d, "BLOCK_S": block_s, "SPLIT_ROWS": r.split_tiles * block_s,
                           "PIPE_BYTES": pipe,
                           "MERGE_CH": min(splits, r.merge_splits), "MERGE_STAGES": r.merge_stages,
                           "MERGE_SMALL": r.merge_small if splits > r.merge_splits else 0,
                           "MERGE_SMALL_STAGES": r.merge_small_stages,
                           "DOT_FP32": False}}


def attn_step_warps(cache_dtype: str, target) -> dict:
    """attn_step_kernel's warps (``target.rules["attention"]``: num_warps with bf16 caches, fma_num_warps with fp32)
    and its ``fp_fusion`` key: what a kernel computing its keys or rows the same way must be compiled with."""
    r = target.rules["attention"]
    return {"num_warps": r.num_warps if cache_dtype == "bf16" else r.fma_num_warps, **fp_fusion(r.fp_fusion)}


def attn_rows_kv_launch(rows: int, width: int, n_kv: int, head_dim: int, max_seq: int, cache_dtype: str,
                        target) -> dict:
    """Grid [rows, n_kv]: one program per (chunk row, kv head), a [BLOCK_D] vector of lanes;
    num_warps ``target.rules["attn_rows"].kv_num_warps`` (2 on sm_90), except at up to the rule's
    step_order_rows rows (a speculative verify's: attn_rows_launch), where it takes attn_step's warps and FMA
    contraction, so that its keys are attn_step's bit for bit: the key's RMS norm sums over a [BLOCK_D] vector
    whose layout, and so the order of the sum, follows the warps (2 against attn_step's 4 differed by an ulp,
    which the bf16 cache mostly, but not always, rounds away; stop 34)."""
    r = target.rules["attn_rows"]
    warps = attn_step_warps(cache_dtype, target) if rows <= r.step_order_rows else {"num_warps": r.kv_num_warps}
    return {"grid": [rows, n_kv, 1], **warps,
            "constexprs": {"M": rows, "W": width, "NKV": n_kv, "D": head_dim, "S": max_seq,
                           "BLOCK_D": pow2_at_least(head_dim)}}


def attn_rows_q_launch(rows: int, width: int, heads: int, n_kv: int, head_dim: int, max_seq: int, target) -> dict:
    """Grid [n_kv, ceil(rows * heads / n_kv / BLOCK_R)]: program (g, b) takes BLOCK_R tile rows of kv
    head g's (chunk row, query head of the group) pairs (see attn_rows_q_kernel). Constants from
    ``target.rules["attn_rows"]`` (kernels/targets.py; sm_90 values in brackets): BLOCK_R =
    max_block_r [32], halved while the grid has fewer than programs_per_sm [1] x sms programs, down to
    min_block_r [16] (27B at M = 128 on the H200: 4 x 48 programs of 16 tile rows; at M = 512: 4 x 96
    of 32); BLOCK_N = tile_elems [8192] / BLOCK_D within [16, 64] (32 at D = 256); one warp per
    acc_elems_per_warp [512] accumulator elements (BLOCK_R x BLOCK_D), within [4, 8]. PIPE_BYTES:
    shared memory for the K/V tiles in flight, at most pipe_bytes_max [64 KiB], leaving the bf16 query
    tile (BLOCK_R x BLOCK_D x 2 bytes) and smem_reserve [8 KiB] of the target's ``smem_optin``; the
    kernel derives its stage count from it and the cache's element size (bf16: 2 tile pairs in flight,
    fp32: 1). DOT_FP32 is False (True only in interpreter tests).

    SPLITS (a power of two; the grid's third axis) where the tile groups are few (a verify's few rows):
    about split_programs [128] programs in all, at most max_splits [32] and at least one split per
    split_tiles [4] x BLOCK_N cache rows of max_seq; SPLIT_ROWS = split_tiles x BLOCK_N, the rows an
    active split takes at least (so a short context merges little: below 128 rows at D = 256 one split
    works and nothing merges). 27B at 4 rows (8 tile groups): 16 splits; at 128 rows (192 groups): 1,
    the kernel as before. ``attn_rows_scratch`` sizes the partials and tickets for the launch."""
    r = target.rules["attn_rows"]
    block_d = max(16, pow2_at_least(head_dim))
    tile_rows = rows * (heads // n_kv)
    block_r = max(r.min_block_r, min(r.max_block_r, pow2_at_least(tile_rows)))
    while block_r > r.min_block_r and n_kv * -(-tile_rows // block_r) < r.programs_per_sm * target.sms:
        block_r //= 2
    block_n = max(r.min_block_n, min(r.max_block_n, r.tile_elems // block_d))
    warps = max(r.min_warps, min(r.max_warps, block_r * block_d // r.acc_elems_per_warp))
    pipe = min(r.pipe_bytes_max, target.smem_optin - r.smem_reserve - 2 * block_r * block_d)
    blocks = -(-tile_rows // block_r)
    cap = min(r.max_splits, max(1, r.split_programs // (n_kv * blocks)),
              max(1, max_seq // (r.split_tiles * block_n)))
    splits = 1 << (cap.bit_length() - 1)
    return {"grid": [n_kv, blocks, splits], "num_warps": warps,
            "constexprs": {"M": rows, "W": width, "NKV": n_kv, "D": head_dim, "S": max_seq, "BLOCK_D": block_d,
                           "BLOCK_R": block_r, "BLOCK_N": block_n, "SPLITS": splits,
                           "SPLIT_ROWS": r.split_tiles * block_n, "PIPE_BYTES": pipe, "DOT_FP32": False}}


def attn_rows_scratch(launch: dict, head_dim: int) -> tuple[tuple[int, int], tuple[int]]:
    """(partials, tickets) shapes for an attn_rows_q launch: f32 [tile groups x SPLITS x BLOCK_R, D + 2] and
    i32 [tile groups]; [1, D + 2] and [1] where it does not split (the kernel then never touches them)."""
    c = launch["constexprs"]
    if "BLOCK_S" in c:  # attn_rows_step_kernel: attn_step_kernel's partials and tickets, a set per row
        return (c["M"] * c["NH"] * c["SPLITS"], head_dim + 2), (c["M"] * c["NKV"],)
    nkv, blocks, splits = launch["grid"]
    if splits == 1:
        return (1, head_dim + 2), (1,)
    return (nkv * blocks * splits * launch["constexprs"]["BLOCK_R"], head_dim + 2), (nkv * blocks,)


@triton.jit
def _round_bf16(x):
    """x rounded to the nearest bf16 (ties to even), kept in fp32: the value a bf16 store keeps, so the
    cast that follows is exact. (The GPU's conversion rounds the same way; Triton's interpreter
    truncates, hence the explicit rounding.) x is finite."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _fmul_rn(a, b):
    """a * b in fp32, rounded once and never contracted into an FMA with a following add (PTX ``mul.rn``; plain in
    the interpreter, which contracts nothing)."""
    if _INTERPRET:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _rope_inv_freq(d, theta, rotary_dim, BLOCK_D: tl.constexpr, YARN: tl.constexpr = None):
    """RoPE's inverse frequency for lane d, as the reference computes it in fp32: 1 / theta^(2i / rotary_dim)
    with i = d mod rotary_dim/2 (the power evaluated in fp64 and rounded, then an IEEE fp32 division);
    lanes past rotary_dim get i = 0 (unused). With YaRN (``YARN`` = (factor, low, span, attention factor), a
    constexpr) rope_inv_freq's blend of that and its quotient by factor, each step rounded as the reference's."""
    half = rotary_dim // 2
    fi = tl.where(d < half, d, tl.where(d < rotary_dim, d - half, 0))
    expo = tl.div_rn((2 * fi).to(tl.float32), tl.full([BLOCK_D], rotary_dim, tl.int32).to(tl.float32))
    log2_theta = tl.log2(tl.full([BLOCK_D], theta, tl.float32).to(tl.float64))
    powr = tl.exp2(expo.to(tl.float64) * log2_theta).to(tl.float32)
    one = tl.full([BLOCK_D], 1.0, tl.float32)
    inv = tl.div_rn(one, powr)
    if YARN is not None:
        interpolation = tl.div_rn(one, tl.full([BLOCK_D], YARN[0], tl.float32) * powr)
        ramp = tl.div_rn(fi.to(tl.float32) - tl.full([BLOCK_D], YARN[1], tl.float32),
                         tl.full([BLOCK_D], YARN[2], tl.float32))
        extrapolation_factor = 1.0 - tl.minimum(tl.maximum(ramp, 0.0), 1.0)
        inv = _fmul_rn(interpolation, 1.0 - extrapolation_factor) + _fmul_rn(inv, extrapolation_factor)
    return inv


@triton.jit
def _rope_scaled(c, YARN: tl.constexpr = None):
    """cos or sin as the reference scales it: times YaRN's attention factor, unscaled without YaRN."""
    if YARN is not None:
        c = c * YARN[3]
    return c


@triton.jit
def _norm_rope(x_ptr, w_ptr, d, dmask, eps, cos, sin, rotary_dim, D: tl.constexpr):
    """One head of ``rope(rmsnorm(x) * (1 + w))`` in fp32 registers, lane d holding element d.

    NeoX RoPE pairs element i with i +- rotary_dim/2, which lives in another lane; rather than move
    values between lanes, each lane re-loads its partner from the (read-only) input and normalises it
    with the same per-head factor, so no lane ever depends on another one."""
    partner = _rope_partner(d, rotary_dim)
    x, xp, w, wp = _norm_rope_loads(x_ptr + d, x_ptr + partner, w_ptr, d, dmask, rotary_dim)
    return _norm_rope_apply(x, xp, w, wp, d, eps, cos, sin, rotary_dim, D)


@triton.jit
def _rope_partner(d, rotary_dim):
    """The lane NeoX RoPE pairs lane d with (d +- rotary_dim / 2; meaningless past rotary_dim)."""
    half = rotary_dim // 2
    return tl.where(d < half, d + half, d - half)


@triton.jit
def _norm_rope_loads(x_ptrs, xp_ptrs, w_ptr, d, dmask, rotary_dim):
    """``_norm_rope``'s loads, issued apart from its arithmetic (so a kernel can issue them with others): the
    head's elements at x_ptrs (lane d's; [BLOCK_D] or [rows, BLOCK_D]), their RoPE partners at xp_ptrs, the norm
    weight w[d] and w[partner], in fp32."""
    rot = d < rotary_dim
    partner = _rope_partner(d, rotary_dim)
    x = tl.load(x_ptrs, mask=dmask, other=0.0).to(tl.float32)
    xp = tl.load(xp_ptrs, mask=rot, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    return x, xp, w, wp


@triton.jit
def _norm_rope_apply(x, xp, w, wp, d, eps, cos, sin, rotary_dim, D: tl.constexpr):
    """``_norm_rope``'s arithmetic on its loads (a head [BLOCK_D], or heads [rows, BLOCK_D] normed row by row)."""
    r = tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
    y = x * r * (1.0 + w)
    yp = xp * r * (1.0 + wp)
    yp = tl.where(d < rotary_dim // 2, -yp, yp)  # rotate_half: [-x2, x1]
    return tl.where(d < rotary_dim, y * cos + yp * sin, y)


@triton.jit
def _bf16_parts(x, DOT_FP32: tl.constexpr):
    """fp32 x as three bf16 terms hi + mid + lo whose sum is x exactly: each term keeps the leading 8
    significant bits of what the previous ones left (the residuals are exact fp32 differences), so
    24 bits in all, the whole fp32 significand (whether the conversion rounds, as the GPU's does, or
    truncates, as Triton's interpreter does). DOT_FP32 returns them widened to fp32 (interpreter tests)."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    if DOT_FP32:
        return hi.to(tl.float32), mid.to(tl.float32), lo.to(tl.float32)
    return hi, mid, lo


@triton.jit
def attn_step_kernel(qg_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, part_ptr,
                     ticket_ptr, out_ptr, eps, theta, rotary_dim, scale,
                     NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, S: tl.constexpr, SPLITS: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                     SPLIT_ROWS: tl.constexpr, PIPE_BYTES: tl.constexpr, MERGE_CH: tl.constexpr,
                     MERGE_STAGES: tl.constexpr, MERGE_SMALL: tl.constexpr, MERGE_SMALL_STAGES: tl.constexpr,
                     DOT_FP32: tl.constexpr, PDL: tl.constexpr = False, YARN: tl.constexpr = None):
    """Fused gated-attention decode step (``attn_step_ref``), kernel ids attn_step_bf16 / attn_step_f32.

    For query head h (kv head g = h // REP, REP = NH / NKV) at position p = clamp(*pos_ptr, 0, S - 1):
      q = rope(rmsnorm(qg[h, :D]) * (1 + q_norm)),  k = rope(rmsnorm(k[g]) * (1 + k_norm)),
      k_cache[p, g] = k,  v_cache[p, g] = v[g]   (stored in the cache dtype),
      out[h] = softmax(q . K[0..p, g]^T * scale) V[0..p, g] * sigmoid(qg[h, D:]),
    with every load cast to fp32 and fp32 accumulation. RoPE uses the reference's fp32 angles:
    inv_freq = 1 / theta^(2i / rotary_dim) (the power evaluated in fp64 and rounded, then an IEEE
    fp32 division), angle = p * inv_freq, full-range cos/sin (Triton compiles tl.cos/tl.sin to
    accurate code, not the approximate instructions). Offsets are int32: S * NKV * D < 2^31.

    Work split: grid [NKV, SPLITS], program (g, j) for kv head g and split j of rows 0..p-1, taking
    all REP query heads of g's group at once: each K/V tile is loaded once and used for every head
    of the group, so a step reads each cache row once (not REP times, as one program per query head
    did). The splits with work are A = clamp(ceil(p / SPLIT_ROWS), 1, SPLITS) (at least SPLIT_ROWS
    rows each, so a short context runs on few programs and, up to SPLIT_ROWS rows, merges nothing),
    split j < A taking rows [j * C, min((j + 1) * C, p))
    with C = ceil(ceil(p / A) / BLOCK_S) * BLOCK_S; all fixed by p alone. Split 0 also holds row p.

    Tiles: the group's queries are one [BLOCK_H, BLOCK_D] tile, row i holding head g * REP + min(i mod
    BLOCK_Q, REP - 1) (BLOCK_H = REP rounded up to a power of two, at least 16 with bf16 caches, the tensor cores'
    tile height; the queries are normed and roped as BLOCK_Q rows, REP rounded up to a power of two, and
    repeated; padded rows are computed and never stored; with one active split only the first BLOCK_Q rows are
    divided, gated and stored), column d head
    element d (BLOCK_D = D rounded up to a power of two), pre-scaled by scale * log2(e) so exp2 gives
    the softmax weights. A program walks its rows in [BLOCK_S, BLOCK_D] K/V tiles, contiguous along
    D (16-byte cp.async copies; rows past the split's end re-read its last row and get weight 0, so
    the copies need no row mask), software-pipelined through shared memory: as many tile pairs in
    flight as PIPE_BYTES holds for the cache's element size, at most 4. Per tile, for all the heads:
    scores S = Q K^T [BLOCK_H, BLOCK_S], then the online softmax and acc = acc * alpha + P V.

    Products: with bf16 caches both are tensor-core dots (mma, fp32 accumulation) that keep fp32
    accuracy: the fp32 operands, q (once) and the weights P (per tile), are each split into three
    bf16 terms whose sum is exact (``_bf16_parts``: 24 significant bits), and K and V are bf16
    already, so every product is exact: S = Q_hi K^T + (Q_mid K^T + Q_lo K^T) and
    acc += P_lo V + P_mid V + P_hi V equal the fp32 sums up to the accumulator's rounding (three
    separate score dots: three short dependency chains rather than one long one). Why not CUDA
    cores: at REP = 6 a cache row (1 KiB of bf16 K and V at D = 256) costs 2 * REP * D = 3072 FMAs,
    ~100 warp instructions before conversions and reductions, while an SM's share of the H200's
    bandwidth delivers that row every ~50 cycles (at most 200 warp instructions issued): the kernel
    would be compute-bound or close to it; the mma form issues ~40 per row, all included. fp32 caches
    use fp32 dots with input_precision="ieee" (FMA, not the default tf32), at half the rows per tile.

    Softmax state per head, in the score tile's layout (its columns spread over the warps): the
    running max m [BLOCK_H] (one cross-warp max per tile), the accumulator [BLOCK_H, BLOCK_D], and
    the running sum kept per tile column, l [BLOCK_H, BLOCK_S], reduced once after the loop (so the
    loop's only cross-warp reduction is the max). The previous kernel's per-row-slot softmax (no
    cross-warp reduction at all) does not fit: a tensor-core P V sums over the tile's rows inside
    the dot, so every slot of a head must share its max.

    The split's partial (m, l, acc[D]) of each real head is stored in ``part`` [NH, SPLITS, D + 2]
    (a scratch state of the plan). Combine (deterministic, no floating-point atomics): after storing
    them, an active program takes a ticket from ``ticket[g]`` (an integer atomic, acquire-release
    at GPU scope, after a CTA barrier; only the first NKV of the NH tickets are used); the program
    that draws ticket A - 1 merges, head by head of the group in order, the A partials of that head
    in split order (read back from L2), the next head's (or chunk's) copied in while one is summed:
    with SPLITS <= MERGE_CH a head's A partials as one tile; with more splits in chunks of MERGE_CH
    rescaled to the running max, or of MERGE_SMALL at A <= MERGE_SMALL. (A [SPLITS, D] tile a head made
    an 80B-A3B layer 46 us at 4,000 rows of 8,192, chunks of 32 23 us, chained; at max_seq 8192 the 0.8B
    step 0.752 against 0.842 ms/token at position 1000, 0.818 / 0.849 at 3000. At max_seq 4096 (32
    splits) the small chunks made position 1000 faster but 2000-4000 slower in the whole step, so they
    are off there; bench/results/stop35.) It applies the output gate, stores out[h], and resets the
    ticket to 0 for the next launch. Which program combines varies; what it computes does not (every
    partial is read from memory, in a fixed order), so runs repeat bit for bit. With one active split
    (p <= SPLIT_ROWS) its program stores the outputs itself, acc / l (what the merge of one partial
    computes, bit for bit): no partials, ticket or serial merge, which made a short context's step
    6-12 us slower per attention layer than the per-query-head kernel this replaced (H200,
    bench/results/stop20 call 3).

    Ordering (race-free under any CTA schedule): row p is never read from memory. Every program
    computes its kv head's roped k and v in registers and rounds them to the cache dtype (what the
    reference reads back after the append); split 0 seeds every head's softmax with row p (m = its
    score, l = 1, acc = v); the tiles cover rows < p only, which no program of this launch writes.
    Row p of kv head g is stored by exactly one program, split 0 of group g.
    """
    g = tl.program_id(0)
    sp = tl.program_id(1)
    REP: tl.constexpr = NH // NKV
    BF16: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.bfloat16  # tensor-core dots (else fp32 FMA dots)
    tl.static_assert(v_cache_ptr.dtype.element_ty == k_cache_ptr.dtype.element_ty)

    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    r = tl.arange(0, BLOCK_H)
    hmask = r < REP
    heads = _step_heads(g, REP, BLOCK_Q, BLOCK_H)

    # After the wait, pos and this program's inputs (the queries, key, value, norm weights) are loaded together,
    # one memory round trip before the arithmetic, not two: every program computes its group's queries and key
    # whether or not its split has rows (the splits without any exit after it).
    pdl_wait(PDL)
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr), 0), S - 1)
    # Splits with work: at least SPLIT_ROWS rows each, so a short context runs on few programs (and
    # few ticket atomics); the others exit at once. Every program derives the same count from pos.
    active = tl.maximum(tl.minimum(tl.cdiv(pos, SPLIT_ROWS), SPLITS), 1)
    xq, xqp, wq, wqp = _step_query_loads(qg_ptr, q_norm_ptr, g, d, dmask, rotary_dim, REP, BLOCK_Q, D)
    k_part = _rope_partner(d, rotary_dim)
    xk, xkp, wk, wkp = _norm_rope_loads(k_ptr + g * D + d, k_ptr + g * D + k_part, k_norm_ptr, d, dmask, rotary_dim)
    vr = tl.load(v_ptr + g * D + d, mask=dmask, other=0.0).to(tl.float32)
    cos, sin = _rope_cos_sin(pos, d, theta, rotary_dim, BLOCK_D, YARN)
    q = _step_queries(xq, xqp, wq, wqp, cos, sin, d, eps, rotary_dim, BLOCK_Q, BLOCK_H, BLOCK_D, D)
    kr = _norm_rope_apply(xk, xkp, wk, wkp, d, eps, cos, sin, rotary_dim, D)
    if sp < active:
        kr, vr = _append_row(kr, vr, k_cache_ptr, v_cache_ptr, pos, g, d, dmask, sp == 0, NKV, D, BF16)
        _attn_row(q, kr, vr, sp == 0, qg_ptr, k_cache_ptr, v_cache_ptr, part_ptr, ticket_ptr, out_ptr, pos, g, sp,
                  active, heads, hmask, d, dmask, scale, NKV, D, SPLITS, BLOCK_H, BLOCK_D, BLOCK_S, PIPE_BYTES,
                  MERGE_CH, MERGE_STAGES, MERGE_SMALL, MERGE_SMALL_STAGES, DOT_FP32, REP, BF16, BLOCK_Q)


@triton.jit
def _append_row(kr, vr, k_cache_ptr, v_cache_ptr, pos, g, d, dmask, writer, NKV: tl.constexpr, D: tl.constexpr,
                BF16: tl.constexpr):
    """Row p's key and value rounded to the cache dtype (what the reference reads back after the append), stored in
    the caches by the ``writer`` (one program a kv head); returns the rounded values."""
    if BF16:
        kr = _round_bf16(kr)
        vr = _round_bf16(vr)
    row = pos * (NKV * D) + g * D
    tl.store(k_cache_ptr + row + d, kr.to(k_cache_ptr.dtype.element_ty), mask=dmask & writer)
    tl.store(v_cache_ptr + row + d, vr.to(v_cache_ptr.dtype.element_ty), mask=dmask & writer)
    return kr, vr


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, rows, end, g, d, dmask, NKV: tl.constexpr, D: tl.constexpr,
             MASK_D: tl.constexpr):
    """The K and V rows ``rows`` of kv head g, [len(rows), BLOCK_D] in the cache dtype; rows past ``end`` (in a last
    tile) re-read row end - 1 (< p: written, finite; the caller gives them weight 0), so the copies need no row
    mask. MASK_D: BLOCK_D > D (the lanes past D read as 0)."""
    offs = (tl.minimum(rows, end - 1) * (NKV * D) + g * D)[:, None] + d[None, :]
    if MASK_D:
        kt = tl.load(k_cache_ptr + offs, mask=dmask[None, :], other=0.0)
        vt = tl.load(v_cache_ptr + offs, mask=dmask[None, :], other=0.0)
    else:
        kt = tl.load(k_cache_ptr + offs)
        vt = tl.load(v_cache_ptr + offs)
    return kt, vt


@triton.jit
def _rope_cos_sin(pos, d, theta, rotary_dim, BLOCK_D: tl.constexpr, YARN: tl.constexpr = None):
    """RoPE's cos and sin at position ``pos`` for lane d (pairs share the frequency of index d mod rotary_dim / 2)."""
    angle = pos.to(tl.float32) * _rope_inv_freq(d, theta, rotary_dim, BLOCK_D, YARN)
    return _rope_scaled(tl.cos(angle), YARN), _rope_scaled(tl.sin(angle), YARN)


@triton.jit
def _step_query_loads(qg_ptr, q_norm_ptr, g, d, dmask, rotary_dim, REP: tl.constexpr, BLOCK_Q: tl.constexpr,
                      D: tl.constexpr):
    """``_norm_rope_loads`` of kv head g's BLOCK_Q query rows (the group's REP heads, a power of two)."""
    x_ptrs = (qg_ptr + _step_heads(g, REP, BLOCK_Q, BLOCK_Q) * (2 * D))[:, None]
    return _norm_rope_loads(x_ptrs + d[None, :], x_ptrs + _rope_partner(d, rotary_dim)[None, :], q_norm_ptr, d,
                            dmask, rotary_dim)


@triton.jit
def _step_queries(x, xp, w, wp, cos, sin, d, eps, rotary_dim, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, D: tl.constexpr):
    """attn_step_kernel's queries, normed and roped from their loads (``_step_query_loads``) with the lanes' cos and
    sin: [BLOCK_H, BLOCK_D], row i holding query head g * REP + min(i mod BLOCK_Q, REP - 1) (``_step_heads``). They
    are computed as BLOCK_Q rows and repeated to fill the BLOCK_H rows of the tensor cores' tile: at the 0.8B shape
    4 rows of work, not 16."""
    q = _norm_rope_apply(x, xp, w, wp, d, eps, cos, sin, rotary_dim, D)
    if BLOCK_Q < BLOCK_H:
        q = tl.reshape(tl.broadcast_to(q[None, :, :], [BLOCK_H // BLOCK_Q, BLOCK_Q, BLOCK_D]), [BLOCK_H, BLOCK_D])
    return q


@triton.jit
def _step_heads(g, REP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr):
    """The query head of each of attn_step_kernel's BLOCK_H tile rows: row i holds g * REP + min(i mod BLOCK_Q,
    REP - 1); the first REP rows are the group's heads in order, the rest (padding, computed and never stored)
    repeat them."""
    return g * REP + tl.minimum(tl.arange(0, BLOCK_H) % BLOCK_Q, REP - 1)


@triton.jit
def _step_out(acc, l_h, qg_ptr, out_ptr, heads, hmask, d, dmask, D: tl.constexpr):
    """out[heads] = acc / l_h * sigmoid(gate) (the output gate: qg[heads, D:]), the rows of hmask stored."""
    gate = tl.load(qg_ptr + heads[:, None] * (2 * D) + D + d[None, :], mask=dmask[None, :], other=0.0)
    o = acc / l_h[:, None]
    tl.store(out_ptr + heads[:, None] * D + d[None, :], o * tl.sigmoid(gate.to(tl.float32)),
             mask=hmask[:, None] & dmask[None, :])


@triton.jit
def _first_rows(x, T: tl.constexpr, BLOCK_Q: tl.constexpr, N: tl.constexpr):
    """Rows 0 .. BLOCK_Q - 1 of x [T * BLOCK_Q, N], as [BLOCK_Q, N] (the other rows added in as zeros)."""
    first = (tl.arange(0, T) == 0)[:, None, None]
    return tl.sum(tl.where(first, tl.reshape(x, [T, BLOCK_Q, N]), 0.0), axis=0)


@triton.jit
def _attn_row(q, kr, vr, writer, qg_ptr, k_cache_ptr, v_cache_ptr, part_ptr, ticket_ptr, out_ptr, pos, g, sp, active,
              heads, hmask, d, dmask, scale, NKV: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PIPE_BYTES: tl.constexpr,
              MERGE_CH: tl.constexpr, MERGE_STAGES: tl.constexpr, MERGE_SMALL: tl.constexpr,
              MERGE_SMALL_STAGES: tl.constexpr, DOT_FP32: tl.constexpr, REP: tl.constexpr, BF16: tl.constexpr,
              BLOCK_Q: tl.constexpr):
    """attn_step_kernel's attention of one position ``pos`` for split ``sp`` of kv head g (its docstring), from
    the roped queries q [BLOCK_H, BLOCK_D] and row pos's key and value kr, vr (cache-rounded; ``writer``: this
    split seeds the softmax with them): the tiles of the split's rows < pos, then the stored output (one active
    split) or the partials and the merge. attn_rows_step_kernel runs it once per verified row."""
    # Online softmax state per head (log2 domain: q pre-scaled by scale * log2(e)): max m, sum l
    # kept per tile column (reduced after the loop), accumulator acc; split 0 starts from row p
    # (m = its score, l = 1, acc = v), the others empty (finite m: an empty split's weight is 0).
    s_off = tl.arange(0, BLOCK_S)
    qs = q * (scale * 1.4426950408889634)
    s_p = tl.sum(qs * kr[None, :], axis=1)
    m_i = tl.where(writer, s_p, -1.0e30)
    l_j = tl.where((s_off == 0)[None, :] & writer, 1.0, 0.0) + tl.zeros([BLOCK_H, BLOCK_S], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32) + tl.where(writer, vr, 0.0)[None, :]

    # This split's rows of 0..p-1, in [BLOCK_S, BLOCK_D] tiles: K/V tiles in flight as many as
    # PIPE_BYTES of shared memory hold, at most 4 (cp.async pipeline).
    chunk = tl.cdiv(tl.cdiv(pos, active), BLOCK_S) * BLOCK_S
    lo = sp * chunk
    hi = tl.minimum(lo + chunk, pos)
    ELEM_BYTES: tl.constexpr = k_cache_ptr.dtype.element_ty.primitive_bitwidth // 8
    NBUF: tl.constexpr = PIPE_BYTES // (2 * BLOCK_S * BLOCK_D * ELEM_BYTES)
    STAGES: tl.constexpr = 1 + (NBUF if NBUF < 4 else 4)
    MASK_D: tl.constexpr = BLOCK_D != D
    if BF16:
        q_hi, q_mid, q_lo = _bf16_parts(qs, DOT_FP32)
    for start in tl.range(lo, hi, BLOCK_S, num_stages=STAGES):
        rows = start + s_off
        rmask = rows < hi
        kt, vt = _kv_tile(k_cache_ptr, v_cache_ptr, rows, hi, g, d, dmask, NKV, D, MASK_D)
        if BF16:  # S = Q K^T from the exact bf16 parts of Q (three short mma chains)
            if DOT_FP32:
                kt = kt.to(tl.float32)
                vt = vt.to(tl.float32)
            ktt = tl.trans(kt)
            s = tl.dot(q_hi, ktt, input_precision="ieee") + (tl.dot(q_mid, ktt, input_precision="ieee")
                                                             + tl.dot(q_lo, ktt, input_precision="ieee"))
        else:
            s = tl.dot(qs, tl.trans(kt), input_precision="ieee")
        s = tl.where(rmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_j = l_j * alpha[:, None] + p
        acc = acc * alpha[:, None]
        if BF16:  # acc += P V from the exact bf16 parts of P, smallest first
            p_hi, p_mid, p_lo = _bf16_parts(p, DOT_FP32)
            acc = tl.dot(p_lo, vt, acc, input_precision="ieee")
            acc = tl.dot(p_mid, vt, acc, input_precision="ieee")
            acc = tl.dot(p_hi, vt, acc, input_precision="ieee")
        else:
            acc = tl.dot(p, vt, acc, input_precision="ieee")
        m_i = m_new

    if active == 1:  # one split (a short context): its own result, no partials, ticket or merge
        if BLOCK_Q < BLOCK_H:  # the first BLOCK_Q rows (the others repeat them: _step_queries), BLOCK_Q rows of work
            _step_out(_first_rows(acc, BLOCK_H // BLOCK_Q, BLOCK_Q, BLOCK_D),
                      _first_rows(tl.sum(l_j, axis=1)[:, None], BLOCK_H // BLOCK_Q, BLOCK_Q, 1).reshape([BLOCK_Q]),
                      qg_ptr, out_ptr, _step_heads(g, REP, BLOCK_Q, BLOCK_Q), tl.arange(0, BLOCK_Q) < REP, d, dmask, D)
        else:
            _step_out(acc, tl.sum(l_j, axis=1), qg_ptr, out_ptr, heads, hmask, d, dmask, D)
    else:
        _attn_merge_group(acc, m_i, l_j, qg_ptr, part_ptr, ticket_ptr, out_ptr, g, sp, active, heads, hmask, d,
                          dmask, REP, D, SPLITS, BLOCK_D, MERGE_CH, MERGE_STAGES, MERGE_SMALL, MERGE_SMALL_STAGES)


@triton.jit
def attn_rows_step_kernel(x_ptr, q_norm_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, n_prompt_ptr, part_ptr, ticket_ptr,
                          out_ptr, q, heads_unused, eps, theta, rotary_dim, scale, M: tl.constexpr, W: tl.constexpr,
                          NH: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                          SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_S: tl.constexpr, SPLIT_ROWS: tl.constexpr, PIPE_BYTES: tl.constexpr,
                          MERGE_CH: tl.constexpr, MERGE_STAGES: tl.constexpr, MERGE_SMALL: tl.constexpr,
                          MERGE_SMALL_STAGES: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr = False,
                          YARN: tl.constexpr = None):
    """``attn_rows_q_ref`` (attn_rows_q_kernel's operands; kernel ids attn_rows_step_bf16 / _f32) computed row by
    row as attn_step_kernel computes one position, so that a speculative verify's rows are the one-token step's
    bit for bit: grid [NKV, SPLITS, M], program (g, j, r) is attn_step_kernel's program (g, j) at position
    pos + r (its splits, tiles and merge, ``_attn_row``), the queries from row r of x, row pos + r's key and value
    read back from the cache (attn_rows_kv_kernel wrote them: the cache-rounded values attn_step_kernel seeds
    with), no cache write. Partials and tickets a row: part [M * NH * SPLITS, D + 2], ticket [M * NKV]. Invalid
    rows of out are written as 0 (split 0)."""
    pdl_wait(PDL)
    g = tl.program_id(0)
    sp = tl.program_id(1)
    rr = tl.program_id(2)
    REP: tl.constexpr = NH // NKV
    BF16: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.bfloat16
    pos0, valid = _chunk_rows(pos_ptr, n_prompt_ptr, M, S)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    r = tl.arange(0, BLOCK_H)
    hmask = r < REP
    heads = _step_heads(g, REP, BLOCK_Q, BLOCK_H)
    qg_ptr = x_ptr + rr * W + q
    out_row = out_ptr + rr * (NH * D)
    if rr >= valid:
        tl.store(out_row + heads[:, None] * D + d[None, :], tl.zeros([BLOCK_H, BLOCK_D], tl.float32),
                 mask=hmask[:, None] & dmask[None, :] & (sp == 0))
    else:
        pos = pos0 + rr
        active = tl.maximum(tl.minimum(tl.cdiv(pos, SPLIT_ROWS), SPLITS), 1)
        if sp < active:
            _rows_grouped(q_norm_ptr, k_cache_ptr, v_cache_ptr, part_ptr, ticket_ptr, out_row, qg_ptr, pos, g, sp, rr,
                          active, heads, hmask, d, dmask, eps, theta, rotary_dim, scale, NH, NKV, D, SPLITS,
                          BLOCK_H, BLOCK_Q, BLOCK_D, BLOCK_S, PIPE_BYTES, MERGE_CH, MERGE_STAGES, MERGE_SMALL,
                          MERGE_SMALL_STAGES, DOT_FP32, REP, BF16, YARN)


@triton.jit
def _rows_grouped(q_norm_ptr, k_cache_ptr, v_cache_ptr, part_ptr, ticket_ptr, out_row, qg_ptr, pos, g, sp, rr, active,
                  heads, hmask, d, dmask, eps, theta, rotary_dim, scale, NH: tl.constexpr, NKV: tl.constexpr,
                  D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PIPE_BYTES: tl.constexpr, MERGE_CH: tl.constexpr,
                  MERGE_STAGES: tl.constexpr, MERGE_SMALL: tl.constexpr, MERGE_SMALL_STAGES: tl.constexpr,
                  DOT_FP32: tl.constexpr, REP: tl.constexpr, BF16: tl.constexpr, YARN: tl.constexpr):
    """attn_rows_step_kernel's program (g, sp) of row rr in attn_step_kernel's grouped form (``_attn_row``)."""
    xq, xqp, wq, wqp = _step_query_loads(qg_ptr, q_norm_ptr, g, d, dmask, rotary_dim, REP, BLOCK_Q, D)
    cos, sin = _rope_cos_sin(pos, d, theta, rotary_dim, BLOCK_D, YARN)
    qr = _step_queries(xq, xqp, wq, wqp, cos, sin, d, eps, rotary_dim, BLOCK_Q, BLOCK_H, BLOCK_D, D)
    row = pos * (NKV * D) + g * D
    kr = tl.load(k_cache_ptr + row + d, mask=dmask, other=0.0).to(tl.float32)
    vr = tl.load(v_cache_ptr + row + d, mask=dmask, other=0.0).to(tl.float32)
    _attn_row(qr, kr, vr, sp == 0, qg_ptr, k_cache_ptr, v_cache_ptr, part_ptr + rr * (NH * SPLITS * (D + 2)),
              ticket_ptr + rr * NKV, out_row, pos, g, sp, active, heads, hmask, d, dmask, scale, NKV, D,
              SPLITS, BLOCK_H, BLOCK_D, BLOCK_S, PIPE_BYTES, MERGE_CH, MERGE_STAGES, MERGE_SMALL,
              MERGE_SMALL_STAGES, DOT_FP32, REP, BF16, BLOCK_Q)


def attn_rows_step_launch(rows: int, width: int, heads: int, n_kv: int, head_dim: int, max_seq: int,
                          cache_dtype: str, target) -> dict:
    """attn_rows_step_kernel's launch: attn_step_launch's split, tiles and warps at this max_seq (so each row is
    attn_step_kernel's work, compiled with or without FMA contraction as attn_step is), grid [NKV, SPLITS, rows]."""
    c = attn_step_launch(heads, n_kv, head_dim, max_seq, attn_splits(n_kv, max_seq, target), cache_dtype, target)
    return {"grid": [n_kv, c["grid"][1], rows], "num_warps": c["num_warps"], **fp_fusion(c.get("fp_fusion", True)),
            "constexprs": {"M": rows, "W": width, **c["constexprs"]}}


def attn_rows_launch(rows: int, width: int, heads: int, n_kv: int, head_dim: int, max_seq: int, cache_dtype: str,
                     target) -> tuple[str, dict]:
    """(kernel id prefix, launch) of an attn_rows_q op: attn_rows_step_kernel at up to the ``attn_rows`` rule's
    step_order_rows rows (0: never; each row as the one-token step computes it), else attn_rows_q_kernel."""
    if rows <= target.rules["attn_rows"].step_order_rows:
        return "attn_rows_step_", attn_rows_step_launch(rows, width, heads, n_kv, head_dim, max_seq, cache_dtype,
                                                        target)
    return "attn_rows_q_", attn_rows_q_launch(rows, width, heads, n_kv, head_dim, max_seq, target)


@triton.jit
def _attn_merge_group(acc, m_i, l_j, qg_ptr, part_ptr, ticket_ptr, out_ptr, g, sp, active, heads, hmask, d, dmask,
                      REP: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr,
                      MERGE_CH: tl.constexpr, MERGE_STAGES: tl.constexpr, MERGE_SMALL: tl.constexpr,
                      MERGE_SMALL_STAGES: tl.constexpr):
    """attn_step_kernel's combine over the active splits of kv head g (its docstring)."""
    # The split's partial (m, l, acc) of each real head of the group.
    prow = part_ptr + (heads * SPLITS + sp) * (D + 2)
    tl.store(prow[:, None] + d[None, :], acc, mask=hmask[:, None] & dmask[None, :])
    tl.store(prow + D, m_i, mask=hmask)
    tl.store(prow + D + 1, tl.sum(l_j, axis=1), mask=hmask)
    tl.debug_barrier()  # every thread's stores precede the ticket (released at GPU scope)
    ticket = tl.atomic_add(ticket_ptr + g, 1, sem="acq_rel", scope="gpu")
    if ticket == active - 1:  # the last active split of kv head g merges, head by head, in split order
        # the heads' sums in chunks of the active splits: few splits in small chunks with more of them in flight,
        # more in large ones (the launch rule's MERGE_* constants; bench/attn_step_probe.py)
        if MERGE_SMALL > 0 and active <= MERGE_SMALL:
            _merge_heads(part_ptr, qg_ptr, out_ptr, g, active, d, dmask, REP, D, SPLITS, BLOCK_D, MERGE_SMALL,
                         MERGE_SMALL_STAGES)
        else:
            _merge_heads(part_ptr, qg_ptr, out_ptr, g, active, d, dmask, REP, D, SPLITS, BLOCK_D, MERGE_CH,
                         MERGE_STAGES)
        tl.atomic_xchg(ticket_ptr + g, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _partials(part_ptr, h, j, active, d, dmask, D: tl.constexpr, SPLITS: tl.constexpr):
    """Head h's partials (m, l, acc) of splits j (those >= active masked: m -1e30, l and acc 0), read past L1."""
    jm = j < active
    rows_p = part_ptr + (h * SPLITS + j) * (D + 2)
    m_c = tl.load(rows_p + D, mask=jm, other=-1.0e30, cache_modifier=".cg")
    l_c = tl.load(rows_p + D + 1, mask=jm, other=0.0, cache_modifier=".cg")
    acc_c = tl.load(rows_p[:, None] + d[None, :], mask=jm[:, None] & dmask[None, :], other=0.0, cache_modifier=".cg")
    return m_c, l_c, acc_c


@triton.jit
def _merge_heads(part_ptr, qg_ptr, out_ptr, g, active, d, dmask, REP: tl.constexpr, D: tl.constexpr,
                 SPLITS: tl.constexpr, BLOCK_D: tl.constexpr, CH: tl.constexpr, STAGES: tl.constexpr):
    """The combine's sums for the REP heads of kv head g: one flat loop over (head, chunk of CH active splits),
    STAGES iterations' partials in flight, the chunks in split order and each chunk's rows summed as one tile,
    rescaled to the running max as a chunk raises it (one chunk: sum_j acc_j 2^(m_j - m) / sum_j l_j 2^(m_j - m),
    m the max of the m_j); the gated output stored after a head's last chunk."""
    jc = tl.arange(0, CH)
    if CH >= SPLITS:  # one chunk a head, whatever the active splits: a loop over the heads alone
        for i in tl.range(0, REP, num_stages=STAGES):
            h = g * REP + i
            m_c, l_c, acc_c = _partials(part_ptr, h, jc, active, d, dmask, D, SPLITS)
            m = tl.max(m_c, axis=0)  # finite: split 0 holds row p
            w = tl.exp2(m_c - m)
            o = tl.sum(acc_c * w[:, None], axis=0) / tl.sum(l_c * w, axis=0)
            gate = tl.load(qg_ptr + h * 2 * D + D + d, mask=dmask, other=0.0).to(tl.float32)
            tl.store(out_ptr + h * D + d, o * tl.sigmoid(gate), mask=dmask)
        return
    chunks = tl.cdiv(active, CH)
    num = tl.zeros([BLOCK_D], tl.float32)
    den = 0.0
    m_run = -1.0e30
    for t in tl.range(0, REP * chunks, num_stages=STAGES):
        i = t // chunks
        c = t - i * chunks
        h = g * REP + i
        m_c, l_c, acc_c = _partials(part_ptr, h, c * CH + jc, active, d, dmask, D, SPLITS)
        gate = tl.load(qg_ptr + h * 2 * D + D + d, mask=dmask, other=0.0).to(tl.float32)
        first = c == 0
        m_new = tl.maximum(tl.where(first, -1.0e30, m_run), tl.max(m_c, axis=0))  # finite: split 0 holds row p
        alpha = tl.where(first, 0.0, tl.exp2(m_run - m_new))
        w = tl.exp2(m_c - m_new)
        num = num * alpha + tl.sum(acc_c * w[:, None], axis=0)
        den = den * alpha + tl.sum(l_c * w, axis=0)
        m_run = m_new
        tl.store(out_ptr + h * D + d, num / den * tl.sigmoid(gate), mask=dmask & (c == chunks - 1))


@triton.jit
def _chunk_rows(pos_ptr, n_prompt_ptr, M: tl.constexpr, S: tl.constexpr):
    """(pos, valid rows) of a chunk: pos = max(*pos_ptr, 0); rows r < clamp(n_prompt - pos, 0, M) are
    valid, and rows at positions >= S are treated as invalid (nothing outside the cache is touched)."""
    pos = tl.maximum(tl.load(pos_ptr), 0)
    n = tl.minimum(tl.minimum(tl.load(n_prompt_ptr) - pos, S - pos), M)
    return pos, tl.maximum(n, 0)


@triton.jit
def attn_rows_kv_kernel(x_ptr, k_norm_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, n_prompt_ptr, k, v, eps, theta,
                        rotary_dim, M: tl.constexpr, W: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
                        S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
                        YARN: tl.constexpr = None):
    """The chunk's K/V rows (``attn_rows_kv_ref``), kernel ids attn_rows_kv_bf16 / attn_rows_kv_f32.

    x is the fp32 projection rows [M, W] (keys at columns k + g * D, values at v + g * D). For valid
    row r (r < clamp(n_prompt - pos, 0, M), position pos + r < S) and kv head g:
      k_cache[pos + r, g] = rope(rmsnorm(x[r, k + g*D ..]) * (1 + k_norm)) at pos + r,
      v_cache[pos + r, g] = x[r, v + g*D ..],
    stored in the cache dtype (rounded to nearest even). The norm and rotation are the one-token
    kernel's own helpers (_rope_inv_freq, _norm_rope), so a row's k is rounded exactly as
    attn_step_kernel rounds it at that position. Invalid rows write nothing. Offsets are int32:
    M * W and S * NKV * D < 2^31.

    Work split: grid [M, NKV], program (r, g) for one row and kv head, lane d of a [BLOCK_D] vector
    holding element d. Race-free and deterministic: each program writes its own cache row slot
    (pos + r, g) and nothing else, and reads only x and k_norm, which no program writes.
    """
    pdl_wait(PDL)
    r = tl.program_id(0)
    g = tl.program_id(1)
    pos, n_valid = _chunk_rows(pos_ptr, n_prompt_ptr, M, S)
    if r < n_valid:
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        angle = (pos + r).to(tl.float32) * _rope_inv_freq(d, theta, rotary_dim, BLOCK_D, YARN)
        src = x_ptr + r * W
        kr = _norm_rope(src + k + g * D, k_norm_ptr, d, dmask, eps, _rope_scaled(tl.cos(angle), YARN),
                        _rope_scaled(tl.sin(angle), YARN), rotary_dim, D)
        vr = tl.load(src + v + g * D + d, mask=dmask, other=0.0)
        if k_cache_ptr.dtype.element_ty == tl.bfloat16:
            kr = _round_bf16(kr)
        if v_cache_ptr.dtype.element_ty == tl.bfloat16:
            vr = _round_bf16(vr)
        row = (pos + r) * (NKV * D) + g * D
        tl.store(k_cache_ptr + row + d, kr.to(k_cache_ptr.dtype.element_ty), mask=dmask)
        tl.store(v_cache_ptr + row + d, vr.to(v_cache_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _norm_rope_rows(x_ptrs, w_ptr, d, dmask, eps, cos, sin, rotary_dim, D: tl.constexpr):
    """``_norm_rope`` on a tile: row i is the head at x_ptrs[i] (lane d holding element d), cos/sin
    [rows, BLOCK_D] or [BLOCK_D]; the same arithmetic per row, the partner lanes re-loaded from the input."""
    partner = _rope_partner(d, rotary_dim)
    x, xp, w, wp = _norm_rope_loads(x_ptrs[:, None] + d[None, :], x_ptrs[:, None] + partner[None, :], w_ptr, d,
                                    dmask, rotary_dim)
    return _norm_rope_apply(x, xp, w, wp, d, eps, cos, sin, rotary_dim, D)


@triton.jit
def _bf16_operand(x, ROUND: tl.constexpr):
    """x as a bf16 dot operand, rounded to nearest even: the GPU's conversion does that itself; ROUND
    (interpreter tests, with DOT_FP32) rounds explicitly, since Triton's interpreter truncates."""
    if x.dtype != tl.bfloat16:
        if ROUND:
            x = _round_bf16(x.to(tl.float32))
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def _attn_rows_tile(q_tile, k_cache_ptr, v_cache_ptr, offs, kmask, causal, m_i, l_i, acc,
                    DOT_FP32: tl.constexpr, MASK_LOADS: tl.constexpr, CAUSAL: tl.constexpr):
    """One K/V tile (cache offsets offs [BLOCK_N, BLOCK_D]) into the online softmax (log2 domain):
    S = Q K^T, the causal mask where CAUSAL, P = exp2(S - m), acc = acc * alpha + P V."""
    if MASK_LOADS:
        kt = tl.load(k_cache_ptr + offs, mask=kmask, other=0.0)
        vt = tl.load(v_cache_ptr + offs, mask=kmask, other=0.0)
    else:
        kt = tl.load(k_cache_ptr + offs)
        vt = tl.load(v_cache_ptr + offs)
    kb = _bf16_operand(kt, DOT_FP32)
    vb = _bf16_operand(vt, DOT_FP32)
    if DOT_FP32:
        s = tl.dot(q_tile.to(tl.float32), tl.trans(kb.to(tl.float32)))
    else:
        s = tl.dot(q_tile, tl.trans(kb))
    if CAUSAL:
        s = tl.where(causal, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    pb = _bf16_operand(p, DOT_FP32)
    if DOT_FP32:
        acc = tl.dot(pb.to(tl.float32), vb.to(tl.float32), acc * alpha[:, None])
    else:
        acc = tl.dot(pb, vb, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def attn_rows_q_kernel(x_ptr, q_norm_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, n_prompt_ptr, part_ptr, ticket_ptr,
                       out_ptr, q, heads, eps, theta, rotary_dim, scale, M: tl.constexpr, W: tl.constexpr,
                       NKV: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SPLIT_ROWS: tl.constexpr,
                       PIPE_BYTES: tl.constexpr, DOT_FP32: tl.constexpr, PDL: tl.constexpr = False,
                       YARN: tl.constexpr = None):
    """The chunk's gated attention (``attn_rows_q_ref``), after attn_rows_kv_kernel on the same stream;
    kernel ids attn_rows_q_bf16 / attn_rows_q_f32.

    For valid row r (r < clamp(n_prompt - pos, 0, M), position p = pos + r < S) and query head h of
    kv head g = h // (heads / NKV), with q|gate at columns q + h * 2D of x [M, W]:
      q = rope(rmsnorm(x[r, q + h*2D ..][:D]) * (1 + q_norm)) at p,
      out[r, h*D ..] = softmax(q . K[0..p, g]^T * scale) V[0..p, g] * sigmoid(x[r, q + h*2D + D ..][:D]);
    invalid rows of out are written as 0. RoPE angles as in attn_step_kernel (_rope_inv_freq).

    Work split (flash attention): grid [NKV, ceil(M * REP / BLOCK_R), SPLITS], REP = heads / NKV.
    Programs (g, b, *) own tile rows t = b' * BLOCK_R + i, i < BLOCK_R, with b' = (blocks - 1 - b) (the
    blocks with the longest causal range start first), of kv head g's (row, head) pairs in row-major
    order: row t // REP, query head g * REP + t % REP. So the REP query heads of a GQA group and about
    BLOCK_R / REP chunk rows share one [BLOCK_R, BLOCK_D] query tile, and a program reads each K/V
    tile once for all of them. The tile's cache rows 0 .. kv_end - 1 (kv_end = pos + its last valid
    row + 1) are split over the sequence (flash-decoding, as attn_step_kernel; few programs otherwise
    at a verify's few rows): A = clamp(ceil(kv_end / SPLIT_ROWS), 1, SPLITS) splits work, split j < A
    taking rows [j * C, min((j + 1) * C, kv_end)) with C = ceil(ceil(kv_end / A) / BLOCK_N) * BLOCK_N,
    all fixed by pos and n_prompt alone; splits j >= A return at once. A split walks its rows in
    BLOCK_N-row tiles [BLOCK_N, BLOCK_D] (software-pipelined through shared memory where Triton can:
    up to 3 K/V tile pairs in flight, as many as PIPE_BYTES holds for the cache's element size): first
    the tiles every tile row sees whole (rows <= pos + its first row: no mask), then the rest with the
    causal mask key <= pos + row. Per tile: S = Q K^T and acc += P V on tensor cores, bf16 operands and
    fp32 accumulation, online softmax in fp32 (exp2, q pre-scaled by scale * log2(e); the running sum l
    adds the fp32 weights). With A = 1 the program divides, applies sigmoid(gate) and stores its tile
    rows. Otherwise it stores its partial (acc, m, l per tile row) in part_ptr (row ((tile group *
    SPLITS) + j) * BLOCK_R + i, D + 2 floats; tile group = g * blocks + b) and takes the tile group's
    ticket; the last of the A splits to arrive merges the A partials in split order (m = max m_j,
    o = sum_j acc_j 2^(m_j - m) / sum_j l_j 2^(m_j - m)), gates, stores, and zeroes the ticket for the
    next launch.

    Numerics vs the fp32 reference: the dots' bf16 operands are the only roundings beyond fp32
    summation order: q * scale * log2(e) and the weights p are rounded to bf16 (unit roundoff
    u = 2^-9), and K and V too where the caches are fp32 (bf16 caches hold them exactly). So each score
    of row r, head h moves by at most Δ = n * u * scale * max_j sum_i |q_i k_ji| (n = 1 rounded operand,
    2 with fp32 caches), each softmax weight w_j by at most a factor e^{±2Δ}, and the bf16 weights (and
    fp32-cache V) add u * sum_j w_j |v_j| each (l sums the unrounded weights):
      |o - o_ref| <= ((e^{2Δ} - 1) * max_j |v_j| + n * u * sum_j w_j |v_j|) * sigmoid(gate)
    per element, at most ~(2Δ + n * u) * max|v|. The roundings are of random sign, so the error seen is
    far below that bound: ~2u (bf16 caches) and ~3u (fp32) of max|out| in the interpreter tests
    (tests/test_kernels_attn_rows.py checks both).

    Race-free and deterministic: every out element is written by exactly one program (the merging one
    where A > 1); the caches, x and q_norm are only read (the chunk's K/V rows were written by the kv
    kernel before this launch); a split's partial rows are its own, written before its ticket (released
    at GPU scope, acquired by the merger, read past L1); each split's loop order and the merge order are
    fixed by pos and n_prompt alone, so runs repeat bit for bit whichever split merges. The merge adds
    fp32 roundings only (the bound below holds with fp32 summation in any order). Offsets are int32:
    M * W, M * heads * D, S * NKV * D and the partials' size < 2^31.
    """
    pdl_wait(PDL)
    g = tl.program_id(0)
    b = tl.num_programs(1) - 1 - tl.program_id(1)
    sp = tl.program_id(2)
    rep = heads // NKV
    pos, n_valid = _chunk_rows(pos_ptr, n_prompt_ptr, M, S)

    # Cache rows this tile reads: 0 .. kv_end - 1; every tile below full_end is seen whole by all its rows.
    row_lo = (b * BLOCK_R) // rep
    row_hi = tl.minimum((b * BLOCK_R + BLOCK_R - 1) // rep, n_valid - 1)
    kv_end = tl.where(row_lo < n_valid, pos + row_hi + 1, 0)
    full_end = tl.minimum(((pos + row_lo + 1) // BLOCK_N) * BLOCK_N, kv_end)
    if SPLITS == 1:
        active = 1
        lo = 0
        hi = kv_end
    else:  # this split's rows [lo, hi) (the docstring's A, C)
        active = tl.minimum(tl.maximum(tl.cdiv(kv_end, SPLIT_ROWS), 1), SPLITS)
        chunk = tl.cdiv(tl.cdiv(kv_end, active), BLOCK_N) * BLOCK_N
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, kv_end)
    if sp < active:
        t = b * BLOCK_R + tl.arange(0, BLOCK_R)
        row = t // rep
        head = g * rep + t % rep
        live = row < n_valid
        row_c = tl.minimum(row, M - 1)  # clamped for the loads (tile rows past M * rep are never stored)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        MASK_D: tl.constexpr = BLOCK_D != D

        # The query tile: rmsnorm, RoPE at pos + row, pre-scaled for exp2, rounded to bf16 once.
        src = x_ptr + row_c * W + q + head * (2 * D)
        qpos = pos + row
        angle = qpos.to(tl.float32)[:, None] * _rope_inv_freq(d, theta, rotary_dim, BLOCK_D, YARN)[None, :]
        qn = _norm_rope_rows(src, q_norm_ptr, d, dmask, eps, _rope_scaled(tl.cos(angle), YARN),
                             _rope_scaled(tl.sin(angle), YARN), rotary_dim, D)
        q_tile = _bf16_operand(qn * (scale * 1.4426950408889634), DOT_FP32)

        m_i = tl.full([BLOCK_R], -1.0e30, tl.float32)  # finite: a fully masked tile gives weights exp2(-inf) = 0
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        n_off = tl.arange(0, BLOCK_N)
        head_off = g * D + d
        ELEM_BYTES: tl.constexpr = k_cache_ptr.dtype.element_ty.primitive_bitwidth // 8
        NBUF: tl.constexpr = PIPE_BYTES // (2 * BLOCK_N * BLOCK_D * ELEM_BYTES)
        STAGES: tl.constexpr = 1 + (NBUF if NBUF < 3 else 3)
        for start in tl.range(lo, tl.minimum(hi, full_end), BLOCK_N, num_stages=STAGES):
            keys = start + n_off
            offs = (keys * (NKV * D))[:, None] + head_off[None, :]
            m_i, l_i, acc = _attn_rows_tile(q_tile, k_cache_ptr, v_cache_ptr, offs, dmask[None, :], None, m_i,
                                            l_i, acc, DOT_FP32, MASK_D, False)
        for start in tl.range(tl.maximum(lo, full_end), hi, BLOCK_N, num_stages=STAGES):
            keys = start + n_off
            offs = (keys * (NKV * D))[:, None] + head_off[None, :]
            kmask = (keys < hi)[:, None] & dmask[None, :]
            causal = keys[None, :] <= qpos[:, None]
            m_i, l_i, acc = _attn_rows_tile(q_tile, k_cache_ptr, v_cache_ptr, offs, kmask, causal, m_i, l_i, acc,
                                            DOT_FP32, True, True)

        dst = out_ptr + (row * heads + head) * D
        smask = (t < M * rep)[:, None] & dmask[None, :]
        if active == 1:
            gate = tl.load(src[:, None] + D + d[None, :], mask=dmask[None, :], other=0.0)
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * tl.sigmoid(gate)
            tl.store(dst[:, None] + d[None, :], tl.where(live[:, None], o, 0.0), mask=smask)
        else:
            grp = g * tl.num_programs(1) + tl.program_id(1)
            i = tl.arange(0, BLOCK_R)
            prow = part_ptr + ((grp * SPLITS + sp) * BLOCK_R + i) * (D + 2)
            tl.store(prow[:, None] + d[None, :], acc, mask=dmask[None, :])
            tl.store(prow + D, m_i)
            tl.store(prow + D + 1, l_i)
            tl.debug_barrier()  # every thread's stores precede the ticket (released at GPU scope)
            ticket = tl.atomic_add(ticket_ptr + grp, 1, sem="acq_rel", scope="gpu")
            if ticket == active - 1:  # the last split merges the tile group's partials in split order
                m = tl.full([BLOCK_R], -1.0e30, tl.float32)
                for j in range(0, active):
                    m = tl.maximum(m, tl.load(part_ptr + ((grp * SPLITS + j) * BLOCK_R + i) * (D + 2) + D,
                                              cache_modifier=".cg"))
                o = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
                l = tl.zeros([BLOCK_R], tl.float32)
                for j in range(0, active):
                    pj = part_ptr + ((grp * SPLITS + j) * BLOCK_R + i) * (D + 2)
                    w = tl.exp2(tl.load(pj + D, cache_modifier=".cg") - m)
                    l += tl.load(pj + D + 1, cache_modifier=".cg") * w
                    o += tl.load(pj[:, None] + d[None, :], mask=dmask[None, :], other=0.0,
                                 cache_modifier=".cg") * w[:, None]
                gate = tl.load(src[:, None] + D + d[None, :], mask=dmask[None, :], other=0.0)
                o = o / tl.where(l > 0, l, 1.0)[:, None] * tl.sigmoid(gate)
                tl.store(dst[:, None] + d[None, :], tl.where(live[:, None], o, 0.0), mask=smask)
                tl.atomic_xchg(ticket_ptr + grp, 0, sem="relaxed", scope="gpu")  # ready for the next launch
