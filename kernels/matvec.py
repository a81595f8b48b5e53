"""Matrix-vector product y = W @ x (W stored [out, in], as checkpoints store nn.Linear), fp32 accumulate."""
from __future__ import annotations

import torch


def matvec_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mv(w.float(), x.float())
