"""The bf16 matrix product for a few rows of x on the tensor cores: y [M, N] = x [M, K] @ W^T, W bf16 [N, K]
row-major (the one-token matvec's layout, unchanged), 1 <= M <= 16: a speculative verify's K + 1 rows and
short prefill chunks of bf16 plans.

Why: at a few rows the Triton few-rows matvec (kernels/matvec.py) multiplies on the CUDA cores, M FMAs per
weight. Here each weight is multiplied by every row of x in one MMA instruction, as kernels/q4_mma.py does for
q4; the CUDA source is q4_mma's with ``WBF16`` (one kernel, one set of launch forms: the ring, persistence,
clusters, the folded residual add and norm of passes/fold_row_norms.py). Measured (bench/results/stop28): on
the 0.8B matrices 4 rows take the one-row matvec's time, 1.2-1.6x less than the few-rows matvec; on the 27B
matrices it is 0.92-1.05x the few-rows matvec (the same DRAM rate at a fifth of the issued instructions: the
few-rows matvec was not issue-bound there), so the rule (``max_weight_bytes``) leaves those to it.

The fragments. A lane's 16-byte load of a weight row (8 consecutive bf16) is the four bf16x2 pairs
(0, 1) .. (6, 7) that q4_mma's dequantisation makes of one q4 word: GROUP 32 (a warp reads 16 rows x 32
inputs a group, 64 bytes a row, as q4 group 128 does). x cannot be a bf16 operand as it is (8 bits of
mantissa): each row is staged as two bf16 rows, hi = bf16(x) and lo = bf16(x - hi) (x = hi + lo to
2^-16 |x|), at MMA columns 2t and 2t + 1, so 4 rows of x fill the MMA's 8 columns and each lane adds its
two columns at the end. Products of bf16 values are exact in the fp32 accumulator.

The reference (``bf16_mma_ref``): (hi + lo) @ W^T in float64. The GPU accumulates in fp32 in its own order:
not bit for bit, and not bit for bit with the one-token matvec (fp32 x times bf16 W): a verified row's
logits differ from the one-token step's in the last bits (README: speculative decoding on the GPU). The
rule ``bf16_mma.max_rows=0`` (KESTREL_RULES) keeps the few-rows matvec.
"""
from __future__ import annotations

import torch

from kestrel.kernels import q4_mma
from kestrel.kernels.q4_mma import SOURCE, CudaKernel, shared_bytes

GROUP = 32  # inputs per group: a lane's 16-byte word of rows g and g + 8, 4 lanes a group


def split_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (fp32) as the kernel stages it: hi = bf16(x), lo = bf16(x - hi)."""
    hi = x.float().bfloat16()
    return hi, (x.float() - hi.float()).bfloat16()


def bf16_mma_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (fp32), w bf16 [N, K] -> y [M, N] as the kernel defines it: (hi + lo) @ w^T in float64, to fp32."""
    hi, lo = split_x(x)
    return ((hi.double() + lo.double()) @ w.double().T).float()


def bf16_mma_swiglu_ref(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
    g, u = bf16_mma_ref(x, wg), bf16_mma_ref(x, wu)
    return g / (1.0 + torch.exp(-g)) * u


def rule_launch(m: int, n: int, k: int, target, pair: bool = False, norm: bool = False) -> dict | None:
    """The launch ``target.rules["bf16_mma"]`` gives a bf16 matmul at m rows, or None (the few-rows matvec or
    the GEMM then): q4_mma's rule logic, with bf16 words."""
    return q4_mma.rule_launch(m, n, k, GROUP, target, pair=pair, norm=norm, bf16=True)


def add_launch(m: int, n: int, k: int, target) -> dict | None:
    """matmul_add at m rows (passes/fold_row_norms.py), as q4_mma.add_launch."""
    return q4_mma.add_launch(m, n, k, GROUP, target, bf16=True)


def _w(w, n: int, k: int) -> torch.Tensor:
    return w[:n * k].reshape(n, k)


def _check(grid, N, RB, CS, PERSIST, WBF16, GROUP_):
    q4_mma._check_grid(grid, N, RB, CS, PERSIST)
    assert WBF16 == 1 and GROUP_ == GROUP


def _emulate(swiglu: bool):
    def run(grid, x, *rest, M, N, K, GROUP, RB, KS, CS, DEPTH, SWIGLU, WBF16, STAGES=0, PERSIST=0, PDL=False):
        _check(grid, N, RB, CS, PERSIST, WBF16, GROUP)
        ws, y = [_w(w, N, K) for w in rest[:-1]], rest[-1]
        xm = x[:M * K].reshape(M, K)
        out = bf16_mma_swiglu_ref(xm, *ws) if swiglu else bf16_mma_ref(xm, ws[0])
        y[:M * N] = out.reshape(-1)
    return run


def _emulate_add(grid, x, w, r, s, ss, partial_rows, *, M, N, K, GROUP, RB, KS, CS, DEPTH, SWIGLU, WBF16, ADD,
                 BLOCK_N, STAGES=0, PERSIST=0, PDL=False):
    """matmul_add at M rows: s = r + the product, ss [M, N / 16] each row block's sum of s^2."""
    _check(grid, N, RB, CS, PERSIST, WBF16, GROUP)
    assert ADD == 1 and partial_rows == BLOCK_N
    out = r[:M * N].reshape(M, N) + bf16_mma_ref(x[:M * K].reshape(M, K), _w(w, N, K))
    s[:M * N] = out.reshape(-1)
    ss[:M * (N // BLOCK_N)] = (out.double() ** 2).reshape(M, N // BLOCK_N, BLOCK_N).sum(-1).float().reshape(-1)


def _emulate_norm(swiglu: bool):
    """rmsnorm_matmul(_swiglu) at M rows: the product of x * rstd * (1 + nw), rstd from the NP partials."""
    def run(grid, x, ss, nw, *rest, M, N, K, GROUP, RB, KS, CS, DEPTH, SWIGLU, WBF16, NORM, NP, STAGES=0,
            PERSIST=0, PDL=False):
        _check(grid, N, RB, CS, PERSIST, WBF16, GROUP)
        assert NORM == 1
        *ws, y, eps = rest
        rstd = torch.rsqrt(ss[:M * NP].reshape(M, NP).double().sum(-1, keepdim=True) / K + eps).float()
        xm = x[:M * K].reshape(M, K) * rstd * (1.0 + nw[:K].float())
        ws = [_w(w, N, K) for w in ws]
        out = bf16_mma_swiglu_ref(xm, *ws) if swiglu else bf16_mma_ref(xm, ws[0])
        y[:M * N] = out.reshape(-1)
    return run


_CONSTS = q4_mma.Q4MMA_ROWS.constexprs + ("WBF16",)
BF16MMA_ROWS = CudaKernel("bf16mma_rows", __name__, SOURCE, ("x_ptr", "w_ptr", "y_ptr"), _CONSTS, shared_bytes,
                          _emulate(False))
BF16MMA_ROWS_SWIGLU = CudaKernel("bf16mma_rows_swiglu", __name__, SOURCE, ("x_ptr", "wg_ptr", "wu_ptr", "y_ptr"),
                                 _CONSTS, shared_bytes, _emulate(True))
BF16MMA_ADD = CudaKernel("bf16mma_add", __name__, SOURCE, q4_mma.Q4MMA_ADD.params, _CONSTS + ("ADD", "BLOCK_N"),
                         shared_bytes, _emulate_add)
BF16MMA_NORM = CudaKernel("bf16mma_norm", __name__, SOURCE, q4_mma.Q4MMA_NORM.params, _CONSTS + ("NORM", "NP"),
                          shared_bytes, _emulate_norm(False))
BF16MMA_NORM_SWIGLU = CudaKernel("bf16mma_norm_swiglu", __name__, SOURCE, q4_mma.Q4MMA_NORM_SWIGLU.params,
                                 _CONSTS + ("NORM", "NP"), shared_bytes, _emulate_norm(True))
# the kernel table names these through jit_name ("kestrel.kernels.bf16_mma:bf16mma_rows")
bf16mma_rows = BF16MMA_ROWS
bf16mma_rows_swiglu = BF16MMA_ROWS_SWIGLU
bf16mma_add = BF16MMA_ADD
bf16mma_norm = BF16MMA_NORM
bf16mma_norm_swiglu = BF16MMA_NORM_SWIGLU
