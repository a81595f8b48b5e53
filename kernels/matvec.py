"""Matrix-vector product y = W @ x (W stored [out, in], as checkpoints store nn.Linear), fp32 accumulate."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.targets import pow2_at_least


def matvec_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """W @ x for one row x [K]; for M rows x [M, K] each row's product the same way (the M-row step
    computes row for row what the one-token step computes: the CPU reference keeps that exact)."""
    if x.dim() == 2:
        return torch.stack([torch.mv(w.float(), row) for row in x.float()])
    return torch.mv(w.float(), x.float())


# --- q4: weight-only int4, one f16 scale per group of G inputs (G = 32, 64 or 128) ---------------
#
# Layout of a q4 weight W [N, K] as one byte buffer (the contract with the GPU matvec kernels):
#   nibbles: N rows of K/2 bytes, row-major; byte j of a row holds input 2j in its low nibble and
#            2j+1 in its high nibble, so 16 bytes hold 32 consecutive inputs of one row: a warp
#            reading a row with 16-byte loads is perfectly coalesced, and a group of 128 is 4 loads;
#   scales:  then N rows of K/G float16 scales, row-major.
# Quantisation per group: the scale d is chosen to minimise the group's squared error. Candidates
# d = m / c, m the value of largest magnitude and c in [-9, -7] (c = -8 is llama.cpp's Q4_0 rule), each
# with q = clamp(round(w / d) + 8, 0, 15); the best is then refitted by least squares for its q
# (d = sum(w (q-8)) / sum((q-8)^2)). Dequantised w' = (q - 8) * d, d stored as float16.

Q4_SCALE_CANDIDATES = [-9.0 + 0.2 * i for i in range(11)]


def q4_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q uint8 [N, K] in 0..15, scales float16 [N, K/G])."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    m = torch.gather(g, -1, g.abs().argmax(dim=-1, keepdim=True))
    best_q, best_err = None, None
    for c in Q4_SCALE_CANDIDATES:
        d = m / c
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = torch.clamp(torch.round(g * inv) + 8, 0, 15)
        err = ((q - 8) * d - g).pow(2).sum(-1, keepdim=True)
        if best_q is None:
            best_q, best_err = q, err
        else:
            better = err < best_err
            best_q, best_err = torch.where(better, q, best_q), torch.minimum(err, best_err)
    qs = best_q - 8
    den = qs.pow(2).sum(-1, keepdim=True)
    d = torch.where(den > 0, (g * qs).sum(-1, keepdim=True) / den.clamp_min(1), torch.zeros_like(den))
    return best_q.to(torch.uint8).reshape(n, k), d.to(torch.float16).reshape(n, k // group)


def q4_pack(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K] float -> the q4 byte buffer described above (uint8, 1-D)."""
    q, scales = q4_quantize(w, group)
    nib = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return torch.cat([nib.reshape(-1), scales.contiguous().view(torch.uint8).reshape(-1)])


def q4_unpack(buf: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
    """The q4 byte buffer -> dequantised float32 [N, K]."""
    nib = buf[: n * k // 2].reshape(n, k // 2)
    scales = buf[n * k // 2:].contiguous().view(torch.float16).reshape(n, k // group).float()
    q = torch.stack([nib & 0xF, nib >> 4], dim=-1).reshape(n, k).float()
    return ((q - 8.0).reshape(n, k // group, group) * scales[:, :, None]).reshape(n, k)


def matvec_swiglu_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """silu(Wg @ x) * (Wu @ x): the MLP's gate and up projections with their epilogue."""
    return torch.nn.functional.silu(matvec_ref(x, w_gate)) * matvec_ref(x, w_up)


# --- launch rules ------------------------------------------------------------------------------


def matvec_launch(n: int, k: int, group: int, target) -> dict:
    """Constants: ``target.rules["matvec"]`` (kernels/targets.py; the sm_90 values in brackets).
    Rows per CTA (BLOCK_N, at most [16]) chosen so the grid has at least [4] CTAs per SM when there are
    enough rows (down_proj's 5120 rows: 640 CTAs of 8 rows on sm_90; lm_head: 15520 of 16). bf16 / f32:
    one warp per [4] rows, BLOCK_K [512] (at most the power of two >= K), halved while it does not
    divide K, down to [128]: a masked tail iteration remains only for odd K. Below small_matrix_bytes
    ([32 MiB] of bf16: the 0.8B-2B projections) BLOCK_K up to [2048], at most [4096] / BLOCK_K rows per
    CTA, [4] warps. q4: at least [4] rows per CTA, BLOCK_K = [16384] / BLOCK_N up to [2048] (8 KB of
    nibbles per tile), at most [2] warps, a masked tail tile where BLOCK_K does not divide K. The sm_90
    values were measured on the H200 over 47-69 configurations per shape at the 0.8B, 4B and 27B shapes
    (the row's provenance: bench/results/tuning/): the rule's pick is within 1.13x of the best
    configuration at every measured shape but one (bf16 4B in_proj: 1.05x kept over 1.13x), 1.1-1.7x
    faster than the previous rule where it changed.
    GROUP is the q4 group (0: not q4); BLOCK_K is a multiple of it."""

    r = target.rules["matvec"]
    block_n = 1
    while block_n < r.max_block_n and (n + 2 * block_n - 1) // (2 * block_n) >= r.ctas_per_sm * target.sms:
        block_n *= 2
    # q4: tiles of 8 KB of nibbles (16 x 1024, 8 x 2048) and at most 2 warps, so each thread keeps
    # several rows' 16-byte chunks in flight; at the 27B shapes this is the fastest configuration of
    # the 47 measured (bench/results/tuning/q4-sweep-h200.json), 1.1-1.6x the 4-warp 4 KB tiles
    if group:  # a K that BLOCK_K does not divide ends with one masked tile (down_proj: 8 x 2048 measured best)
        block_n = max(block_n, r.q4_min_block_n)
        block_k = max(group, min(r.q4_tile_nibbles // block_n, r.q4_max_block_k, pow2_at_least(k)))
        num_warps = max(1, min(r.q4_max_warps, block_n * block_k // r.q4_nibbles_per_warp))
    elif n * k * 2 < r.small_matrix_bytes:  # latency-bound: few rows per CTA, long K tiles, 4 warps
        block_k = min(r.small_max_block_k, pow2_at_least(k))
        block_n = max(1, min(block_n, r.small_tile_elems // block_k))
        num_warps = max(1, min(r.small_max_warps, block_n * block_k // r.small_elems_per_warp))
    else:
        block_k = min(r.block_k, pow2_at_least(k))
        while block_k > r.min_block_k and block_k <= k and k % block_k:
            block_k //= 2
        num_warps = max(1, min(r.max_warps, block_n // r.rows_per_warp))
    return {"grid": [(n + block_n - 1) // block_n, 1, 1], "num_warps": num_warps,
            "constexprs": {"N": n, "K": k, "GROUP": group, "BLOCK_N": block_n, "BLOCK_K": block_k}}


# --- Triton kernels ----------------------------------------------------------------------------
#
# Work split (both kernels): program p computes rows [p*BLOCK_N, (p+1)*BLOCK_N) (rows past N are
# clamped to N-1 for the loads and masked at the store, so no load needs a row mask), streaming the
# weight in [BLOCK_N, BLOCK_K] tiles along K with 16-byte loads (8 bf16, 4 f32 or 32 q4 nibbles per
# thread per row and load) and a software pipeline of 2-3 stages (cp.async into shared memory on the
# GPU). Each thread keeps one fp32 partial sum per row and 16-byte chunk it owns; chunks are reduced
# only after the K loop (no cross-thread reduction inside the loop). K tiles past a multiple of
# BLOCK_K run once more, masked, after the loop. Deterministic: a fixed reduction order, no atomics.
#
# q4 dequantisation without int->float conversions (they run at 1/4 to 1/8 of the FMA rate): the
# nibble buffer is read as little-endian 32-bit words, word j of a row holding inputs 8j..8j+7 in
# nibbles 0..7. For nibble i, let p = i % 4 and h = the word's low (i < 4) or high 16 bits; then
# ((h | M) & ((15 << 4p) | M)) with M = 0x4B000000 (2**23 as fp32 bits) is the fp32 2**23 + q * 16**p
# (exact), and subtracting 2**23 + 8 * 16**p gives (q - 8) * 16**p exactly. x is pre-scaled by
# 16**-p (exact: a power of two), so each input costs one AND, one FADD and one FFMA. The 32 inputs
# of a 16-byte load all lie in one group (GROUP >= 32), so their partial sum is multiplied by the
# group's scale once.

@triton.jit
def _q4_nibble_plane(lo, hi, I: tl.constexpr):
    """Nibble I (input 8j+I) of every word j, as fp32 (q - 8) * 16**(I % 4) exactly. ``lo`` / ``hi``:
    the words (resp. the words >> 16) OR-ed with the magic, computed once for all eight nibbles."""
    P: tl.constexpr = I % 4
    if I < 4:
        bits = lo & ((15 << (4 * P)) | 0x4B000000)
    else:
        bits = hi & ((15 << (4 * P)) | 0x4B000000)
    return bits.to(tl.float32, bitcast=True) - (8388608.0 + 8.0 * (16 ** P))


@triton.jit
def _matvec_tile(x_ptr, w_ptr, rows, k0, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, MASKED: tl.constexpr):
    """Partial products of rows ``rows`` (clamped, in bounds) with inputs [k0, k0 + BLOCK_K): fp32
    [BLOCK_N, BLOCK_K / CHUNK], one sum per CHUNK inputs, a thread's 16-byte load (32 inputs for q4,
    8 bf16, 4 f32). MASKED: the tile runs past K (inputs >= K contribute 0)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if MASKED:
        xv = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
    else:
        xv = tl.load(x_ptr + ks)
    if GROUP > 0:
        # nibbles as 32-bit words: [BLOCK_N, BLOCK_K / 8], word j = inputs 8j..8j+7
        j = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        wp = w_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * (K // 8) + j[None, :]
        if MASKED:
            words = tl.load(wp, mask=(j < K // 8)[None, :], other=0)
        else:
            words = tl.load(wp)
        lo = words | 0x4B000000  # fp32 bits of 2**23 (see the comment above _q4_nibble_plane)
        hi = (words >> 16) | 0x4B000000
        # interleave the eight planes back into input order, all within a thread: after the joins
        # the trailing dims (a, b, c) hold nibble 4a + 2b + c of each word
        a0 = tl.join(_q4_nibble_plane(lo, hi, 0), _q4_nibble_plane(lo, hi, 4))
        a1 = tl.join(_q4_nibble_plane(lo, hi, 2), _q4_nibble_plane(lo, hi, 6))
        a2 = tl.join(_q4_nibble_plane(lo, hi, 1), _q4_nibble_plane(lo, hi, 5))
        a3 = tl.join(_q4_nibble_plane(lo, hi, 3), _q4_nibble_plane(lo, hi, 7))
        q = tl.reshape(tl.join(tl.join(a0, a1), tl.join(a2, a3)), [BLOCK_N, BLOCK_K // 32, 32])
        # x * 16**-(k % 4) (k0 is a multiple of 32), the power of two built from its exponent bits
        p4 = ((127 - 4 * (tl.arange(0, 32) % 4)) << 23).to(tl.float32, bitcast=True)
        xs = tl.reshape(xv, [BLOCK_K // 32, 32]) * p4[None, :]
        part = tl.sum(q * xs[None, :, :], axis=2)
        # one f16 scale per 32-input chunk (CHUNK = 32; chunk c lies in group 32c / GROUP)
        c = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        sp = (w_ptr + N * K // 2).to(tl.pointer_type(tl.float16)) + rows.to(tl.int64)[:, None] * (K // GROUP)
        if MASKED:
            scale = tl.load(sp + (c * 32 // GROUP)[None, :], mask=(c < K // 32)[None, :], other=0.0)
        else:
            scale = tl.load(sp + (c * 32 // GROUP)[None, :])
        return part * scale.to(tl.float32)
    else:
        wp = w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
        if MASKED:
            w = tl.load(wp, mask=(ks < K)[None, :], other=0.0)
        else:
            w = tl.load(wp)
        prod = w.to(tl.float32) * xv[None, :]
        return tl.sum(tl.reshape(prod, [BLOCK_N, BLOCK_K // CHUNK, CHUNK]), axis=2)


@triton.jit
def _matvec_rows(x_ptr, w_ptr, rows, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k W[rows, k] * x[k] in fp32 for one weight (f32, bf16 or q4 when GROUP > 0): [BLOCK_N].
    ``rows`` must be in bounds (the callers clamp them)."""
    tl.static_assert(GROUP == 0 or (GROUP % 32 == 0 and BLOCK_K % GROUP == 0 and K % GROUP == 0))
    if GROUP > 0:
        CHUNK: tl.constexpr = 32
        TILE_BYTES: tl.constexpr = BLOCK_N * BLOCK_K // 2
    else:
        BITS: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth
        if BLOCK_K >= 128 // BITS:
            CHUNK: tl.constexpr = 128 // BITS  # elements per 16 bytes
        else:
            CHUNK: tl.constexpr = BLOCK_K  # a tiny K
        TILE_BYTES: tl.constexpr = BLOCK_N * BLOCK_K * BITS // 8
    # pipeline depth: 3 stages of tiles up to 16 KB (q4, bf16 at the launch rule's blocks), else 2
    STAGES: tl.constexpr = 3 if TILE_BYTES <= 16384 else 2
    K_FULL: tl.constexpr = K - K % BLOCK_K
    acc = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], tl.float32)
    for k0 in tl.range(0, K_FULL, BLOCK_K, num_stages=STAGES):
        acc += _matvec_tile(x_ptr, w_ptr, rows, k0, N, K, GROUP, BLOCK_N, BLOCK_K, CHUNK, False)
    if K_FULL < K:
        acc += _matvec_tile(x_ptr, w_ptr, rows, K_FULL, N, K, GROUP, BLOCK_N, BLOCK_K, CHUNK, True)
    return tl.sum(acc, axis=1)


@triton.jit
def matvec_kernel(x_ptr, w_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] = sum_k W[n, k] * x[k] (fp32 accumulation). W [N, K] row-major: fp32 or bf16 (by the
    pointer type), or the q4 byte buffer described above when GROUP > 0. Grid: ceil(N / BLOCK_N)
    programs of BLOCK_N rows each, each looping over K in BLOCK_K tiles."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    y = _matvec_rows(x_ptr, w_ptr, tl.minimum(rows, N - 1), N, K, GROUP, BLOCK_N, BLOCK_K)
    tl.store(y_ptr + rows, y, mask=rows < N)


@triton.jit
def matvec_swiglu_kernel(x_ptr, wg_ptr, wu_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y = silu(Wg @ x) * (Wu @ x) for two weights of one dtype and shape [N, K] (as matvec_kernel);
    the same split: each program computes BLOCK_N rows of both products, gate then up."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, N - 1)
    g = _matvec_rows(x_ptr, wg_ptr, rows_in, N, K, GROUP, BLOCK_N, BLOCK_K)
    u = _matvec_rows(x_ptr, wu_ptr, rows_in, N, K, GROUP, BLOCK_N, BLOCK_K)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + rows, y, mask=rows < N)
