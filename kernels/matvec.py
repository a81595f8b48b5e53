"""Matrix-vector product y = W @ x (W stored [out, in], as checkpoints store nn.Linear), fp32 accumulate."""
from __future__ import annotations

import torch


def matvec_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mv(w.float(), x.float())


# --- q4: weight-only int4, one f16 scale per group of G inputs (G = 32, 64 or 128) ---------------
#
# Layout of a q4 weight W [N, K] as one byte buffer (the contract with the GPU matvec kernels):
#   nibbles: N rows of K/2 bytes, row-major; byte j of a row holds input 2j in its low nibble and
#            2j+1 in its high nibble, so 16 bytes hold 32 consecutive inputs of one row: a warp
#            reading a row with 16-byte loads is perfectly coalesced, and a group of 128 is 4 loads;
#   scales:  then N rows of K/G float16 scales, row-major.
# Quantisation per group: the scale d is chosen to minimise the group's squared error. Candidates
# d = m / c, m the value of largest magnitude and c in [-9, -7] (c = -8 is llama.cpp's Q4_0 rule), each
# with q = clamp(round(w / d) + 8, 0, 15); the best is then refitted by least squares for its q
# (d = sum(w (q-8)) / sum((q-8)^2)). Dequantised w' = (q - 8) * d, d stored as float16.

Q4_SCALE_CANDIDATES = [-9.0 + 0.2 * i for i in range(11)]


def q4_quantize(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q uint8 [N, K] in 0..15, scales float16 [N, K/G])."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    m = torch.gather(g, -1, g.abs().argmax(dim=-1, keepdim=True))
    best_q, best_err = None, None
    for c in Q4_SCALE_CANDIDATES:
        d = m / c
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = torch.clamp(torch.round(g * inv) + 8, 0, 15)
        err = ((q - 8) * d - g).pow(2).sum(-1, keepdim=True)
        if best_q is None:
            best_q, best_err = q, err
        else:
            better = err < best_err
            best_q, best_err = torch.where(better, q, best_q), torch.minimum(err, best_err)
    qs = best_q - 8
    den = qs.pow(2).sum(-1, keepdim=True)
    d = torch.where(den > 0, (g * qs).sum(-1, keepdim=True) / den.clamp_min(1), torch.zeros_like(den))
    return best_q.to(torch.uint8).reshape(n, k), d.to(torch.float16).reshape(n, k // group)


def q4_pack(w: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K] float -> the q4 byte buffer described above (uint8, 1-D)."""
    q, scales = q4_quantize(w, group)
    nib = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return torch.cat([nib.reshape(-1), scales.contiguous().view(torch.uint8).reshape(-1)])


def q4_unpack(buf: torch.Tensor, n: int, k: int, group: int) -> torch.Tensor:
    """The q4 byte buffer -> dequantised float32 [N, K]."""
    nib = buf[: n * k // 2].reshape(n, k // 2)
    scales = buf[n * k // 2:].contiguous().view(torch.float16).reshape(n, k // group).float()
    q = torch.stack([nib & 0xF, nib >> 4], dim=-1).reshape(n, k).float()
    return ((q - 8.0).reshape(n, k // group, group) * scales[:, :, None]).reshape(n, k)


def matvec_swiglu_ref(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """silu(Wg @ x) * (Wu @ x): the MLP's gate and up projections with their epilogue."""
    return torch.nn.functional.silu(matvec_ref(x, w_gate)) * matvec_ref(x, w_up)


# --- launch rules ------------------------------------------------------------------------------

def matvec_launch(n: int, k: int, group: int, target) -> dict:
    """Rows per CTA chosen so the grid covers every SM at least twice when there are enough rows;
    each CTA streams BLOCK_K inputs per iteration with 16-byte loads. GROUP is the q4 group (0: not q4)."""
    from kestrel.kernels.targets import pow2_at_least

    block_n = 1
    while block_n < 16 and (n + 2 * block_n - 1) // (2 * block_n) >= 2 * target.sms:
        block_n *= 2
    block_k = min(512, pow2_at_least(k))
    if group:
        block_k = max(block_k, group)
    return {"grid": [(n + block_n - 1) // block_n, 1, 1], "num_warps": 4,
            "constexprs": {"N": n, "K": k, "GROUP": group, "BLOCK_N": block_n, "BLOCK_K": block_k}}
