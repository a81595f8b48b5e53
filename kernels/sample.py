"""Token selection at the end of the step: greedy argmax, or seeded temperature / top-p sampling.

The random number is counter-based (a hash of seed and position, murmur3's 32-bit finaliser), so a
GPU kernel reproduces it exactly and a run repeats bit for bit with the same seed, with no RNG state
carried between steps.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def uniform_from(seed: int, pos: int) -> float:
    """A uniform float in [0, 1) with 24 bits, from (seed, pos) only."""
    x = (seed * 0x9E3779B1 + pos * 0x85EBCA77 + 0x165667B1) & _M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    x ^= x >> 16
    return (x >> 8) / float(1 << 24)


def sample_ref(logits: torch.Tensor, temperature: float, top_p: float, seed: int, pos: int) -> int:
    logits = logits.float()
    if temperature <= 0.0:
        return int(torch.argmax(logits))  # first index among equal maxima
    probs = torch.softmax(logits / temperature, dim=-1)
    p_sorted, idx = torch.sort(probs, descending=True, stable=True)
    csum = torch.cumsum(p_sorted, dim=0)
    keep = (csum - p_sorted) < top_p  # smallest prefix whose mass reaches top_p (always >= 1 token)
    kept = p_sorted[keep]
    target = uniform_from(seed, pos) * float(kept.sum())
    i = int(torch.searchsorted(torch.cumsum(kept, dim=0), torch.tensor([target]), right=True)[0])
    return int(idx[min(i, kept.numel() - 1)])


def sample_launch(vocab: int, target) -> dict:
    """One CTA over the vocabulary (argmax / top-p need a global view of the logits)."""
    return {"grid": [1, 1, 1], "num_warps": 16, "constexprs": {"V": vocab, "BLOCK": 4096}}


def step_end_launch(target) -> dict:
    return {"grid": [1, 1, 1], "num_warps": 1, "constexprs": {}}
