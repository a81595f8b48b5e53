"""RMSNorm family, always computed in fp32.

* ``rmsnorm_ref``: the zero-centred norm of Qwen3.5 / Qwen3-Next, x * rsqrt(mean(x^2) + eps) * (1 + w),
  over the last axis (used on the residual stream and per head on q and k);
* ``gated_rmsnorm_ref``: the Gated DeltaNet output norm, plain w, times silu(z).
"""
from __future__ import annotations

import torch


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w.float())


def gated_rmsnorm_ref(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w.float() * y * torch.nn.functional.silu(z.float())
