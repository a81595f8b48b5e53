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


def attn_step_ref(qg, k, v, q_norm, k_norm, k_cache, v_cache, pos: int, eps: float, theta: float, rotary_dim: int,
                  scale: float) -> torch.Tensor:
    """The gated attention token mixer after its input projections, as one step: split q|gate per
    head, q/k RMSNorm, partial RoPE at pos, KV append at pos, GQA attention over 0..pos, sigmoid gate.
    Composed from the single-op references in the same order, so it matches them bit for bit."""
    from kestrel.kernels.elementwise import sigmoid_gate_ref
    from kestrel.kernels.rmsnorm import rmsnorm_ref

    _, hkv, d = k_cache.shape
    nh = qg.shape[0] // (2 * d)
    qg = qg.reshape(nh, 2 * d)
    q = rope_ref(rmsnorm_ref(qg[:, :d], q_norm, eps), pos, theta, rotary_dim)
    kr = rope_ref(rmsnorm_ref(k.reshape(hkv, d), k_norm, eps), pos, theta, rotary_dim)
    kv_append_ref(k_cache, v_cache, kr, v.reshape(hkv, d), pos)
    o = attention_ref(q, k_cache, v_cache, pos, scale).reshape(nh * d)
    return sigmoid_gate_ref(o, qg[:, d:].reshape(nh * d))


def attn_step_launch(n_heads: int, n_kv: int, head_dim: int, max_seq: int, target) -> dict:
    """One CTA per query head, walking the cache in BLOCK_S rows."""
    from kestrel.kernels.targets import pow2_at_least

    return {"grid": [n_heads, 1, 1], "num_warps": 4,
            "constexprs": {"NH": n_heads, "NKV": n_kv, "D": head_dim, "S": max_seq,
                           "BLOCK_D": pow2_at_least(head_dim), "BLOCK_S": 64}}
