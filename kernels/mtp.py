"""The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next: the drafter of ``--speculative mtp``.

What it computes (``mtp_forward_ref``; the semantics of vLLM's ``Qwen3_5MultiTokenPredictor.forward``
and ``Qwen3NextMultiTokenPredictor.forward``, vllm/model_executor/models/qwen3_5_mtp.py and
qwen3_next_mtp.py, driven by ``EagleProposer.propose`` in vllm/v1/spec_decode/eagle.py): at a row
for position t, with h_t the target model's hidden state at t AFTER its final norm (what the target
model's forward returns) and x_{t+1} the token that follows t,

    e = rmsnorm(embed(x_{t+1}), pre_fc_norm_embedding)      h = rmsnorm(h_t, pre_fc_norm_hidden)
    u = fc([e | h])                                         (fc: [H, 2H], embedding half first)
    u = u + attn(rmsnorm(u, input_layernorm), at position t, the head's own KV cache)
    u = u + mlp(rmsnorm(u, post_attention_layernorm))       (one gated-attention decoder layer)
    m = rmsnorm(u, norm);  logits = lm_head(m)              (the model's lm_head; argmax: x_{t+2})

The layer's MLP is the model's kind: Qwen3.5's dense SwiGLU MLP, or Qwen3-Next's sparse MoE block (router
``mlp.gate``, top-k experts ``mlp.experts.N.*``, the shared expert gated by ``mlp.shared_expert_gate``;
kernels/moe.py has its semantics). vLLM's Qwen3NextMultiTokenPredictor builds the layer as a
Qwen3NextDecoderLayer with layer_type full_attention and the layer index of its prefix (0), so it has a MoE
block exactly when the model's layer 0 has one (every released Qwen3-Next).

All norms are the model's zero-centred ones. The rope / KV position of the row is t, the position of
the hidden state (vLLM feeds the target's positions with the input ids shifted left by one). A chain
of drafts continues from m: the next row is at position t + 1 with the draft x_{t+2} as token and m
itself as hidden state (vLLM's ``method == "mtp"`` loop: the head's returned hidden states are the
next step's, positions += 1).

The compiled form (compiler/qwen3_5.py, ``lower_speculative``) is made of the model's own ops plus
``concat`` (here: the [e | h] join) and runs one MTP row per draft; ``mtp_forward_ref`` is the whole
head over a sequence in plain torch (differentiable: tests train a head with it), the reference the
compiled drafts are checked against.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kestrel.kernels.attention import rope_inv_freq
from kestrel.kernels.moe import route_ref
from kestrel.kernels.pdl import pdl_wait
from kestrel.kernels.targets import pow2_at_least


def concat_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[.., A] and [.., B] (same leading shape) -> [.., A + B]: x's columns first."""
    return torch.cat([x.float(), y.float()], dim=-1)


def concat_launch(rows: int, a: int, b: int, target) -> dict:
    """Grid [rows, (A + B) / BLOCK] (``target.rules["speculative"]``)."""
    r = target.rules["speculative"]
    block = min(r.block, pow2_at_least(a + b))
    return {"grid": [rows, -(-(a + b) // block), 1], "num_warps": r.num_warps,
            "constexprs": {"A": a, "B": b, "BLOCK": block}}


@triton.jit
def concat_kernel(x_ptr, y_ptr, out_ptr, A: tl.constexpr, B: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr = False):
    """``concat_ref``: program (r, c) writes columns c * BLOCK .. of row r (x's, then y's)."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_x = offs < A
    in_y = (offs >= A) & (offs < A + B)
    xv = tl.load(x_ptr + r * A + offs, mask=in_x, other=0.0).to(tl.float32)
    yv = tl.load(y_ptr + r * B + (offs - A), mask=in_y, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * (A + B) + offs, tl.where(in_x, xv, yv), mask=in_x | in_y)


# --- the head in plain torch --------------------------------------------------------------------------

def _norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x, positions, theta: float, rotary_dim: int, yarn=None):
    """NeoX rotary on the first rotary_dim dims of x [T, heads, D] at positions [T] (rope_ref's frequencies and,
    with YaRN, its attention factor)."""
    f = positions.float()[:, None] * rope_inv_freq(theta, rotary_dim, yarn)[None, :]
    emb = torch.cat([f, f], dim=-1)[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if yarn:
        cos, sin = cos * yarn[3], sin * yarn[3]
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


def mtp_dims(cfg) -> dict:
    """``mtp_forward_ref``'s shape keywords from a model config (compiler/frontend.py's ModelConfig)."""
    return dict(heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                rotary_dim=cfg.rotary_dim, theta=cfg.rope_theta, yarn=cfg.rope_yarn or None, eps=cfg.rms_norm_eps,
                top_k=cfg.num_experts_per_tok, norm_topk=cfg.norm_topk_prob)


def _mlp_ref(W, w: dict, p: str, x: torch.Tensor, top_k: int, norm_topk: bool) -> torch.Tensor:
    """The MLP of the decoder layer at ``p`` on x [T, H]: dense SwiGLU, or with ``p + "mlp.gate.weight"`` in w
    the sparse MoE block (route_ref's top_k of the router's softmax, renormalised when norm_topk; the shared
    expert times sigmoid(shared_expert_gate . x)), experts by checkpoint name. Differentiable (tests train a
    head with it): every expert runs on every row, weighted by its routing weight there (0 where not routed)."""
    def swiglu(q):
        g, u = x @ W(q + "gate_proj.weight").T, x @ W(q + "up_proj.weight").T
        return (torch.nn.functional.silu(g) * u) @ W(q + "down_proj.weight").T

    m = p + "mlp."
    if m + "gate.weight" not in w:
        return swiglu(m)
    if top_k < 1:
        raise ValueError("a head with a MoE block needs top_k (mtp_dims gives it from the config)")
    probs = torch.softmax(x @ W(m + "gate.weight").T, dim=-1)
    ids, vals = route_ref(probs, top_k)
    if norm_topk:
        vals = vals / vals.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for e in range(probs.shape[-1]):
        y = y + (vals * (ids == e)).sum(-1, keepdim=True) * swiglu(f"{m}experts.{e}.")
    return y + torch.sigmoid(x @ W(m + "shared_expert_gate.weight").T) * swiglu(m + "shared_expert.")


def mtp_forward_ref(w: dict, emb_next: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, *, heads: int,
                    kv_heads: int, head_dim: int, rotary_dim: int, theta: float, eps: float, top_k: int = 0,
                    norm_topk: bool = True, yarn=None, past: tuple[torch.Tensor, torch.Tensor] | None = None):
    """The MTP head over T rows, causally (row i attends to ``past`` and rows 0..i).

    ``w``: the head's tensors by checkpoint name without the ``mtp.`` prefix (``fc.weight``,
    ``layers.0.self_attn.q_proj.weight``, ...; a Qwen3-Next head's experts one tensor each,
    ``layers.0.mlp.experts.N.gate_proj.weight``); ``emb_next`` [T, H]: embeddings of x_{t+1};
    ``hidden`` [T, H]: the target's final-normed hidden states h_t (or the head's own m for a draft
    chain); ``positions`` [T]: t. ``top_k`` / ``norm_topk``: the MoE block's routing; ``yarn``: YaRN's RoPE
    (ModelConfig.rope_yarn, or None) (``mtp_dims`` gives
    every keyword from a config). ``past``: keys and values [P, kv_heads, D] of earlier rows (after
    norm and rope), or None. Returns (m [T, H] after the head's final norm, (keys, values) of past +
    these rows)."""
    def W(name):
        return w[name].float()

    e = _norm(emb_next.float(), W("pre_fc_norm_embedding.weight"), eps)
    h = _norm(hidden.float(), W("pre_fc_norm_hidden.weight"), eps)
    u = torch.cat([e, h], dim=-1) @ W("fc.weight").T
    p, t, d = "layers.0.", u.shape[0], head_dim
    x = _norm(u, W(p + "input_layernorm.weight"), eps)
    qg = (x @ W(p + "self_attn.q_proj.weight").T).reshape(t, heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, heads * d)
    k = (x @ W(p + "self_attn.k_proj.weight").T).reshape(t, kv_heads, d)
    v = (x @ W(p + "self_attn.v_proj.weight").T).reshape(t, kv_heads, d)
    q = _rope(_norm(q, W(p + "self_attn.q_norm.weight"), eps), positions, theta, rotary_dim, yarn)
    k = _rope(_norm(k, W(p + "self_attn.k_norm.weight"), eps), positions, theta, rotary_dim, yarn)
    keys = k if past is None else torch.cat([past[0], k])
    values = v if past is None else torch.cat([past[1], v])
    n = keys.shape[0]
    rep = heads // kv_heads
    kk, vv = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)  # [n, heads, d]
    scores = torch.einsum("thd,nhd->thn", q, kk) / math.sqrt(d)
    causal = torch.arange(n)[None, :] <= (torch.arange(t) + n - t)[:, None]  # row i sees past + rows 0..i
    scores = scores.masked_fill(~causal[:, None, :], float("-inf"))
    o = torch.einsum("thn,nhd->thd", torch.softmax(scores, dim=-1), vv).reshape(t, heads * d)
    u = u + (o * torch.sigmoid(gate)) @ W(p + "self_attn.o_proj.weight").T
    u = u + _mlp_ref(W, w, p, _norm(u, W(p + "post_attention_layernorm.weight"), eps), top_k, norm_topk)
    return _norm(u, W("norm.weight"), eps), (keys, values)
