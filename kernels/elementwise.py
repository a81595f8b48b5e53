"""Elementwise ops of the step: residual add, output gate, SwiGLU, L2 normalisation; the views
(reshape, slice) as the CPU reference runs them."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def add_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def sigmoid_gate_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate)


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def l2norm_ref(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def reshape_ref(x: torch.Tensor, shape) -> torch.Tensor:
    return x.reshape(shape)


def slice_ref(x: torch.Tensor, axis: int, start: int, stop: int) -> torch.Tensor:
    return x.narrow(axis, start, stop - start)
