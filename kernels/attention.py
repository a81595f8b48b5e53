"""Gated attention decode over a KV cache of max_seq rows.

* ``rope_ref``: NeoX-style rotary embedding on the first ``rotary_dim`` dims of each head at ``pos``
  (partial RoPE), the rest passes through; cos/sin computed in fp32 as the reference model does;
* ``kv_append_ref``: write k, v into row ``pos`` of the caches;
* ``attention_ref``: softmax(q K[0..pos]^T * scale) V in fp32, query head h reading kv head h // (H / Hkv).
"""
from __future__ import annotations

import torch


def rope_inv_freq(theta: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def rope_ref(x: torch.Tensor, pos: int, theta: float, rotary_dim: int) -> torch.Tensor:
    freqs = torch.tensor([float(pos)], dtype=torch.float32)[:, None] * rope_inv_freq(theta, rotary_dim)
    emb = torch.cat([freqs, freqs], dim=-1)[0]  # [rotary_dim]
    cos, sin = emb.cos(), emb.sin()
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
