"""Token selection at the end of the step: greedy argmax, or seeded temperature / top-p sampling.

The random number is counter-based (a hash of seed and position, murmur3's 32-bit finaliser), so a
GPU kernel reproduces it exactly and a run repeats bit for bit with the same seed, with no RNG state
carried between steps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.targets import pow2_at_least

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
    """Greedy when temperature <= 0 (first index among equal maxima). Otherwise p = softmax(logits / T);
    the nucleus is every token with p >= t, t the largest threshold whose tokens hold at least top_p
    of the mass; the token is drawn by inverse CDF over the nucleus in vocabulary order with
    u = uniform_from(seed, pos). (Vocabulary order, not sorted order, so a GPU kernel needs no sort:
    it finds t by bisection and scans prefix sums.)"""
    logits = logits.float()
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    p_sorted = torch.sort(probs, descending=True).values
    dev = logits.device
    k = int(torch.searchsorted(torch.cumsum(p_sorted, 0), torch.tensor([top_p], device=dev))[0]
            .clamp(max=len(p_sorted) - 1))
    kept = torch.where(probs >= p_sorted[k], probs, torch.zeros_like(probs))
    target = uniform_from(seed, pos) * float(kept.sum())
    i = int(torch.searchsorted(torch.cumsum(kept, 0), torch.tensor([target], device=dev), right=True)[0])
    i = min(i, len(kept) - 1)
    while kept[i] == 0:  # only reachable through rounding at the very end: step back into the nucleus
        i -= 1
    return i


def sample_launch(vocab: int, target) -> dict:
    """One CTA over the vocabulary (argmax / top-p need a global view of the logits). Constants from
    ``target.rules["sample"]`` (kernels/targets.py); on sm_90: 16 warps over 16384-logit tiles
    (smaller vocabularies: one tile, at least 512): greedy at the 248320-token vocabulary takes
    13.0 us on the H200, the best of 22 configurations measured (4096-logit tiles: 19.4 us;
    bench/results/tuning/sample-sweep-h200.json)."""

    r = target.rules["sample"]
    return {"grid": [1, 1, 1], "num_warps": r.num_warps,
            "constexprs": {"V": vocab, "BLOCK": max(r.min_block, min(r.max_block, pow2_at_least(vocab)))}}


def step_end_launch(max_seq: int, target) -> dict:
    """One program; num_warps from ``target.rules["step_end"]`` (1 on sm_90)."""
    return {"grid": [1, 1, 1], "num_warps": target.rules["step_end"].num_warps, "constexprs": {"S": max_seq}}


def step_end_ref(pos: int, sampled: int, n_prompt: int, tokens: torch.Tensor) -> tuple[int, int]:
    """The end of a step at position ``pos``: the token for pos + 1 is the next prompt id while
    pos + 1 < n_prompt, else the sampled token, which is appended to ``tokens`` (updated in place).
    Returns (pos + 1, next token). The write index is clamped to the last row, so a step past
    max_seq never writes outside the sequence."""
    nxt = pos + 1
    i = min(max(nxt, 0), tokens.numel() - 1)
    if nxt >= n_prompt:
        tokens[i] = sampled
        return nxt, int(sampled)
    return nxt, int(tokens[i])


def chunk_rows(pos: int, n_prompt: int, rows: int) -> int:
    """Valid rows of the prompt chunk starting at ``pos`` in an M-row step of ``rows`` rows."""
    return max(0, min(rows, n_prompt - pos))


def last_row_ref(x: torch.Tensor, pos: int, n_prompt: int) -> torch.Tensor:
    """The chunk's last valid row (the one the first generated token is sampled from)."""
    return x[max(0, chunk_rows(pos, n_prompt, x.shape[0]) - 1)].clone()


def chunk_last_ref(pos: int, n_prompt: int, rows: int) -> int:
    """The position of the chunk's last valid row (what the one-token step's sample would read as pos)."""
    return pos + max(0, chunk_rows(pos, n_prompt, rows) - 1)


def prefill_end_ref(pos: int, sampled: int, n_prompt: int, tokens: torch.Tensor, rows: int) -> tuple[int, int]:
    """The end of an M-row step: pos advances past the chunk's valid rows; once the prompt is done, the
    sampled token is appended and fed in, as step_end does after the last prompt token."""
    n = chunk_rows(pos, n_prompt, rows)
    if n == 0:
        return pos, int(tokens[min(max(pos, 0), tokens.numel() - 1)])
    return step_end_ref(pos + n - 1, sampled, n_prompt, tokens)


@triton.jit
def counter_hash(seed, i):
    """fmix32(seed * 0x9E3779B1 + i * 0x85EBCA77 + 0x165667B1) in uint32 arithmetic (wrapping
    multiplies, logical shifts): the counter-based hash of uniform_from (and of kernels/fill.py)."""
    x = seed.to(tl.uint32) * 0x9E3779B1 + i.to(tl.uint32) * 0x85EBCA77 + 0x165667B1
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _uniform(seed, pos):
    """uniform_from(seed, pos) on the device."""
    return (counter_hash(seed, pos) >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def sample_kernel(logits_ptr, temperature_ptr, top_p_ptr, seed_ptr, pos_ptr, sampled_ptr, V: tl.constexpr,
                  BLOCK: tl.constexpr):
    """One program over the whole vocabulary (sample_ref's definition): a max/argmax pass; for
    temperature > 0 a softmax-denominator pass, a bisection on the nucleus threshold (32 passes,
    each summing the mass above the candidate threshold) and a prefix-sum pass in vocabulary order.
    Greedy costs one pass over the logits."""
    temperature = tl.load(temperature_ptr)
    offs = tl.arange(0, BLOCK)
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], V, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(logits_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        better = x > best_v  # strict: keeps the first index of equal values within a lane
        best_i = tl.where(better, idx, best_i)
        best_v = tl.where(better, x, best_v)
    m = tl.max(best_v, axis=0)
    arg = tl.min(tl.where(best_v == m, best_i, V), axis=0)  # first index among lanes holding the max
    if temperature > 0.0:
        inv_t = 1.0 / temperature
        denom = 0.0
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(logits_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            denom += tl.sum(tl.exp((x - m) * inv_t), axis=0)
        top_p = tl.load(top_p_ptr)
        lo = 0.0
        hi = 1.0 / denom  # the largest probability: its token alone always qualifies
        for _ in range(32):  # largest t with mass(p >= t) >= top_p
            mid = 0.5 * (lo + hi)
            mass = 0.0
            for start in range(0, V, BLOCK):
                idx = start + offs
                x = tl.load(logits_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
                p = tl.exp((x - m) * inv_t) / denom
                mass += tl.sum(tl.where(p >= mid, p, 0.0), axis=0)
            ok = mass >= top_p
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        t = lo
        total = 0.0
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(logits_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            p = tl.exp((x - m) * inv_t) / denom
            total += tl.sum(tl.where(p >= t, p, 0.0), axis=0)
        target = _uniform(tl.load(seed_ptr), tl.load(pos_ptr)) * total
        run = 0.0
        chosen = V
        last_kept = -1
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(logits_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            p = tl.exp((x - m) * inv_t) / denom
            kept = tl.where(p >= t, p, 0.0)
            csum = run + tl.cumsum(kept, axis=0)
            hit = (csum > target) & (kept > 0)
            first = tl.min(tl.where(hit, idx, V), axis=0)
            chosen = tl.minimum(chosen, first)
            last_kept = tl.maximum(last_kept, tl.max(tl.where(kept > 0, idx, -1), axis=0))
            run += tl.sum(kept, axis=0)
        # rounding can leave target above the final prefix sum: take the last nucleus token then
        arg = tl.where(chosen < V, chosen, last_kept)
    tl.store(sampled_ptr, arg)


@triton.jit
def step_end_kernel(pos_ptr, sampled_ptr, n_prompt_ptr, tokens_ptr, pos_out_ptr, token_out_ptr, S: tl.constexpr):
    """step_end_ref on the device: the next step reads its input token from the dyn buffer, and the
    host reads the sampled tokens from ``tokens`` every few steps."""
    nxt = tl.load(pos_ptr) + 1
    i = tl.minimum(tl.maximum(nxt, 0), S - 1)
    sampled = tl.load(sampled_ptr)
    n_prompt = tl.load(n_prompt_ptr)
    tl.store(tokens_ptr + i, sampled, mask=nxt >= n_prompt)
    prompt_id = tl.load(tokens_ptr + i, mask=nxt < n_prompt, other=0)
    tl.store(token_out_ptr, tl.where(nxt < n_prompt, prompt_id, sampled))
    tl.store(pos_out_ptr, nxt)


def rows_tail_launch(n: int, target) -> dict:
    """last_row / chunk_last / prefill_end: a row copy of N (the embedding gather's BLOCK and warps)
    over N / BLOCK programs; n = 1 for the scalar updates."""
    r = target.rules["embedding"]
    return {"grid": [(n + r.block - 1) // r.block, 1, 1], "num_warps": r.num_warps if n > 1 else 1,
            "constexprs": {"BLOCK": r.block}}


@triton.jit
def _chunk_rows(pos, n_prompt, ROWS: tl.constexpr):
    return tl.maximum(tl.minimum(n_prompt - pos, ROWS), 0)


@triton.jit
def last_row_kernel(x_ptr, pos_ptr, n_prompt_ptr, out_ptr, ROWS: tl.constexpr, N: tl.constexpr,
                    BLOCK: tl.constexpr):
    """``last_row_ref``: out = x[the chunk's last valid row] (row 0 when none is valid)."""
    r = tl.maximum(_chunk_rows(tl.load(pos_ptr), tl.load(n_prompt_ptr), ROWS) - 1, 0)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(out_ptr + offs, tl.load(x_ptr + r * N + offs, mask=mask), mask=mask)


@triton.jit
def chunk_last_kernel(pos_ptr, n_prompt_ptr, last_ptr, rows, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """``chunk_last_ref``: dyn.last = pos + (valid rows - 1), or pos when none is valid."""
    pos = tl.load(pos_ptr)
    tl.store(last_ptr, pos + tl.maximum(_chunk_rows(pos, tl.load(n_prompt_ptr), ROWS) - 1, 0))


@triton.jit
def prefill_end_kernel(pos_ptr, sampled_ptr, n_prompt_ptr, tokens_ptr, pos_out_ptr, token_out_ptr, rows,
                       ROWS: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr):
    """``prefill_end_ref``: step_end at the chunk's last valid row (pos advances past the valid rows;
    at the prompt's end the sampled token is appended and fed in); with no valid row, pos stays and
    the token is re-read. One program: every read happens before the writes to the same slots."""
    pos = tl.load(pos_ptr)
    n_prompt = tl.load(n_prompt_ptr)
    sampled = tl.load(sampled_ptr)
    n = _chunk_rows(pos, n_prompt, ROWS)
    nxt = pos + n
    i = tl.minimum(tl.maximum(nxt, 0), S - 1)
    append = (n > 0) & (nxt >= n_prompt)
    tl.store(tokens_ptr + i, sampled, mask=append)
    i = tl.where(n == 0, tl.minimum(tl.maximum(pos, 0), S - 1), i)
    seq = tl.load(tokens_ptr + i, mask=~append, other=0)
    tl.store(token_out_ptr, tl.where(append, sampled, seq))
    tl.store(pos_out_ptr, nxt)
