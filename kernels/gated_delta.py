"""Gated DeltaNet decode step (one token), state in fp32.

* ``conv1d_step_ref``: depthwise causal conv of kernel K over [last K-1 inputs | x], then SiLU;
  the state keeps the last K-1 inputs, oldest first;
* ``gdn_gates_ref``: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b);
* ``gated_delta_step_ref``: per value head j (reading key head j // (Hv / Hk)):
  S = S * exp(g); S += k (outer) beta * (v - S^T k); o = S^T (q * scale).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def conv1d_step_ref(x: torch.Tensor, state: torch.Tensor, w: torch.Tensor, act: str) -> torch.Tensor:
    """x [C], state [C, K-1] (updated in place), w [C, K]."""
    window = torch.cat([state, x[:, None].to(state.dtype)], dim=1)  # [C, K], oldest first
    out = (window * w.float()).sum(dim=1)
    state.copy_(window[:, 1:])
    return F.silu(out) if act == "silu" else out


def gdn_gates_ref(a, b, a_log, dt_bias):
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def gated_delta_step_ref(q, k, v, g, beta, state: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k [Hk, Dk]; v [Hv, Dv]; g, beta [Hv]; state [Hv, Dk, Dv] fp32, updated in place."""
    rep = v.shape[0] // q.shape[0]
    q = q.float().repeat_interleave(rep, dim=0) * scale  # [Hv, Dk]
    k = k.float().repeat_interleave(rep, dim=0)
    s = state * g.exp()[:, None, None]
    kv_mem = (s * k[:, :, None]).sum(dim=1)  # S^T k: [Hv, Dv]
    delta = (v.float() - kv_mem) * beta[:, None]
    s = s + k[:, :, None] * delta[:, None, :]
    state.copy_(s)
    return (s * q[:, :, None]).sum(dim=1)


def gdn_step_ref(qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w, rec_state, eps: float, l2_eps: float,
                 scale: float) -> torch.Tensor:
    """The whole Gated DeltaNet token mixer after its input projections, as one step:
    conv1d update + SiLU, split q|k|v, L2-normalise q and k, gates, delta rule, gated RMSNorm.
    Composed from the single-op references in the same order, so it matches them bit for bit."""
    from kestrel.kernels.elementwise import l2norm_ref
    from kestrel.kernels.rmsnorm import gated_rmsnorm_ref

    hv, dk, dv = rec_state.shape
    hk = (qkv.shape[0] - hv * dv) // (2 * dk)
    mixed = conv1d_step_ref(qkv, conv_state, conv_w, "silu")
    q = l2norm_ref(mixed[: hk * dk].reshape(hk, dk), l2_eps)
    k = l2norm_ref(mixed[hk * dk: 2 * hk * dk].reshape(hk, dk), l2_eps)
    v = mixed[2 * hk * dk:].reshape(hv, dv)
    g, beta = gdn_gates_ref(a, b, a_log, dt_bias)
    o = gated_delta_step_ref(q, k, v, g, beta, rec_state, scale)
    return gated_rmsnorm_ref(o, z.reshape(hv, dv), norm_w, eps).reshape(hv * dv)


def gdn_step_launch(hk: int, hv: int, dk: int, dv: int, kc: int, target) -> dict:
    """One CTA per value head: it needs the head's whole q, k (L2 norms) and v row (gated norm)."""
    from kestrel.kernels.targets import pow2_at_least

    return {"grid": [hv, 1, 1], "num_warps": 4,
            "constexprs": {"HK": hk, "HV": hv, "DK": dk, "DV": dv, "KC": kc,
                           "BLOCK_DK": pow2_at_least(dk), "BLOCK_DV": pow2_at_least(dv)}}
