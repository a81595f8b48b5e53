"""The M-row step's projections: Y [M, N] = X [M, K] @ W [N, K]^T on tensor cores (issue 11, part 2).

X is the fp32 activation rows; W is bf16, or q4 in the layout of kernels/matvec.py (N rows of K/8
32-bit words of nibbles, interleaved within a word, then N x K/G f16 scales), dequantised inside
the kernel. Both operands enter the tensor cores as bf16 (X rounded to bf16, a q4 weight's
(q - 8) * scale rounded to bf16), products accumulate in fp32, Y is fp32. ``gemm_ref`` computes
exactly those roundings with a plain fp32 product, so kernel and reference differ only in summation
order; against the fp32 CPU reference of the one-token step the bf16 roundings bound the error
(~2^-8 relative per operand).

``matmul`` and ``matmul_swiglu`` at M rows run here (compiler/ops.py: the ops' ``rows`` kernels);
``gemm_swiglu_kernel`` computes the gate and up tiles in one program and writes silu(g) * u.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.attention import _round_bf16
from kestrel.kernels.matvec import _q4_unpack_words, q4_unpack
from kestrel.kernels.pdl import pdl_wait


def gemm_ref(x: torch.Tensor, w: torch.Tensor, group: int = 0) -> torch.Tensor:
    """The kernel's result computed plainly: x [M, K] and w (bf16 [N, K], or q4 bytes of [N, K] when
    ``group``) rounded to bf16 as the kernel rounds them, fp32 products and sums."""
    m, k = x.shape
    if group:
        n = w.numel() * 2 // (k + 4 * k // group)
        w = q4_unpack(w, n, k, group)
    return x.to(torch.bfloat16).float() @ w.to(torch.bfloat16).float().T


def gemm_swiglu_ref(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, group: int = 0) -> torch.Tensor:
    """``gemm_swiglu_kernel``'s result computed plainly: silu(x Wg^T) * (x Wu^T), each as ``gemm_ref``."""
    g = gemm_ref(x, wg, group)
    return g * torch.sigmoid(g) * gemm_ref(x, wu, group)


def gemm_launch(m: int, n: int, k: int, group: int, target, swiglu: bool = False) -> dict:
    """Tiles of BLOCK_M x BLOCK_N outputs, BLOCK_K inputs a step, from ``target.rules["gemm"]`` (sm_90: the
    best of a sweep on the H200, bench/results/tuning/gemm-sweep-h200.json: bf16 128 x 256 x 64 with 8
    warps for many rows, 64-row tiles for few; q4 128 x 64 tiles, 128 x 128 x 128 for the widest N),
    shrunk to the problem where it is smaller. At a few rows (m <= skinny_rows [16], a verify step's
    k + 1) the weight read, not the products, bounds the time: bf16 16 x 64 x 256 tiles with 2 warps,
    within 1.11x of the best of 48 configurations at every 27B projection at 4 rows, where the
    few-rows tiles were 1.2-2.2x off; q4 16 x 64 x 128 with 8 warps, within 1.20x (the wide-N tiles were
    1.26x off at the MLP's 17408 rows; bench/results/tuning/gemm-skinny-sweep-h200.json). ``swiglu``
    at a few rows: its own tiles, BLOCK_N not halved (the best of 48 on the 27B MLP's gate and up at 4
    rows: bf16 16 x 128 x 128 with 2 warps, q4 16 x 64 x 128 with 4, where the halved few-rows tiles
    were 1.23x and 1.42x slower; gemm-skinny-swiglu-sweep-h200.json)."""
    r = target.rules["gemm"]
    if m <= r.skinny_rows:
        if swiglu:
            bm, bn, bk, nw = r.q4_skinny_swiglu if group else r.bf16_skinny_swiglu
        else:
            bm, bn, bk, nw = r.q4_skinny if group else r.bf16_skinny
    elif group:
        bm, bn, bk, nw = r.q4_wide if n >= r.wide_n else (r.q4_many if m >= r.many_rows else r.q4_few)
    else:
        bm, bn, bk, nw = r.bf16_many if m >= r.many_rows else (r.bf16_few_wide if n >= r.wide_n else r.bf16_few)
    if swiglu and m > r.skinny_rows:  # two accumulators per tile
        bn = max(16, bn // 2)
    block_m = min(bm, max(16, triton.next_power_of_2(m)))
    block_n = min(bn, max(16, triton.next_power_of_2(n)))
    block_k = min(bk, max(16, triton.next_power_of_2(k)))  # (a q4 tile reads each input's own group scale)
    grid = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return {"grid": [grid, 1, 1], "num_warps": nw,
            "constexprs": {"M": m, "N": n, "K": k, "GROUP": group, "BLOCK_M": block_m, "BLOCK_N": block_n,
                           "BLOCK_K": block_k, "DOT_FP32": False}}


@triton.jit
def _to_bf16(x, SOFT_ROUND: tl.constexpr):
    """x (fp32) rounded to the nearest bf16, ties to even: the GPU's conversion does it in one
    instruction; Triton's interpreter truncates, so the tests (SOFT_ROUND) round in software first."""
    if SOFT_ROUND:
        x = _round_bf16(x)
    return x.to(tl.bfloat16)


@triton.jit
def _w_tile(w_ptr, cols, k0, ks, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """W[cols, ks] as bf16 [BLOCK_N, BLOCK_K] (rows past N clamped by the caller, inputs past K zero)."""
    if GROUP > 0:
        j = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # word j holds inputs 8j..8j+7 (kernels/matvec.py's layout)
        words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + cols.to(tl.int64)[:, None] * (K // 8) + j[None, :],
                        mask=(j < K // 8)[None, :], other=0)
        q = _q4_unpack_words(words, BLOCK_N, BLOCK_K).to(tl.float32) - 8.0
        sp = (w_ptr + N * K // 2).to(tl.pointer_type(tl.float16)) + cols.to(tl.int64)[:, None] * (K // GROUP)
        if GROUP % BLOCK_K == 0:  # the tile lies inside one group: one scale per row, broadcast
            s = tl.load(sp + k0 // GROUP).to(tl.float32)
        else:
            s = tl.load(sp + (ks // GROUP)[None, :], mask=(ks < K)[None, :], other=0.0).to(tl.float32)
        return _to_bf16(q * s, SOFT_ROUND)
    else:
        w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        return w.to(tl.bfloat16)


@triton.jit
def _gemm_tile(x_ptr, w_ptr, rows_in, cols_in, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """X[rows_in] @ W[cols_in]^T as an fp32 [BLOCK_M, BLOCK_N] tile: a K loop of bf16 tensor-core
    products accumulated in fp32 (fixed order)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows_in.to(tl.int64)[:, None] * K + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        x = _to_bf16(x.to(tl.float32), DOT_FP32)
        w = _w_tile(w_ptr, cols_in, k0, ks, N, K, GROUP, BLOCK_N, BLOCK_K, DOT_FP32)
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def gemm_kernel(x_ptr, w_ptr, y_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                PDL: tl.constexpr = False):
    """Program p computes the [BLOCK_M, BLOCK_N] tile (p // tiles_n, p % tiles_n) of Y = X W^T: a K loop
    of bf16 tensor-core products accumulated in fp32. Deterministic (one program per output tile).
    DOT_FP32 (tests only: Triton's interpreter computes bf16 dots wrongly and truncates conversions)
    feeds the dot the same bf16-rounded values (rounded in software) as fp32, which gives the same
    products (exact in fp32 and in TF32)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, M - 1)  # clamped for the loads, masked at the store
    cols_in = tl.minimum(cols, N - 1)
    acc = _gemm_tile(x_ptr, w_ptr, rows_in, cols_in, N, K, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc,
             mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def gemm_swiglu_kernel(x_ptr, wg_ptr, wu_ptr, y_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_FP32: tl.constexpr, PDL: tl.constexpr = False):
    """``gemm_swiglu_ref``: the tile of silu(X Wg^T) * (X Wu^T), both products as in gemm_kernel (two
    fp32 accumulators; the launch rule halves BLOCK_N for them)."""
    pdl_wait(PDL)
    pid = tl.program_id(0)
    tiles_n: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    rows = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, M - 1)
    cols_in = tl.minimum(cols, N - 1)
    g = _gemm_tile(x_ptr, wg_ptr, rows_in, cols_in, N, K, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)
    u = _gemm_tile(x_ptr, wu_ptr, rows_in, cols_in, N, K, GROUP, BLOCK_M, BLOCK_N, BLOCK_K, DOT_FP32)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], g * tl.sigmoid(g) * u,
             mask=(rows < M)[:, None] & (cols < N)[None, :])
