"""Matrix-vector product y = W @ x (W stored [out, in], as checkpoints store nn.Linear), fp32 accumulate."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kestrel.kernels.pdl import pdl_launch, pdl_wait
from kestrel.kernels.rmsnorm import rmsnorm_ref
from kestrel.kernels.targets import fp_fusion, pow2_at_least


def matvec_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """W @ x for one row x [K]; for M rows x [M, K] each row's product the same way (the M-row step
    computes row for row what the one-token step computes: the CPU reference keeps that exact). A q4
    weight (``q4_unpack``'s, carrying ``q4``) takes the q4 product ``q4_matvec_ref``."""
    if x.dim() == 2:
        return torch.stack([matvec_ref(row, w) for row in x])
    if getattr(w, "q4", None) is not None:
        return q4_matvec_ref(x, *w.q4)
    return torch.mv(w.float(), x.float())


# --- q4: weight-only int4, one f16 scale per group of G inputs (G = 32, 64 or 128) ---------------
#
# Layout of a q4 weight W [N, K] as one byte buffer (the contract with the GPU kernels):
#   nibbles: N rows of K/8 little-endian 32-bit words, row-major; word j of a row holds inputs
#            8j..8j+7, input 8j+i at nibble Q4_NIBBLE[i] = [0, 4, 1, 5, 2, 6, 3, 7][i]: the even inputs
#            in the low 16 bits, the odd ones in the high 16 bits, so masking a word with 0x000F000F
#            (or 0x00F000F0, or the same after a shift by 8) gives two consecutive inputs, one per 16-bit
#            half: OR-ed with 0x6400 (fp16 1024) they are an f16x2 of 1024 + q (Marlin's conversion:
#            one LOP3 for two weights). 16 bytes hold 32 consecutive inputs of one row;
#   scales:  then N rows of K/G float16 scales, row-major.
# Quantisation per group: the scale d is chosen to minimise the group's squared error. Candidates
# d = m / c, m the value of largest magnitude and c in [-9, -7] (c = -8 is llama.cpp's Q4_0 rule), each
# with q = clamp(round(w / d) + 8, 0, 15); the best is then refitted by least squares for its q
# (d = sum(w (q-8)) / sum((q-8)^2)). Dequantised w' = (q - 8) * d, d stored as float16.
#
# The q4 matrix-vector product (``q4_matvec_ref``; the GPU kernel computes exactly this, in f16x2
# instructions): x is scaled by 1/64 and rounded to fp16 (xh); for each word, two lanes (the even and
# the odd inputs) each sum their four products (q - 8) * xh in fp16, one rounding per fused
# multiply-add, in input order; the word's value is the sum of its two lanes in fp32; a 32-input chunk
# sums its four words in fp32 and is multiplied by its group's scale; the row is 64 times the sum of
# its chunks. The fp16 lanes bound the error to ~3e-4 of max |y| (measured at the 27B shapes;
# bench/results/stop18/q4proto-h200.json), the x / 64 keeps every lane finite for |x| < 2**17.

Q4_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]
Q4_X_SCALE = 64.0
Q4_REF_ROWS = 256  # q4_matvec_ref's row block per two of torch's threads (q4_ref_rows)
Q4_SCALE_CANDIDATES = [-9.0 + 0.2 * i for i in range(11)]


def q4_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q uint8 [N, K] in 0..15, scales float16 [N, K/G]).

    Per candidate c only its squared error is computed in a full-size buffer reused in place (clamp(round(w /
    d), -8, 7) is q - 8 exactly: |round(w / d)| <= 9, integers exact in fp32); each group keeps the index of its
    first strictly best candidate, whose codes are made once more at the end from the same operands: the same
    bytes as keeping every candidate's codes, with fewer passes over the weights and no full-size tensor allocated
    per candidate (in bands of ~1M weights, compiler/weights.py: ~16x the rate of the form that kept them)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    m = torch.gather(g, -1, g.abs().argmax(dim=-1, keepdim=True))
    buf = torch.empty_like(g)
    invs, best, best_err = [], None, None
    for i, c in enumerate(Q4_SCALE_CANDIDATES):
        d = m / c
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        invs.append(inv)
        torch.mul(g, inv, out=buf).round_().clamp_(-8, 7).mul_(d).sub_(g)  # (q - 8) d - w
        err = buf.mul_(buf).sum(-1, keepdim=True)
        if best is None:
            best, best_err = torch.zeros_like(err, dtype=torch.int64), err
        else:
            best = torch.where(err < best_err, i, best)
            best_err = torch.minimum(err, best_err)
    inv = torch.gather(torch.cat(invs, -1), -1, best)
    qs = torch.mul(g, inv, out=buf).round_().clamp_(-8, 7)
    den = (qs * qs).sum(-1, keepdim=True)
    d = torch.where(den > 0, (g * qs).sum(-1, keepdim=True) / den.clamp_min(1), torch.zeros_like(den))
    return (qs + 8).to(torch.uint8).reshape(n, k), d.to(torch.float16).reshape(n, k // group)


def q4_pack(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K] float -> the q4 byte buffer described above (uint8, 1-D)."""
    q, scales = q4_quantize(w, group)
    n, k = q.shape
    q8 = q.reshape(n, k // 8, 8).to(torch.int64)
    word = torch.zeros(n, k // 8, dtype=torch.int64, device=q.device)
    for i, pos in enumerate(Q4_NIBBLE):
        word |= q8[:, :, i] << (4 * pos)
    word = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    return torch.cat([word.reshape(-1).view(torch.uint8), scales.contiguous().view(torch.uint8).reshape(-1)])


Q4_CODES_BAND = 1 << 24  # q4_codes unpacks this many weights at a time (its temporaries: a few bytes each)


def q4_codes(buf: torch.Tensor, n: int, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The q4 byte buffer -> (q - 8 as int8 [N, K], scales float32 [N, K/G]), a band of rows at a time, in bytes:
    nibble p of a little-endian word is the low (p even) or high half of its byte p // 2."""
    words = buf[: n * k // 2].contiguous().view(torch.uint8).reshape(n, k // 8, 4)  # (logical shifts)
    order = torch.tensor(Q4_NIBBLE, device=buf.device)
    q = torch.empty(n, k, dtype=torch.int8, device=buf.device)
    band = max(1, Q4_CODES_BAND // k)
    for lo in range(0, n, band):
        b = words[lo:lo + band]
        nibbles = torch.stack([b & 15, b >> 4], -1).reshape(-1, k // 8, 8)  # [..., p]: nibble p
        q[lo:lo + band] = (nibbles.index_select(2, order).view(torch.int8) - 8).reshape(-1, k)
    scales = buf[n * k // 2:].contiguous().view(torch.float16).reshape(n, k // group).float()
    return q, scales


def q4_unpack(buf: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
    """The q4 byte buffer -> dequantised float32 [N, K], carrying ``q4`` = (q - 8, scales, group) for
    ``matvec_ref``, which then computes the q4 product exactly as the GPU does."""
    q, scales = q4_codes(buf, n, k, group)
    w = (q.float().reshape(n, k // group, group) * scales[:, :, None]).reshape(n, k)
    w.q4 = (q, scales, group)
    return w


def q4_ref_rows() -> int:
    """q4_matvec_ref's rows a block: Q4_REF_ROWS for every two of torch's intra-op threads. Torch splits an op
    into chunks of at least 32,768 elements, so a block of 256 rows at K = 2048 (65,536 words) keeps two threads
    busy and no more; scaled with the threads, each thread's share of the float64 temporaries stays as large as on
    two (in cache), and a 16-core host's CPU reference (the device calls' GPU-against-CPU checks) uses its cores.
    Rows are independent: any block gives the same bits."""
    return Q4_REF_ROWS * max(1, torch.get_num_threads() // 2)


def q4_matvec_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """The q4 product of the layout comment above, for one x [K]: fp16 lanes emulated exactly (each
    fused multiply-add computed in float64, where it is exact, then rounded to fp16 once)."""
    n, k = q.shape
    # (row, word, pair, lane) -> pair first: input 8j + 2 pair + lane; each pair's slice made contiguous
    # as it is converted. The lane sums stay fp32 (fp16 values are exact there); the product and the
    # add run in float64 (mixed operands promote), where they are exact, and round to fp16 once
    xh = (x.float() / Q4_X_SCALE).half().double().reshape(k // 8, 4, 2).permute(1, 0, 2)
    chunk_scales = scales.repeat_interleave(group // 32, dim=1)
    y = torch.empty(n, dtype=torch.float32, device=q.device)
    rows = q4_ref_rows()
    for r0 in range(0, n, rows):  # row blocks: the float64 temporaries stay in cache (3x at 27B widths)
        qp = q[r0:r0 + rows].reshape(-1, k // 8, 4, 2).permute(2, 0, 1, 3)
        s = (qp[0].double() * xh[0]).half().float()
        for i in (1, 2, 3):
            s = (qp[i].double() * xh[i] + s).half().float()
        words = s.sum(-1)  # the two lanes, in fp32
        chunks = words.reshape(-1, k // 32, 4).sum(-1) * chunk_scales[r0:r0 + rows]
        y[r0:r0 + rows] = chunks.sum(-1) * Q4_X_SCALE
    return y


def matvec_swiglu_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """silu(Wg @ x) * (Wu @ x): the MLP's gate and up projections with their epilogue."""
    return torch.nn.functional.silu(matvec_ref(x, w_gate)) * matvec_ref(x, w_up)


# --- launch rules ------------------------------------------------------------------------------


def matvec_launch(n: int, k: int, group: int, target, pair: bool = False) -> dict:
    """Constants: ``target.rules["matvec"]`` (kernels/targets.py; the sm_90 values in brackets).
    Rows per CTA (BLOCK_N, at most [16]) chosen so the grid has at least [4] CTAs per SM when there are
    enough rows (down_proj's 5120 rows: 640 CTAs of 8 rows on sm_90; lm_head: 15520 of 16). bf16 / f32:
    one warp per [4] rows, BLOCK_K [512] (at most the power of two >= K), halved while it does not
    divide K, down to [128]: a masked tail iteration remains only for odd K. Below small_matrix_bytes
    ([32 MiB] of bf16: the 0.8B-2B projections) BLOCK_K up to [2048], at most [4096] / BLOCK_K rows per
    CTA, [4] warps. The bf16 / f32 values were measured on the H200 over 47-69 configurations per shape
    at the 0.8B, 4B and 27B shapes (bench/results/tuning/): the rule's pick is within 1.13x of the best
    configuration at every measured shape but one (bf16 4B in_proj: 1.05x kept over 1.13x).

    q4 (the f16x2 kernel), two regimes. Many rows (N >= 16 x [5] CTAs per SM: lm_head, the 27B / 9B
    in_proj and MLP): 16 rows x [512] inputs per tile, one warp ([2] for the swiglu ``pair``). Fewer
    rows (the 4096- to 10240-row projections, the 0.8B ones): [4] rows per CTA, [8] while the grid keeps
    [3] CTAs per SM, BLOCK_K [1024] ([2048] from K >= [12288]: down_proj) and [4] warps. Read off the
    sweep of every q4 shape of the 0.8B, 9B and 27B decode steps (990 configurations;
    bench/results/tuning/q4-decode-sweep-h200.json): within 1.0x of the best at 12 of the 18 shapes, at
    most 1.15x. GROUP is the q4 group (0: not q4); BLOCK_K is a multiple of it; with many rows it is halved
    while it leaves a tail, with fewer it is not (a masked last tile measured faster than shorter tiles:
    27B down_proj, K = 17408, 1.10x slower at 1024 than at 2048).

    PRELOAD: each program loads its first weight tile before its PDL wait (no kernel of the step writes a
    weight), so those bytes stream while the kernel before it finishes: bf16 / f32 matrices below
    preload_bytes [32 MiB] (the latency-bound small ones, where a program's tile is most of its slice).
    H200, same call, kestrel-run --bench (bench/results/stop29 call 3): 0.8B bf16 0.756 -> 0.734 ms/token;
    every matrix preloading, 27B bf16 lost 0.7% (13.34 -> 13.43), 27B q4 gained 0.5% (5.475 -> 5.447) and
    0.8B q4 lost (its programmatic graph 0.528 -> 0.578 ms, so the load-time trial kept plain edges: 0.622), so
    q4 matrices do not preload by this rule; compiler/codegen.py turns PRELOAD on for the one-token step's q4 matvecs
    right after an op with few programs (``q4_preload_after`` [moe_down_add, gdn_norm, attn_step], from
    ``q4_preload_min_bytes`` [1.5 MiB]), whose programs then find free SMs: on the H200, A B B A (bench/results/stop42
    calls 2-4), 80B-A3B q4 1.760 -> 1.728 ms/token (its input projections after the MoE block 1.737, its output
    projections after the mixers 1.753), 2B 0.748 -> 0.731, 4B 1.414 -> 1.402, 27B 4.997 -> 4.981, 9B 1.864 -> 1.862;
    0.8B's output projections (1 MiB) lost 11% with it (0.471 -> 0.525), and every q4 matrix below 16 MiB preloading
    2B 0.7%.

    L2_PREFETCH (sm_90 and later): q4 matrices of at most l2_prefetch_bytes [4.5 MiB: the 0.8B ones] ask the L2
    for their program's weight rows and scales before the PDL wait (``_l2_prefetch_rows``: bulk prefetches by one
    thread), so a small matrix streams in while the kernel before it still runs and its K loop reads the L2.
    H200, kestrel-run --bench, A B B A (bench/results/stop36 calls 4-5): 0.8B q4 0.509 -> 0.474 ms/token; every
    other plan lost with it, more the more matrices took it: 27B q4 at 24 MiB 5.086 -> 5.122, at 64 MiB 5.514;
    2B q4 at 8 / 16 MiB 0.861 -> 0.906 / 0.922, 4B 1.605 -> 1.613 / 1.713, 9B at 8 / 24 MiB 1.935 -> 1.956 / 2.241
    (those three on plain graph edges, where nothing runs before the wait); bf16 (0.8B, 24 MiB) 0.725 -> 0.745,
    so bf16 keeps PRELOAD alone; 80B-A3B q4 at 16 MiB 2.011 -> 2.022.

    PDL_LATE (programmatic dependent launch, kernels/pdl.py): from pdl_late_bytes [32 MiB] of weight the
    kernel lets the next one launch after its K loop, not at its start: on the H200 the 27B q4 step's
    programmatic graph took 6.01 ms with every matvec triggering at its start (the next kernel's
    waiting programs held SM slots the matvec's later waves needed) and 5.44 with all of them after
    the loop, while 0.8B bf16's small matrices ran 0.778 ms triggering at the start and 0.805 after
    (bench/results/stop20). Below the threshold the one-token step's matvecs are also compiled with PDL_LATE
    (compiler/codegen.py's late-trigger variants) and the runtime's load-time trial picks per plan: on the H200
    2B-9B q4 took the late ones (2B 0.848 -> 0.785 ms/token, 4B 1.586 -> 1.525, 9B 1.916 -> 1.872; with plain
    edges before), while with every matvec from 1 MiB late 0.8B q4 / bf16 lost 14% / 11%, 27B q4 2%, 80B-A3B q4 7%
    (bench/results/stop37 calls 4-6): no byte threshold fits both. A q4 matvec right before attention or the Gated
    DeltaNet step triggers at its start whatever its bytes (``pdl_early_before``, applied by compiler/codegen.py, which
    sees the next launch: 27B q4 5.078 -> 5.003 ms/token, bench/results/stop38 call 10)."""

    r = target.rules["matvec"]
    block_n = 1
    while block_n < r.max_block_n and (n + 2 * block_n - 1) // (2 * block_n) >= r.ctas_per_sm * target.sms:
        block_n *= 2
    wide = n >= 16 * r.q4_wide_ctas_per_sm * target.sms
    if group and wide:  # q4, many rows
        block_n, block_k = 16, r.q4_wide_block_k
        num_warps = 2 if pair else 1
    elif group:  # q4, fewer rows
        block_n = r.q4_min_block_n
        while block_n < r.q4_max_block_n and n // (2 * block_n) >= r.q4_ctas_per_sm * target.sms:
            block_n *= 2
        block_k = r.q4_long_block_k if k >= r.q4_long_k else r.q4_block_k
        num_warps = r.q4_warps
    elif n * k * 2 < r.small_matrix_bytes:  # latency-bound: few rows per CTA, long K tiles, 4 warps
        block_k = min(r.small_max_block_k, pow2_at_least(k))
        block_n = max(1, min(block_n, r.small_tile_elems // block_k))
        num_warps = max(1, min(r.small_max_warps, block_n * block_k // r.small_elems_per_warp))
    else:
        block_k = min(r.block_k, pow2_at_least(k))
        while block_k > r.min_block_k and block_k <= k and k % block_k:
            block_k //= 2
        num_warps = max(1, min(r.max_warps, block_n // r.rows_per_warp))
    if group:  # a multiple of the group, at most K rounded up; many rows: halved while it leaves a tail
        block_k = max(group, min(block_k, pow2_at_least(k)))
        while wide and block_k > group and k % block_k:
            block_k //= 2
        # no more warps than 16-byte chunks in a tile row band (32 inputs each per row)
        num_warps = max(1, min(num_warps, block_n * block_k // 32 // 32))
    return {"grid": [(n + block_n - 1) // block_n, 1, 1], "num_warps": num_warps, **_fp_fusion(group, target),
            "constexprs": {"N": n, "K": k, "GROUP": group, "BLOCK_N": block_n, "BLOCK_K": block_k,
                           "PDL_LATE": (n * k // 2 if group else n * k * 2) >= r.pdl_late_bytes,
                           "PRELOAD": not group and n * k * 2 < r.preload_bytes,
                           "L2_PREFETCH": bool(group) and target.cc >= 90 and n * k // 2 <= r.l2_prefetch_bytes,
                           "PAIR_FMA": _pair_fma(group, target), "TOGETHER": _together(k, block_k, group, target)}}


def _together(k: int, block_k: int, group: int, target) -> bool:
    """The constexpr ``TOGETHER``: q4 weights of one tile (K == BLOCK_K) where ``target.rules["matvec"]`` says
    ``q4_one_tile_together``."""
    return bool(group) and k == block_k and target.rules["matvec"].q4_one_tile_together


def _fp_fusion(group: int, target) -> dict:
    """The launch's ``fp_fusion`` key: off for floating-point weights where ``target.rules["matvec_rows"].fp_fusion``
    is (the one-row and few-rows kernels then sum each chunk's products in one order)."""
    return {} if group else fp_fusion(target.rules["matvec_rows"].fp_fusion)


def _pair_fma(group: int, target) -> bool:
    """The constexpr ``PAIR_FMA`` (``_fp_part``): floating-point weights where ``target.rules["matvec_rows"].pair_fma``
    is (a speculative plan: the one-row and few-rows kernels then round each chunk alike whatever ptxas contracts)."""
    return not group and target.rules["matvec_rows"].pair_fma


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
# q4 (the product of the layout comment above): a thread's 16-byte load is 4 words of one row, 32
# consecutive inputs in one group. Each word goes through one inline-assembly block (``_Q4_WORD_DOT``):
# four LOP3s (and a shift) make four f16x2 of 1024 + q (16 (1024 + q) for the nibbles at bit 4 of a
# half), two HSUB2 / two HFMA2 turn them into (q - 8) exactly, four HMUL2 / HFMA2 multiply by the x
# pairs (x / 64 in f16x2, made once per tile and shared by the thread's rows) and sum per lane, and two
# conversions and an FADD give the word's fp32 value: 16 instructions for 8 weights, against 3 per
# weight for the fp32-exact conversion this replaced; the chunk's 4 words are summed in fp32 and scaled
# once. Triton's interpreter (the tests) runs no inline assembly: there ``_q4_words_interpreted``
# computes the same values (each fp16 rounding emulated in float64, where the operation is exact).

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# how a matvec norms its input (rmsnorm_matvec_kernel's NORM; norm_mode picks one)
NORM_NONE = tl.constexpr(0)
NORM_PARTIALS = tl.constexpr(1)  # rstd from the producer's partial sums of squares, before the K loop
NORM_TILE = tl.constexpr(2)  # K in one tile: rstd from that tile
NORM_AFTER = tl.constexpr(3)  # fp weights: the sum of squares gathered along the K loop, rstd applied after it

_Q4_WORD_DOT = tl.constexpr("""{
 .reg .b32 a, b, c, d, t, m, s16, bias, s;
 .reg .f16 lo, hi;
 .reg .f32 flo, fhi;
 mov.b32 m, 0x64086408;
 mov.b32 s16, 0x2c002c00;
 mov.b32 bias, 0xd480d480;
 lop3.b32 a, $1, 0x000f000f, 0x64006400, 0xea;
 lop3.b32 b, $1, 0x00f000f0, 0x64006400, 0xea;
 shr.u32 t, $1, 8;
 lop3.b32 c, t, 0x000f000f, 0x64006400, 0xea;
 lop3.b32 d, t, 0x00f000f0, 0x64006400, 0xea;
 sub.f16x2 a, a, m;
 fma.rn.f16x2 b, b, s16, bias;
 sub.f16x2 c, c, m;
 fma.rn.f16x2 d, d, s16, bias;
 mul.rn.f16x2 s, a, $2;
 fma.rn.f16x2 s, b, $3, s;
 fma.rn.f16x2 s, c, $4, s;
 fma.rn.f16x2 s, d, $5, s;
 mov.b32 {lo, hi}, s;
 cvt.f32.f16 flo, lo;
 cvt.f32.f16 fhi, hi;
 add.f32 $0, flo, fhi;
}""")  # lop3 0xea: (a & b) | c; 0x6408: fp16 1032; 0x2c00: 1/16; 0xd480: -72 (16 (1024 + q) / 16 - 72 = q - 8)


@triton.jit
def _q4_unpack_words(words, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """q (0..15, int32) of words [BLOCK_N, BLOCK_K / 8] as [BLOCK_N, BLOCK_K] in input order (input
    8j + i at nibble Q4_NIBBLE[i]): the joins interleave within a thread."""
    n0 = words & 15
    n1 = (words >> 4) & 15
    n2 = (words >> 8) & 15
    n3 = (words >> 12) & 15
    n4 = (words >> 16) & 15
    n5 = (words >> 20) & 15
    n6 = (words >> 24) & 15
    n7 = (words >> 28) & 15
    # inputs 0..7 sit at nibbles 0, 4, 1, 5, 2, 6, 3, 7; after the joins the trailing dims (a, b, c)
    # hold input 4a + 2b + c
    q = tl.join(tl.join(tl.join(n0, n2), tl.join(n1, n3)), tl.join(tl.join(n4, n6), tl.join(n5, n7)))
    return tl.reshape(q, [BLOCK_N, BLOCK_K])


@triton.jit
def _q4_words_interpreted(words, xh, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """What ``_Q4_WORD_DOT`` computes for every word (fp32 [BLOCK_N, BLOCK_K / 8]), for the interpreter:
    xh is x / 64 as fp16, [BLOCK_K] (one x for every row) or [BLOCK_N, BLOCK_K] (a row's own)."""
    w = (_q4_unpack_words(words, BLOCK_N, BLOCK_K) - 8).to(tl.float64)
    if len(xh.shape) == 1:
        xh = xh[None, :]
    p = tl.reshape(w * xh.to(tl.float64), [BLOCK_N, BLOCK_K // 8, 2, 2, 2])  # (pair hi, lo, lane)
    p = tl.permute(p, [0, 1, 4, 2, 3])  # (lane, pair hi, pair lo)
    even, odd = tl.split(p)  # pair lo
    p0, p2 = tl.split(even)
    p1, p3 = tl.split(odd)
    s = p0.to(tl.float16).to(tl.float64)
    s = (p1 + s).to(tl.float16).to(tl.float64)
    s = (p2 + s).to(tl.float16).to(tl.float64)
    s = (p3 + s).to(tl.float16).to(tl.float32)
    lo, hi = tl.split(s)
    return lo + hi


@triton.jit
def _tile_weights(w_ptr, rows, k0, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                  MASKED: tl.constexpr):
    """The weight tile of rows ``rows`` and inputs [k0, k0 + BLOCK_K) as ``_matvec_tile`` multiplies it: q4
    (GROUP > 0), the int32 words [BLOCK_N, BLOCK_K / 8] (words past K read as 0); else the elements (past K:
    0). It reads nothing a kernel of the step writes, so a kernel may load it before its PDL wait."""
    if GROUP > 0:
        j = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        wp = w_ptr.to(tl.pointer_type(tl.int32)) + rows.to(tl.int64)[:, None] * (K // 8) + j[None, :]
        if MASKED:  # inputs past K: x = 0, so their products are 0 whatever the word holds
            w = tl.load(wp, mask=(j < K // 8)[None, :], other=0)
        else:
            w = tl.load(wp)
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        wp = w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
        if MASKED:
            w = tl.load(wp, mask=(ks < K)[None, :], other=0.0)
        else:
            w = tl.load(wp)
    return w


@triton.jit
def _matvec_tile(x_ptr, w_ptr, rows, k0, nw_ptr, rstd, eps, N: tl.constexpr, K: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr,
                 MASKED: tl.constexpr, NORM: tl.constexpr, w_tile=None, PAIR_FMA: tl.constexpr = False,
                 s_tile=None):
    """(partial products, x^2): partial products of rows ``rows`` (clamped, in
    bounds) with inputs [k0, k0 + BLOCK_K): fp32 [BLOCK_N, BLOCK_K / CHUNK], one sum per CHUNK
    inputs, a thread's 16-byte load (32 inputs for q4, 8 bf16, 4 f32). MASKED: the tile runs past K
    (inputs >= K contribute 0). NORM (``NORM_*``): the input is rmsnorm(x) = x * rstd * (1 + nw),
    made per tile as kernels/rmsnorm.py's row norm makes it: rstd given (NORM_PARTIALS), or from
    this tile, the whole of x (NORM_TILE), or applied by the caller after the K loop (NORM_AFTER:
    the products are of x * (1 + nw), and x^2 is returned per input, summed by the caller once after
    the loop: a sum per tile would be a reduction across the warps in every iteration). ``s_tile``: the tile's q4
    scales (``_tile_scales``), loaded by the caller with the words."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if MASKED:
        xv = tl.load(x_ptr + ks, mask=ks < K, other=0.0)
    else:
        xv = tl.load(x_ptr + ks)
    ssq = 0.0  # x^2 (NORM_AFTER)
    if NORM != NORM_NONE:
        if MASKED:
            nw = tl.load(nw_ptr + ks, mask=ks < K, other=0.0)
        else:
            nw = tl.load(nw_ptr + ks)
        xv = xv.to(tl.float32)
        if NORM == NORM_TILE:
            rstd = 1.0 / tl.sqrt(tl.sum(xv * xv, axis=0) / K + eps)
        if NORM == NORM_AFTER:
            ssq = xv * xv
            xv = xv * (1.0 + nw.to(tl.float32))
        else:
            xv = _normed(xv, nw, rstd)
    if GROUP > 0:
        # (the scales are loaded after the products, below, unless the caller passed them: one helper loading
        # words and scales together, shared with _rows_tile, made the 27B q4 step 5% slower on the H200, 5.84
        # against 5.55 ms/token, bench/results/stop22 calls 9-10)
        if w_tile is None:
            words = _tile_weights(w_ptr, rows, k0, K, GROUP, BLOCK_K, MASKED)
        else:  # loaded by the caller (before its PDL wait: ``_matvec_rows``' PRELOAD)
            words = w_tile
        xq = xv * (1.0 / 64.0)  # Q4_X_SCALE
        if _INTERPRET:
            d = _q4_words_interpreted(words, xq.to(tl.float16), BLOCK_N, BLOCK_K)
        else:
            # x / 64 as f16x2 pairs (inputs 8j + 2p, 8j + 2p + 1 for pair p), once per tile
            xl, xh = tl.split(tl.reshape(xq, [BLOCK_K // 8, 4, 2]))
            xp = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [xl, xh], dtype=tl.int32,
                                           is_pure=True, pack=1)
            xa, xb = tl.split(tl.reshape(xp, [BLOCK_K // 8, 2, 2]))  # pairs (0, 2), (1, 3)
            x0, x2 = tl.split(xa)
            x1, x3 = tl.split(xb)
            shape: tl.constexpr = [BLOCK_N, BLOCK_K // 8]
            d = tl.inline_asm_elementwise(_Q4_WORD_DOT, "=f,r,r,r,r,r",
                                          [words, tl.broadcast_to(x0[None, :], shape),
                                           tl.broadcast_to(x1[None, :], shape), tl.broadcast_to(x2[None, :], shape),
                                           tl.broadcast_to(x3[None, :], shape)], dtype=tl.float32, is_pure=True,
                                          pack=1)
        part = tl.sum(tl.reshape(d, [BLOCK_N, BLOCK_K // 32, 4]), axis=2)
        if s_tile is None:
            scale = _tile_scales(w_ptr, rows, k0, N, K, GROUP, BLOCK_K, MASKED)
        else:
            scale = s_tile
        return part * scale.to(tl.float32), ssq
    else:
        if w_tile is None:
            w = _tile_weights(w_ptr, rows, k0, K, GROUP, BLOCK_K, MASKED)
        else:
            w = w_tile
        return _fp_part(w.to(tl.float32), xv, BLOCK_N, BLOCK_K, CHUNK, PAIR_FMA), ssq


@triton.jit
def _normed(xv, nw, rstd):
    """rmsnorm(x)'s inputs to the products, x * rstd * (1 + nw) in fp32 (kernels/rmsnorm.py's row norm), from the
    loaded x and norm weight: ``_matvec_tile``'s NORM_PARTIALS / NORM_TILE form."""
    return xv.to(tl.float32) * rstd * (1.0 + nw.to(tl.float32))


@triton.jit
def _tile_scales(w_ptr, rows, k0, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                 MASKED: tl.constexpr):
    """The f16 scales of a q4 tile (rows ``rows``, inputs [k0, k0 + BLOCK_K)) as ``_matvec_tile`` multiplies its
    partial sums: [BLOCK_N, BLOCK_K / 32], one per 32-input chunk (chunk c lies in group 32c / GROUP; past K: 0).
    Like the words, nothing a kernel of the step writes."""
    c = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    sp = (w_ptr + N * K // 2).to(tl.pointer_type(tl.float16)) + rows.to(tl.int64)[:, None] * (K // GROUP)
    if MASKED:
        scale = tl.load(sp + (c * 32 // GROUP)[None, :], mask=(c < K // 32)[None, :], other=0.0)
    else:
        scale = tl.load(sp + (c * 32 // GROUP)[None, :])
    return scale


@triton.jit
def _first_scales(w_ptr, rows, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                  LOAD: tl.constexpr):
    """A one-tile q4 matrix's scales (``_tile_scales``) loaded now where LOAD, else None (and for bf16 / f32)."""
    if LOAD and GROUP > 0:
        tl.static_assert(K == BLOCK_K, "the scales of a matrix in one tile")
        scales = _tile_scales(w_ptr, rows, 0, N, K, GROUP, BLOCK_K, False)
    else:
        scales = None
    return scales


@triton.jit
def _first_tile(w_ptr, rows, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, PRELOAD: tl.constexpr):
    """The first weight tile ``_matvec_rows`` multiplies (inputs [0, BLOCK_K), masked when K < BLOCK_K), loaded
    now where PRELOAD (the kernels call it before their PDL wait), else None."""
    if PRELOAD:
        w = _tile_weights(w_ptr, rows, 0, K, GROUP, BLOCK_K, K < BLOCK_K)
    else:
        w = None
    return w


@triton.jit
def _l2_prefetch(ptr, nbytes):
    """One thread of the program asks the L2 for [ptr, ptr + nbytes): ``cp.async.bulk.prefetch.L2`` (sm_90; ptr
    and nbytes multiples of 16; nothing asked when nbytes is 0). A hint: nothing waits for it, and it reads what a
    load would."""
    if not _INTERPRET:
        tl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; setp.gt.s32 q, $2, 0; "
            "and.pred p, p, q; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr.to(tl.int64, bitcast=True), nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_rows(w_ptr, r0, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                      L2_PREFETCH: tl.constexpr):
    """With L2_PREFETCH (q4 weights), the rows [r0, r0 + BLOCK_N) (clipped to N) of w: their packed codes
    (contiguous, K / 2 bytes a row) and their f16 scales (after all N rows' codes, K / GROUP of them a row), each
    range rounded inwards to 16 bytes. (matvec_launch.)"""
    if L2_PREFETCH:
        tl.static_assert(GROUP > 0)
        n = tl.minimum(N - r0, BLOCK_N).to(tl.int64)
        base = w_ptr.to(tl.pointer_type(tl.int8))
        _l2_prefetch_range(base, r0.to(tl.int64) * (K // 2), n * (K // 2))
        _l2_prefetch_range(base, N * (K // 2) + r0.to(tl.int64) * (K // GROUP * 2), n * (K // GROUP * 2))


@triton.jit
def _l2_prefetch_range(base, lo, nbytes):
    """``_l2_prefetch`` of bytes [lo, lo + nbytes) past ``base`` (16-byte aligned), rounded inwards to 16 bytes."""
    lo16 = (lo + 15) // 16 * 16
    _l2_prefetch(base + lo16, tl.maximum((lo + nbytes) // 16 * 16 - lo16, 0))


@triton.jit
def _matvec_rows(x_ptr, w_ptr, rows, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, nw_ptr=None, rstd=1.0, eps=0.0,
                 NORM: tl.constexpr = 0, w0=None, PAIR_FMA: tl.constexpr = False, s0=None):
    """sum_k W[rows, k] * x[k] in fp32 for one weight (f32, bf16 or q4 when GROUP > 0): [BLOCK_N].
    ``rows`` must be in bounds (the callers clamp them). NORM: rmsnorm(x)[k] = x[k] * rstd * (1 + nw[k])
    in place of x[k] (_matvec_tile; NORM_AFTER: the rstd of the sum of x^2 over the tiles, applied to
    the row sums). ``w0``: the first tile, already loaded (``_first_tile``); ``s0`` with it: that tile's q4
    scales (``_matvec_tile``'s s_tile); the same products in the same order either way."""
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
    ssq = tl.zeros([BLOCK_K], tl.float32)
    if w0 is None:  # the loop's first tile
        START: tl.constexpr = 0
    else:  # the tile after w0
        START: tl.constexpr = BLOCK_K
        part, t = _matvec_tile(x_ptr, w_ptr, rows, 0, nw_ptr, rstd, eps, N, K, GROUP, BLOCK_N, BLOCK_K, CHUNK,
                               K < BLOCK_K, NORM, w0, PAIR_FMA, s0)
        acc += part
        ssq += t
    for k0 in tl.range(START, K_FULL, BLOCK_K, num_stages=STAGES):
        part, t = _matvec_tile(x_ptr, w_ptr, rows, k0, nw_ptr, rstd, eps, N, K, GROUP, BLOCK_N, BLOCK_K, CHUNK,
                               False, NORM, None, PAIR_FMA)
        acc += part
        ssq += t
    if K_FULL < K and K_FULL >= START:
        part, t = _matvec_tile(x_ptr, w_ptr, rows, K_FULL, nw_ptr, rstd, eps, N, K, GROUP, BLOCK_N, BLOCK_K, CHUNK,
                               True, NORM, None, PAIR_FMA)
        acc += part
        ssq += t
    y = tl.sum(acc, axis=1)
    if GROUP > 0:
        y = y * 64.0  # Q4_X_SCALE
    if NORM == NORM_AFTER:
        y = y * (1.0 / tl.sqrt(tl.sum(ssq, axis=0) / K + eps))
    return y


@triton.jit
def matvec_kernel(x_ptr, w_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                  PDL_LATE: tl.constexpr = False, PRELOAD: tl.constexpr = False,
                  L2_PREFETCH: tl.constexpr = False, PAIR_FMA: tl.constexpr = False,
                  TOGETHER: tl.constexpr = False):
    """y[n] = sum_k W[n, k] * x[k] (fp32 accumulation). W [N, K] row-major: fp32 or bf16 (by the
    pointer type), or the q4 byte buffer described above when GROUP > 0. Grid: ceil(N / BLOCK_N)
    programs of BLOCK_N rows each, each looping over K in BLOCK_K tiles. PRELOAD: the first weight tile
    is loaded before the PDL wait (``matvec_launch``)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w0 = _first_tile(w_ptr, tl.minimum(rows, N - 1), K, GROUP, BLOCK_K, PRELOAD)
    s0 = _first_scales(w_ptr, tl.minimum(rows, N - 1), N, K, GROUP, BLOCK_K, TOGETHER and PRELOAD)
    _l2_prefetch_rows(w_ptr, tl.program_id(0) * BLOCK_N, N, K, GROUP, BLOCK_N, L2_PREFETCH)
    pdl_wait(PDL, not PDL_LATE)
    if TOGETHER and not PRELOAD:  # the words and scales of the one tile at once, first after the wait
        w0 = _first_tile(w_ptr, tl.minimum(rows, N - 1), K, GROUP, BLOCK_K, True)
        s0 = _first_scales(w_ptr, tl.minimum(rows, N - 1), N, K, GROUP, BLOCK_K, True)
    y = _matvec_rows(x_ptr, w_ptr, tl.minimum(rows, N - 1), N, K, GROUP, BLOCK_N, BLOCK_K, w0=w0, PAIR_FMA=PAIR_FMA,
                     s0=s0)
    if PDL_LATE:  # after the K loop: the next kernel's programs take no slot a later wave needs
        pdl_launch(PDL)
    tl.store(y_ptr + rows, y, mask=rows < N)


@triton.jit
def matvec_swiglu_kernel(x_ptr, wg_ptr, wu_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr = False,
                         PDL_LATE: tl.constexpr = False, PRELOAD: tl.constexpr = False,
                         L2_PREFETCH: tl.constexpr = False, PAIR_FMA: tl.constexpr = False,
                         TOGETHER: tl.constexpr = False):
    """y = silu(Wg @ x) * (Wu @ x) for two weights of one dtype and shape [N, K] (as matvec_kernel);
    the same split: each program computes BLOCK_N rows of both products, gate then up. (One K loop
    streaming both weights' tiles together was measured for q4 and lost: 27B q4 5.56 ms/token against
    5.42, bench/results/stop19.) PRELOAD: the gate's first tile before the PDL wait."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, N - 1)
    w0 = _first_tile(wg_ptr, rows_in, K, GROUP, BLOCK_K, PRELOAD)
    s0 = _first_scales(wg_ptr, rows_in, N, K, GROUP, BLOCK_K, TOGETHER and PRELOAD)
    w1 = _first_tile(wu_ptr, rows_in, K, GROUP, BLOCK_K, TOGETHER and PRELOAD)
    s1 = _first_scales(wu_ptr, rows_in, N, K, GROUP, BLOCK_K, TOGETHER and PRELOAD)
    _l2_prefetch_rows(wg_ptr, tl.program_id(0) * BLOCK_N, N, K, GROUP, BLOCK_N, L2_PREFETCH)
    _l2_prefetch_rows(wu_ptr, tl.program_id(0) * BLOCK_N, N, K, GROUP, BLOCK_N, L2_PREFETCH)
    pdl_wait(PDL, not PDL_LATE)
    if TOGETHER and not PRELOAD:  # both matrices' words and scales of the one tile at once, first after the wait
        w0 = _first_tile(wg_ptr, rows_in, K, GROUP, BLOCK_K, True)
        s0 = _first_scales(wg_ptr, rows_in, N, K, GROUP, BLOCK_K, True)
        w1 = _first_tile(wu_ptr, rows_in, K, GROUP, BLOCK_K, True)
        s1 = _first_scales(wu_ptr, rows_in, N, K, GROUP, BLOCK_K, True)
    g = _matvec_rows(x_ptr, wg_ptr, rows_in, N, K, GROUP, BLOCK_N, BLOCK_K, w0=w0, PAIR_FMA=PAIR_FMA, s0=s0)
    u = _matvec_rows(x_ptr, wu_ptr, rows_in, N, K, GROUP, BLOCK_N, BLOCK_K, w0=w1, PAIR_FMA=PAIR_FMA, s0=s1)
    if PDL_LATE:  # after the K loop: the next kernel's programs take no slot a later wave needs
        pdl_launch(PDL)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + rows, y, mask=rows < N)


# --- the residual add and the next RMSNorm, fused into the matvecs on either side -------------------
#
# A decoder layer's residual add and the RMSNorm after it (add_rmsnorm: s = r + W x; n = rmsnorm(s))
# sit between two matrix products. One program cannot norm the vector on its own (the norm needs
# the sum of squares over all of s, which the producer's programs make piece by piece), so the work
# is split over the two matvecs it sits between, without a launch of its own:
#   * matvec_add_kernel (op ``matmul_add``): s = W x + r, and each program's sum of s^2 over its own
#     BLOCK_N rows in ss[program] (partial_rows = BLOCK_N rows per partial, the last one short);
#   * rmsnorm_matvec_kernel / rmsnorm_matvec_swiglu_kernel (``rmsnorm_matmul`` / ``_swiglu``) stream
#     the weight with x[k] * rstd * (1 + nw[k]) as the input, made per tile from s and the norm
#     weight, rstd = 1 / sqrt(sum(s^2) / K + eps) from one of three places (NORM, ``norm_mode``):
#     the input in one tile (the small models): that tile (NORM_TILE); fp weights: the sum of
#     squares gathered along the K loop, rstd applied to the row sums after it (NORM_AFTER); q4
#     (its f16x2 product wants the normed input): the P partials summed in index order before the
#     loop (NORM_PARTIALS; the same fixed order in every program, so the norm is deterministic and
#     the same for all rows). On the H200 the partials before the loop cost the small models what
#     the launch saved (0.8B bf16 0.778 ms/token against 0.769 unfused; bench/results/stop20).
# The norm costs no launch and no pass of one program over the whole vector (add_rmsnorm's). The CPU references compose the unfused references (matmul then
# add; rmsnorm then matmul), so the CPU path is bit-identical to the unfused program's.


def matvec_add_ref(x: torch.Tensor, w: torch.Tensor, r: torch.Tensor, partial_rows: int):
    """(s, ss): s = r + W @ x (add_rmsnorm's sum, in its operand order), ss[i] = sum of s^2 over rows
    [i * partial_rows, (i + 1) * partial_rows); at M rows (x [M, K]) the same for each row: ss [M, P]."""
    s = r + matvec_ref(x, w)
    n = s.shape[-1]
    ss = torch.stack([(s[..., i:i + partial_rows].float() ** 2).sum(-1) for i in range(0, n, partial_rows)], -1)
    return s, ss


def rmsnorm_matvec_ref(s: torch.Tensor, ss: torch.Tensor, nw: torch.Tensor, w: torch.Tensor, eps: float):
    """W @ rmsnorm(s) (kernels/rmsnorm.py's zero-centred norm). ss (the partial sums of s^2) is how the
    GPU gets the mean square; the reference takes it from s, as the unfused rmsnorm does."""
    return matvec_ref(rmsnorm_ref(s, nw, eps), w)


def rmsnorm_matvec_swiglu_ref(s, ss, nw, w_gate, w_up, eps: float):
    """silu(Wg @ n) * (Wu @ n), n = rmsnorm(s) (rmsnorm_matvec_ref)."""
    return matvec_swiglu_ref(rmsnorm_ref(s, nw, eps), w_gate, w_up)


def rmsnorm_matvec_launch(n: int, k: int, group: int, partials: int, target, pair: bool = False) -> dict:
    """rmsnorm_matvec_kernel's (``pair``: rmsnorm_matvec_swiglu_kernel's) launch: matvec_launch's,
    plus P (the producer's ``partials``), BLOCK_P (P rounded up to a power of two: one vector) and
    NORM (``norm_mode``). A single q4 product with many rows takes the rule's q4_wide_norm_block_n rows
    and q4_wide_norm_warps warps a CTA (each program normalises its x slice once for all its rows); with K at
    most q4_norm_short_k, q4_norm_short_wide's rows and warps, and with fewer rows the whole of K in one tile. The
    q4 gate / up pair: the split of the first q4_pair_norm row whose K bound holds, if any."""
    launch = matvec_launch(n, k, group, target, pair=pair)
    c = launch["constexprs"]
    r = target.rules["matvec"]
    short = group and not pair and k <= r.q4_norm_short_k  # (q4_norm_short_k: hidden 2048)
    split = next((row[1:] for row in r.q4_pair_norm if k <= row[0]), None) if group and pair else None
    if split is not None:
        bn, bk, warps = split
        bk = max(group, min(bk, pow2_at_least(k)))  # (a small K: its power of two, one tile)
        launch = {**launch, "grid": [(n + bn - 1) // bn, 1, 1], "num_warps": max(1, min(warps, bn * bk // 1024))}
        c = {**c, "BLOCK_N": bn, "BLOCK_K": bk}
    elif group and not pair and n >= 16 * r.q4_wide_ctas_per_sm * target.sms:  # (matvec_launch's many rows)
        bn, warps = r.q4_norm_short_wide if short and r.q4_norm_short_wide else (r.q4_wide_norm_block_n,
                                                                                 r.q4_wide_norm_warps)
        launch = {**launch, "grid": [(n + bn - 1) // bn, 1, 1],
                  "num_warps": max(1, min(warps, bn * c["BLOCK_K"] // 32 // 32))}
        c = {**c, "BLOCK_N": bn}
    elif short:  # fewer rows: the whole input in one tile, normed from that tile
        c = {**c, "BLOCK_K": max(group, pow2_at_least(k))}
    return {**launch, "constexprs": {**c, "P": partials, "BLOCK_P": pow2_at_least(partials),
                                     "NORM": norm_mode(k, c["BLOCK_K"], group),
                                     "TOGETHER": _together(k, c["BLOCK_K"], group, target)}}


def norm_mode(k: int, block_k: int, group: int) -> int:
    """NORM of the rmsnorm matvecs: the whole input in one tile: its own sum of squares (NORM_TILE);
    fp weights: the sum gathered along the K loop and rstd applied to the row sums after it
    (NORM_AFTER: fp32 products, the factor commutes up to rounding); q4: rstd from the producer's
    partials before the loop (NORM_PARTIALS: the f16x2 product takes the normed input, as its
    reference does, and the input's fp16 range stays the normed one's)."""
    if k <= block_k:
        return NORM_TILE.value
    return NORM_PARTIALS.value if group else NORM_AFTER.value


@triton.jit
def _partials_rstd(ss_ptr, eps, K: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr):
    """1 / sqrt(mean(s^2) + eps) from the P partial sums of s^2 (K elements in all)."""
    i = tl.arange(0, BLOCK_P)
    ss = tl.load(ss_ptr + i, mask=i < P, other=0.0)
    return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def matvec_add_kernel(x_ptr, w_ptr, r_ptr, s_ptr, ss_ptr, partial_rows, N: tl.constexpr, K: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False,
                      PDL_LATE: tl.constexpr = False, PRELOAD: tl.constexpr = False,
                      L2_PREFETCH: tl.constexpr = False, PAIR_FMA: tl.constexpr = False,
                      TOGETHER: tl.constexpr = False):
    """s = r + W @ x (matvec_kernel's product, the same split) and ss[program] = the sum of s^2 over
    the program's rows (``partial_rows`` = BLOCK_N, the op's attribute; not read). PRELOAD as
    matvec_kernel's."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w0 = _first_tile(w_ptr, tl.minimum(rows, N - 1), K, GROUP, BLOCK_K, PRELOAD)
    s0 = _first_scales(w_ptr, tl.minimum(rows, N - 1), N, K, GROUP, BLOCK_K, TOGETHER and PRELOAD)
    _l2_prefetch_rows(w_ptr, tl.program_id(0) * BLOCK_N, N, K, GROUP, BLOCK_N, L2_PREFETCH)
    pdl_wait(PDL, not PDL_LATE)
    if TOGETHER and not PRELOAD:  # the words and scales of the one tile at once, first after the wait
        w0 = _first_tile(w_ptr, tl.minimum(rows, N - 1), K, GROUP, BLOCK_K, True)
        s0 = _first_scales(w_ptr, tl.minimum(rows, N - 1), N, K, GROUP, BLOCK_K, True)
    y = _matvec_rows(x_ptr, w_ptr, tl.minimum(rows, N - 1), N, K, GROUP, BLOCK_N, BLOCK_K, w0=w0, PAIR_FMA=PAIR_FMA,
                     s0=s0)
    if PDL_LATE:  # after the K loop: the next kernel's programs take no slot a later wave needs
        pdl_launch(PDL)
    live = rows < N
    s = tl.load(r_ptr + rows, mask=live, other=0.0) + y
    tl.store(s_ptr + rows, s, mask=live)
    tl.store(ss_ptr + tl.program_id(0), tl.sum(tl.where(live, s * s, 0.0), axis=0))


@triton.jit
def rmsnorm_matvec_kernel(x_ptr, ss_ptr, nw_ptr, w_ptr, y_ptr, eps, N: tl.constexpr, K: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, P: tl.constexpr,
                          BLOCK_P: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False,
                          PDL_LATE: tl.constexpr = False, PRELOAD: tl.constexpr = False,
                          L2_PREFETCH: tl.constexpr = False, PAIR_FMA: tl.constexpr = False,
                          TOGETHER: tl.constexpr = False):
    """y = W @ rmsnorm(x) with the norm weight nw, the mean square from the P partials ss
    (matvec_add_kernel's); matvec_kernel's split and PRELOAD."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w0 = _first_tile(w_ptr, tl.minimum(rows, N - 1), K, GROUP, BLOCK_K, PRELOAD)
    s0 = _first_scales(w_ptr, tl.minimum(rows, N - 1), N, K, GROUP, BLOCK_K, TOGETHER and PRELOAD)
    _l2_prefetch_rows(w_ptr, tl.program_id(0) * BLOCK_N, N, K, GROUP, BLOCK_N, L2_PREFETCH)
    pdl_wait(PDL, not PDL_LATE)
    if TOGETHER and not PRELOAD:  # the words and scales of the one tile at once, first after the wait
        w0 = _first_tile(w_ptr, tl.minimum(rows, N - 1), K, GROUP, BLOCK_K, True)
        s0 = _first_scales(w_ptr, tl.minimum(rows, N - 1), N, K, GROUP, BLOCK_K, True)
    rstd = 1.0
    if NORM == NORM_PARTIALS:
        rstd = _partials_rstd(ss_ptr, eps, K, P, BLOCK_P)
    y = _matvec_rows(x_ptr, w_ptr, tl.minimum(rows, N - 1), N, K, GROUP, BLOCK_N, BLOCK_K, nw_ptr, rstd, eps, NORM,
                     w0, PAIR_FMA, s0=s0)
    if PDL_LATE:  # after the K loop: the next kernel's programs take no slot a later wave needs
        pdl_launch(PDL)
    tl.store(y_ptr + rows, y, mask=rows < N)


@triton.jit
def rmsnorm_matvec_swiglu_kernel(x_ptr, ss_ptr, nw_ptr, wg_ptr, wu_ptr, y_ptr, eps, N: tl.constexpr,
                                 K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, P: tl.constexpr, BLOCK_P: tl.constexpr, NORM: tl.constexpr,
                                 PDL: tl.constexpr = False,
                                 PDL_LATE: tl.constexpr = False, PRELOAD: tl.constexpr = False,
                                 L2_PREFETCH: tl.constexpr = False, PAIR_FMA: tl.constexpr = False,
                                 TOGETHER: tl.constexpr = False):
    """y = silu(Wg @ n) * (Wu @ n), n = rmsnorm(x) as rmsnorm_matvec_kernel makes it; the split and
    PRELOAD of matvec_swiglu_kernel."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, N - 1)
    w0 = _first_tile(wg_ptr, rows_in, K, GROUP, BLOCK_K, PRELOAD)
    s0 = _first_scales(wg_ptr, rows_in, N, K, GROUP, BLOCK_K, TOGETHER and PRELOAD)
    w1 = _first_tile(wu_ptr, rows_in, K, GROUP, BLOCK_K, TOGETHER and PRELOAD)
    s1 = _first_scales(wu_ptr, rows_in, N, K, GROUP, BLOCK_K, TOGETHER and PRELOAD)
    _l2_prefetch_rows(wg_ptr, tl.program_id(0) * BLOCK_N, N, K, GROUP, BLOCK_N, L2_PREFETCH)
    _l2_prefetch_rows(wu_ptr, tl.program_id(0) * BLOCK_N, N, K, GROUP, BLOCK_N, L2_PREFETCH)
    pdl_wait(PDL, not PDL_LATE)
    if TOGETHER and not PRELOAD:  # both matrices' words and scales of the one tile at once, first after the wait
        w0 = _first_tile(wg_ptr, rows_in, K, GROUP, BLOCK_K, True)
        s0 = _first_scales(wg_ptr, rows_in, N, K, GROUP, BLOCK_K, True)
        w1 = _first_tile(wu_ptr, rows_in, K, GROUP, BLOCK_K, True)
        s1 = _first_scales(wu_ptr, rows_in, N, K, GROUP, BLOCK_K, True)
    rstd = 1.0
    if NORM == NORM_PARTIALS:
        rstd = _partials_rstd(ss_ptr, eps, K, P, BLOCK_P)
    g = _matvec_rows(x_ptr, wg_ptr, rows_in, N, K, GROUP, BLOCK_N, BLOCK_K, nw_ptr, rstd, eps, NORM, w0, PAIR_FMA,
                     s0=s0)
    u = _matvec_rows(x_ptr, wu_ptr, rows_in, N, K, GROUP, BLOCK_N, BLOCK_K, nw_ptr, rstd, eps, NORM, w1, PAIR_FMA,
                     s0=s1)
    if PDL_LATE:  # after the K loop: the next kernel's programs take no slot a later wave needs
        pdl_launch(PDL)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + rows, y, mask=rows < N)


# --- a few rows (a speculative verify's k + 1, a short M-row step): the matvec, each weight tile read
# once for up to FEW_ROWS rows ----------------------------------------------------------------------
#
# At a few rows the M-row step's projections are still bound by reading the weight, which the
# tensor-core GEMM (kernels/gemm.py) does not stream at the matvec's rate (bf16) or cannot feed fast
# enough at all (q4: its dequantisation per weight, then a layout change for the tensor cores). Here
# each program streams BLOCK_N weight rows exactly as matvec_kernel does and multiplies every tile by
# R rows of x before it moves on (program (i, j): weight rows block i, x rows j*R .. j*R + R - 1, the
# last ones clamped to M - 1 and not stored). Each row's products, partial sums and their order are
# the one-row kernel's (the reference is ``matvec_ref`` row by row, as for the one-token step). q4: one
# inline-assembly block per word makes the four f16x2 of (q - 8) once and takes the R rows' x pairs
# (_q4_word_dot_rows: 9 + 7 R instructions per 8 weights, against 16 R for R one-row blocks).

FEW_ROWS = 4  # x rows per program at most (four accumulators)


def _q4_word_dot_rows(r: int) -> str:
    """``_Q4_WORD_DOT`` for r rows: outputs $0..$(r-1) (each row's fp32 word value), the word $r, then
    each row's four x pairs. The (q - 8) halves are made once."""
    body = [" .reg .b32 a, b, c, d, t, m, s16, bias, s;", " .reg .f16 lo, hi;", " .reg .f32 flo, fhi;",
            " mov.b32 m, 0x64086408;", " mov.b32 s16, 0x2c002c00;", " mov.b32 bias, 0xd480d480;",
            f" lop3.b32 a, ${r}, 0x000f000f, 0x64006400, 0xea;", f" lop3.b32 b, ${r}, 0x00f000f0, 0x64006400, 0xea;",
            f" shr.u32 t, ${r}, 8;", " lop3.b32 c, t, 0x000f000f, 0x64006400, 0xea;",
            " lop3.b32 d, t, 0x00f000f0, 0x64006400, 0xea;", " sub.f16x2 a, a, m;", " fma.rn.f16x2 b, b, s16, bias;",
            " sub.f16x2 c, c, m;", " fma.rn.f16x2 d, d, s16, bias;"]
    for i in range(r):
        x = [f"${r + 1 + 4 * i + j}" for j in range(4)]
        body += [f" mul.rn.f16x2 s, a, {x[0]};", f" fma.rn.f16x2 s, b, {x[1]}, s;", f" fma.rn.f16x2 s, c, {x[2]}, s;",
                 f" fma.rn.f16x2 s, d, {x[3]}, s;", " mov.b32 {lo, hi}, s;", " cvt.f32.f16 flo, lo;",
                 " cvt.f32.f16 fhi, hi;", f" add.f32 ${i}, flo, fhi;"]
    return "{\n" + "\n".join(body) + "\n}"


_Q4_DOT_ROWS_1 = tl.constexpr(_q4_word_dot_rows(1))
_Q4_DOT_ROWS_2 = tl.constexpr(_q4_word_dot_rows(2))
_Q4_DOT_ROWS_3 = tl.constexpr(_q4_word_dot_rows(3))
_Q4_DOT_ROWS_4 = tl.constexpr(_q4_word_dot_rows(4))


def few_rows_per_program(m: int) -> int:
    """R: x rows per program, M spread evenly over ceil(M / FEW_ROWS) programs (5 rows: 3 + 2)."""
    progs = -(-m // FEW_ROWS)
    return -(-m // progs)


def matvec_rows_launch(m: int, n: int, k: int, group: int, target, pair: bool = False) -> dict:
    """matvec_rows_kernel's (``pair``: matvec_rows_swiglu_kernel's) launch at m rows: R =
    few_rows_per_program(m) x rows per program, grid [weight row blocks, ceil(m / R)], and the weight's
    split of matvec_launch (the one-row kernel's) except where ``target.rules["matvec_rows"]`` says
    otherwise (sm_90: bench/results/tuning/rows-sweep-h200.json, 4 rows): q4 with fewer rows: BLOCK_N
    doubled while the grid keeps [2] CTAs per SM, BLOCK_K [1024], [4] warps (27B o_proj 16.4 us against
    the one-row split's 20.1, down_proj 39.3 against 46.6); q4 swiglu pairs with many rows: [4] warps
    (27B gate + up 69.6 us against 79.5); small bf16 matrices: [8 x 256, 2 warps] up to K = [2048],
    [4 x 1024, 2 warps] past it (0.8B: 6.1-8.2 us against 9.1-10.7). The 27B bf16 splits are the
    one-row kernel's (within 1.07x of the best of 9): with them a row's result is the one-row kernel's,
    bit for bit (the same tiles, products and reduction order); ``one_row_split`` takes them at every
    shape (an experiment: bench/results/stop33)."""
    launch = matvec_launch(n, k, group, target, pair=pair)
    c = dict(launch["constexprs"])
    del c["PDL_LATE"], c["PRELOAD"], c["L2_PREFETCH"], c["TOGETHER"]
    num_warps = launch["num_warps"]
    rr = target.rules["matvec_rows"]
    r = target.rules["matvec"]
    wide = n >= 16 * r.q4_wide_ctas_per_sm * target.sms
    if rr.one_row_split:  # each row's products the one-row kernel's, bit for bit (an experiment)
        pass
    elif group and not wide:
        bn = r.q4_min_block_n
        while bn < r.max_block_n and n // (2 * bn) >= rr.q4_ctas_per_sm * target.sms:
            bn *= 2
        c["BLOCK_N"], c["BLOCK_K"], num_warps = bn, max(group, min(rr.q4_block_k, pow2_at_least(k))), rr.q4_warps
    elif group and pair:
        num_warps = rr.q4_warps
    elif not group and n * k * 2 < r.small_matrix_bytes:
        bn, bk, num_warps = rr.small_short if k <= rr.small_short_k else rr.small_long
        c["BLOCK_N"], c["BLOCK_K"] = bn, min(bk, pow2_at_least(k))
    rows = few_rows_per_program(m)
    return {"grid": [-(-n // c["BLOCK_N"]), -(-m // rows), 1], "num_warps": num_warps, **_fp_fusion(group, target),
            "constexprs": {"M": m, **c, "R": rows}}


@triton.jit
def _x_pairs(xv):
    """x / 64 as the four f16x2 pair vectors of a tile (``_matvec_tile``'s conversion), [BLOCK_K / 8] each."""
    xq = xv * (1.0 / 64.0)  # Q4_X_SCALE
    BK8: tl.constexpr = xq.shape[0] // 8
    xl, xh = tl.split(tl.reshape(xq, [BK8, 4, 2]))
    xp = tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [xl, xh], dtype=tl.int32,
                                   is_pure=True, pack=1)
    xa, xb = tl.split(tl.reshape(xp, [BK8, 2, 2]))  # pairs (0, 2), (1, 3)
    x0, x2 = tl.split(xa)
    x1, x3 = tl.split(xb)
    return x0, x1, x2, x3


@triton.jit
def _load_x(x_ptr, row, ks, K: tl.constexpr, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(x_ptr + row * K + ks, mask=ks < K, other=0.0)
    return tl.load(x_ptr + row * K + ks)


@triton.jit
def _fp_part(w, xv, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, PAIR_FMA: tl.constexpr = False):
    """Each CHUNK inputs' sum of w * x: [BLOCK_N, BLOCK_K / CHUNK] (w fp32 [BLOCK_N, BLOCK_K], xv [BLOCK_K]): the
    one-row and the few-rows floating-point products alike. PAIR_FMA: the products of inputs 2i and 2i + 1 made as
    fma(w1, x1, w0 * x0), then those summed: no product is left for the compiler to contract into a sum, so the two
    kernels round a chunk alike whatever ptxas fuses (``matvec_rows.pair_fma``: speculative plans)."""
    if PAIR_FMA:
        tl.static_assert(CHUNK % 2 == 0)
        w0, w1 = tl.split(tl.reshape(w, [BLOCK_N, BLOCK_K // 2, 2]))
        x0, x1 = tl.split(tl.reshape(xv.to(tl.float32), [BLOCK_K // 2, 2]))
        pairs = tl.fma(w1, x1[None, :], w0 * x0[None, :])
        return tl.sum(tl.reshape(pairs, [BLOCK_N, BLOCK_K // CHUNK, CHUNK // 2]), axis=2)
    return tl.sum(tl.reshape(w * xv[None, :], [BLOCK_N, BLOCK_K // CHUNK, CHUNK]), axis=2)


@triton.jit
def _rows_tile(x_ptr, w_ptr, rows, r0, k0, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, R: tl.constexpr,
               MASKED: tl.constexpr, xidx_ptr=None, PAIR_FMA: tl.constexpr = False):
    """The partial products of weight rows ``rows`` with inputs [k0, k0 + BLOCK_K) for x rows r0 ..
    r0 + R - 1 (clamped to M - 1): ``_matvec_tile``'s, four [BLOCK_N, BLOCK_K / CHUNK] (rows past R: 0).
    ``xidx_ptr``: the x rows are gathered, row r0 + i being x row xidx[r0 + i] (kernels/moe.py's grouped
    experts: the rows routed to one expert)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    i0, i1, i2 = tl.minimum(r0, M - 1), tl.minimum(r0 + 1, M - 1), tl.minimum(r0 + 2, M - 1)
    i3 = tl.minimum(r0 + 3, M - 1)
    if xidx_ptr is not None:
        i0, i1, i2, i3 = tl.load(xidx_ptr + i0), tl.load(xidx_ptr + i1), tl.load(xidx_ptr + i2), tl.load(xidx_ptr + i3)
    x0 = _load_x(x_ptr, i0, ks, K, MASKED)
    x1 = _load_x(x_ptr, i1, ks, K, MASKED)
    x2 = _load_x(x_ptr, i2, ks, K, MASKED)
    x3 = _load_x(x_ptr, i3, ks, K, MASKED)
    zero = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], tl.float32)
    p1, p2, p3 = zero, zero, zero
    if GROUP > 0:
        words = _tile_weights(w_ptr, rows, k0, K, GROUP, BLOCK_K, MASKED)
        c = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        sp = (w_ptr + N * K // 2).to(tl.pointer_type(tl.float16)) + rows.to(tl.int64)[:, None] * (K // GROUP)
        if MASKED:
            scale = tl.load(sp + (c * 32 // GROUP)[None, :], mask=(c < K // 32)[None, :], other=0.0).to(tl.float32)
        else:
            scale = tl.load(sp + (c * 32 // GROUP)[None, :]).to(tl.float32)
        shape: tl.constexpr = [BLOCK_N, BLOCK_K // 8]
        if _INTERPRET:
            d0 = _q4_words_interpreted(words, (x0 * (1.0 / 64.0)).to(tl.float16), BLOCK_N, BLOCK_K)
            d1 = _q4_words_interpreted(words, (x1 * (1.0 / 64.0)).to(tl.float16), BLOCK_N, BLOCK_K)
            d2 = _q4_words_interpreted(words, (x2 * (1.0 / 64.0)).to(tl.float16), BLOCK_N, BLOCK_K)
            d3 = _q4_words_interpreted(words, (x3 * (1.0 / 64.0)).to(tl.float16), BLOCK_N, BLOCK_K)
        else:
            a0, a1, a2, a3 = _x_pairs(x0)
            b0, b1, b2, b3 = _x_pairs(x1)
            c0, c1, c2, c3 = _x_pairs(x2)
            e0, e1, e2, e3 = _x_pairs(x3)
            args = [words,
                    tl.broadcast_to(a0[None, :], shape), tl.broadcast_to(a1[None, :], shape),
                    tl.broadcast_to(a2[None, :], shape), tl.broadcast_to(a3[None, :], shape),
                    tl.broadcast_to(b0[None, :], shape), tl.broadcast_to(b1[None, :], shape),
                    tl.broadcast_to(b2[None, :], shape), tl.broadcast_to(b3[None, :], shape),
                    tl.broadcast_to(c0[None, :], shape), tl.broadcast_to(c1[None, :], shape),
                    tl.broadcast_to(c2[None, :], shape), tl.broadcast_to(c3[None, :], shape),
                    tl.broadcast_to(e0[None, :], shape), tl.broadcast_to(e1[None, :], shape),
                    tl.broadcast_to(e2[None, :], shape), tl.broadcast_to(e3[None, :], shape)]
            d1, d2, d3 = zero, zero, zero  # (placeholders; R decides which are made)
            if R == 1:
                d0 = tl.inline_asm_elementwise(_Q4_DOT_ROWS_1, "=f" + ",r" * 17, args, dtype=tl.float32,
                                               is_pure=True, pack=1)
            elif R == 2:
                d0, d1 = tl.inline_asm_elementwise(_Q4_DOT_ROWS_2, "=f,=f" + ",r" * 17, args,
                                                   dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
            elif R == 3:
                d0, d1, d2 = tl.inline_asm_elementwise(_Q4_DOT_ROWS_3, "=f,=f,=f" + ",r" * 17, args,
                                                       dtype=(tl.float32,) * 3, is_pure=True, pack=1)
            else:
                d0, d1, d2, d3 = tl.inline_asm_elementwise(_Q4_DOT_ROWS_4, "=f,=f,=f,=f" + ",r" * 17, args,
                                                           dtype=(tl.float32,) * 4, is_pure=True, pack=1)
        p0 = tl.sum(tl.reshape(d0, [BLOCK_N, BLOCK_K // 32, 4]), axis=2) * scale
        if R > 1:
            p1 = tl.sum(tl.reshape(d1, [BLOCK_N, BLOCK_K // 32, 4]), axis=2) * scale
        if R > 2:
            p2 = tl.sum(tl.reshape(d2, [BLOCK_N, BLOCK_K // 32, 4]), axis=2) * scale
        if R > 3:
            p3 = tl.sum(tl.reshape(d3, [BLOCK_N, BLOCK_K // 32, 4]), axis=2) * scale
    else:
        w = _tile_weights(w_ptr, rows, k0, K, GROUP, BLOCK_K, MASKED).to(tl.float32)
        p0 = _fp_part(w, x0, BLOCK_N, BLOCK_K, CHUNK, PAIR_FMA)
        if R > 1:
            p1 = _fp_part(w, x1, BLOCK_N, BLOCK_K, CHUNK, PAIR_FMA)
        if R > 2:
            p2 = _fp_part(w, x2, BLOCK_N, BLOCK_K, CHUNK, PAIR_FMA)
        if R > 3:
            p3 = _fp_part(w, x3, BLOCK_N, BLOCK_K, CHUNK, PAIR_FMA)
    return p0, p1, p2, p3


@triton.jit
def _matvec_few_rows(x_ptr, w_ptr, rows, r0, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr,
                     xidx_ptr=None, PAIR_FMA: tl.constexpr = False):
    """``_matvec_rows`` for x rows r0 .. r0 + R - 1 at once: four [BLOCK_N] (rows past R: 0); gathered
    through ``xidx_ptr`` when given (_rows_tile)."""
    tl.static_assert(GROUP == 0 or (GROUP % 32 == 0 and BLOCK_K % GROUP == 0 and K % GROUP == 0))
    tl.static_assert(R >= 1 and R <= 4)  # FEW_ROWS
    if GROUP > 0:
        CHUNK: tl.constexpr = 32
        TILE_BYTES: tl.constexpr = BLOCK_N * BLOCK_K // 2
    else:
        BITS: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth
        if BLOCK_K >= 128 // BITS:
            CHUNK: tl.constexpr = 128 // BITS
        else:
            CHUNK: tl.constexpr = BLOCK_K
        TILE_BYTES: tl.constexpr = BLOCK_N * BLOCK_K * BITS // 8
    STAGES: tl.constexpr = 3 if TILE_BYTES <= 16384 else 2
    K_FULL: tl.constexpr = K - K % BLOCK_K
    acc0 = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K // CHUNK], tl.float32)
    for k0 in tl.range(0, K_FULL, BLOCK_K, num_stages=STAGES):
        p0, p1, p2, p3 = _rows_tile(x_ptr, w_ptr, rows, r0, k0, M, N, K, GROUP, BLOCK_N, BLOCK_K, CHUNK, R, False,
                                    xidx_ptr, PAIR_FMA)
        acc0 += p0
        acc1 += p1
        acc2 += p2
        acc3 += p3
    if K_FULL < K:
        p0, p1, p2, p3 = _rows_tile(x_ptr, w_ptr, rows, r0, K_FULL, M, N, K, GROUP, BLOCK_N, BLOCK_K, CHUNK, R, True,
                                    xidx_ptr, PAIR_FMA)
        acc0 += p0
        acc1 += p1
        acc2 += p2
        acc3 += p3
    scale = 64.0 if GROUP > 0 else 1.0  # Q4_X_SCALE
    return (tl.sum(acc0, axis=1) * scale, tl.sum(acc1, axis=1) * scale, tl.sum(acc2, axis=1) * scale,
            tl.sum(acc3, axis=1) * scale)


@triton.jit
def _store_rows(y_ptr, y0, y1, y2, y3, rows, r0, M: tl.constexpr, N: tl.constexpr, R: tl.constexpr):
    live = rows < N
    tl.store(y_ptr + r0 * N + rows, y0, mask=live & (r0 < M))
    if R > 1:
        tl.store(y_ptr + (r0 + 1) * N + rows, y1, mask=live & (r0 + 1 < M))
    if R > 2:
        tl.store(y_ptr + (r0 + 2) * N + rows, y2, mask=live & (r0 + 2 < M))
    if R > 3:
        tl.store(y_ptr + (r0 + 3) * N + rows, y3, mask=live & (r0 + 3 < M))


@triton.jit
def matvec_rows_kernel(x_ptr, w_ptr, y_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr,
                       PDL: tl.constexpr = False, PAIR_FMA: tl.constexpr = False):
    """Y [M, N] = X [M, K] W^T for a few rows (``matvec_rows_launch``), each row as matvec_kernel
    computes it. Grid [ceil(N / BLOCK_N), ceil(M / R)]."""
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r0 = tl.program_id(1) * R
    y0, y1, y2, y3 = _matvec_few_rows(x_ptr, w_ptr, tl.minimum(rows, N - 1), r0, M, N, K, GROUP, BLOCK_N, BLOCK_K, R,
                                      PAIR_FMA=PAIR_FMA)
    _store_rows(y_ptr, y0, y1, y2, y3, rows, r0, M, N, R)


@triton.jit
def _swiglu(g, u):
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def matvec_rows_swiglu_kernel(x_ptr, wg_ptr, wu_ptr, y_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                              GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr,
                              PDL: tl.constexpr = False, PAIR_FMA: tl.constexpr = False):
    """Y = silu(X Wg^T) * (X Wu^T) for a few rows, matvec_swiglu_kernel's product row by row (gate,
    then up)."""
    pdl_wait(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, N - 1)
    r0 = tl.program_id(1) * R
    g0, g1, g2, g3 = _matvec_few_rows(x_ptr, wg_ptr, rows_in, r0, M, N, K, GROUP, BLOCK_N, BLOCK_K, R,
                                      PAIR_FMA=PAIR_FMA)
    u0, u1, u2, u3 = _matvec_few_rows(x_ptr, wu_ptr, rows_in, r0, M, N, K, GROUP, BLOCK_N, BLOCK_K, R,
                                      PAIR_FMA=PAIR_FMA)
    _store_rows(y_ptr, _swiglu(g0, u0), _swiglu(g1, u1), _swiglu(g2, u2), _swiglu(g3, u3), rows, r0, M, N, R)
