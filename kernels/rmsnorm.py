"""RMSNorm family, always computed in fp32.

* ``rmsnorm_ref``: the zero-centred norm of Qwen3.5 / Qwen3-Next, x * rsqrt(mean(x^2) + eps) * (1 + w),
  over the last axis (used on the residual stream and per head on q and k);
* ``gated_rmsnorm_ref``: the Gated DeltaNet output norm, plain w, times silu(z).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.pdl import pdl_wait
from kestrel.kernels.targets import pow2_at_least


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w.float())


def gated_rmsnorm_ref(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w.float() * y * torch.nn.functional.silu(z.float())


def add_rmsnorm_ref(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float):
    """Residual add fused with the next norm: returns (x + y, rmsnorm(x + y))."""
    s = x + y
    return s, rmsnorm_ref(s, w, eps)


def rmsnorm_launch(shape: tuple, target) -> dict:
    """One CTA per row (a single row at M = 1; per-head norms have one row per head). num_warps from
    ``target.rules["rmsnorm"]`` (kernels/targets.py; sm_90: 8 for rows of >= 2048, else 4)."""

    r = target.rules["rmsnorm"]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    n = shape[-1]
    return {"grid": [rows, 1, 1], "num_warps": r.wide_warps if n >= r.wide_n else r.num_warps,
            "constexprs": {"N": n, "BLOCK": pow2_at_least(n)}}


@triton.jit
def _rmsnorm_row(x, w_ptr, cols, mask, eps, N: tl.constexpr):
    var = tl.sum(x * x, axis=0) / N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return x * (1.0 / tl.sqrt(var + eps)) * (1.0 + w)


@triton.jit
def rmsnorm_kernel(x_ptr, w_ptr, out_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Zero-centred RMSNorm of one row of N per program (grid: rows), in fp32."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, _rmsnorm_row(x, w_ptr, cols, mask, eps, N), mask=mask)


@triton.jit
def add_rmsnorm_kernel(x_ptr, y_ptr, w_ptr, sum_ptr, out_ptr, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """s = x + y (the residual stream), out = rmsnorm(s): one row of N per program."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    s = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32) + \
        tl.load(y_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(sum_ptr + row + cols, s, mask=mask)
    tl.store(out_ptr + row + cols, _rmsnorm_row(s, w_ptr, cols, mask, eps, N), mask=mask)
