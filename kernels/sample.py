"""Token selection at the end of the step: greedy argmax, or seeded sampling with temperature, top-k,
top-p and min-p (sample_ref defines it; sample_kernel is its many-program GPU form).

The random number is counter-based (a hash of seed and position, murmur3's 32-bit finaliser), so a
GPU kernel reproduces it exactly and a run repeats bit for bit with the same seed, with no RNG state
carried between steps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.pdl import pdl_wait
from kestrel.kernels.targets import pow2_at_least

_M32 = 0xFFFFFFFF


def counter_hash32(seed: int, i: int) -> int:
    """murmur3's finaliser of seed * 0x9E3779B1 + i * 0x85EBCA77 + 0x165667B1 in uint32 arithmetic
    (``counter_hash``, the device's)."""
    x = ((seed & _M32) * 0x9E3779B1 + (i & _M32) * 0x85EBCA77 + 0x165667B1) & _M32
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _M32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def uniform_from(seed: int, pos: int) -> float:
    """A uniform float in [0, 1) with 24 bits, from (seed, pos) only."""
    return (counter_hash32(seed, pos) >> 8) / float(1 << 24)


def sample_ref(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float, seed: int,
               pos: int) -> int:
    """The token sampling definition (the CPU path runs it; the GPU kernel reproduces it).

    temperature <= 0: greedy, the first index among equal maxima. Otherwise, in fp32 (the parameters
    rounded to fp32 as the kernel reads them), with x = logits, m = max(x), w_i = exp((x_i - m) / T)
    (so max w = 1) and ``order`` the stable descending sort of x (ties: lower index first):
      L = V; top-k: L = min(L, top_k);
      top-p: over order[:L], c = cumsum(w), total = sum(w): L = min(L, 1 + the first j with
             c[j] >= top_p * total) (no such j: L stays);
      min-p: L = max(1, min(L, the number of j < L with w[order[j]] >= min_p)), i.e. p >= min_p * p_max;
      kept = order[:L]; target = u * sum(w[kept]) with u = uniform_from(seed, pos); the token is the
      first kept index in VOCABULARY order (ascending index) whose running sum of w over the kept
      tokens exceeds target; if rounding leaves none, the last kept index.
    Truncation is off at top_k = 0 (or top_k >= V), top_p >= 1 and min_p <= 0; the order top-k, then
    top-p over the top-k set renormalised, then min-p, is Hugging Face's warper order. Drawing in
    vocabulary order (not sorted order) lets the kernel sample without a sort."""
    x = logits.float()
    t, p, mp = (torch.tensor(v, dtype=torch.float32) for v in (temperature, top_p, min_p))
    if t <= 0:
        return int(torch.argmax(x))  # the first maximal index
    w = torch.exp((x - x.max()) / t)
    order = torch.sort(x, descending=True, stable=True).indices
    n = x.numel()
    L = min(n, top_k) if top_k > 0 else n
    if p < 1:
        ws = w[order[:L]]
        L = min(L, 1 + int(torch.searchsorted(torch.cumsum(ws, 0), (p * ws.sum()).reshape(1))[0]))
    if mp > 0:
        L = max(1, min(L, int((w[order[:L]] >= mp).sum())))
    kept = torch.sort(order[:L]).values
    target = torch.tensor(uniform_from(seed, pos), dtype=torch.float32) * w[kept].sum()
    i = int(torch.searchsorted(torch.cumsum(w[kept], 0), target.reshape(1), right=True)[0])
    return int(kept[min(i, L - 1)])


SCRATCH_HEADER = 8  # words at the start of a partials row (see sample_kernel)


def _sample_shape(vocab: int, target) -> tuple[int, int, int, int]:
    """(TILE, CAND, G, BLOCK) of sample_launch."""
    r = target.rules["sample"]
    tile = min(r.tile, pow2_at_least(vocab))
    cand, g = min(r.cand, tile), (vocab + tile - 1) // tile
    if tile >= 1 << 16 or pow2_at_least(g) * cand >= 1 << 16:  # _take_top packs two counts in an int32
        raise ValueError(f"sample: tile {tile} / {g} x {cand} candidates: 65536 entries or more")
    return tile, cand, g, max(r.min_block, min(r.max_block, pow2_at_least(vocab)))


def sample_launch(vocab: int, target) -> dict:
    """G = ceil(V / TILE) programs of ``num_warps`` warps, one per TILE-logit tile, the last to finish
    merging (sample_kernel). Constants from ``target.rules["sample"]`` (kernels/targets.py): TILE =
    ``tile`` (a smaller vocabulary: one tile of pow2(V)), CAND = ``cand`` candidates per tile (at
    most TILE), BLOCK = pow2(V) within [``min_block``, ``max_block``]: the slice width of the exact
    full-vocabulary fallback."""
    r = target.rules["sample"]
    tile, cand, g, block = _sample_shape(vocab, target)
    return {"grid": [g, 1, 1], "num_warps": r.num_warps,
            "constexprs": {"V": vocab, "TILE": tile, "CAND": cand, "BLOCK": block}}


def sample_scratch_shape(vocab: int, target) -> tuple[int, int]:
    """The partials scratch sample_kernel needs: (G, W), one row of W = 8 + 2 * CAND fp32 words per
    program (the layout is in sample_kernel's docstring)."""
    _, cand, g, _ = _sample_shape(vocab, target)
    return g, SCRATCH_HEADER + 2 * cand


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


_WAYS = tl.constexpr(8)  # thresholds per step of a mass search (_search)
_FULL_WAYS = tl.constexpr(8)  # the same in the full-vocabulary fallback (each step a pass over V)
_KEY_NONE = tl.constexpr(-2147483648)  # below the key of every logit (-inf included): "no such logit"
_KEY_MAX = tl.constexpr(2147483647)
_KEY_NEG_INF = tl.constexpr(-2139095041)  # the key of -inf: the smallest key of a logit
_HDR = tl.constexpr(SCRATCH_HEADER)


@triton.jit
def _order_key(x):
    """The int32 whose order is the order of the fp32 x (bits ^ 0x7FFFFFFF when negative; -0 as +0)."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _key_logit(k):
    """The fp32 logit of an order key (_order_key's inverse)."""
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)


@triton.jit
def _ladder(lo, hi, top, WAYS: tl.constexpr):
    """The first step's WAYS thresholds (int32, rising): lo, then the keys of top - 2^e for e falling
    evenly from 10 to -6 (logit units below the set's largest logit ``top``: a float ladder brackets
    the answer far tighter than even steps over the 2^32 keys), within [lo, hi + 1]."""
    j = tl.arange(0, WAYS)
    e = 10.0 - 16.0 * (j - 1).to(tl.float32) / (WAYS - 2)
    t = tl.minimum(tl.maximum(_order_key(top - tl.exp2(e)).to(tl.int64), lo), hi + 1)
    return tl.where(j == 0, lo, t).to(tl.int32)


@triton.jit
def _even(lo, hi, WAYS: tl.constexpr):
    """WAYS int32 thresholds in [lo, hi + 1] after the first step: lo, lo + 1 (so a search whose answer
    is lo, e.g. a key shared by many logits, ends at once), then lo + j * step cutting the int64 key
    range [lo, hi] into WAYS - 1 equal steps."""
    j = tl.arange(0, WAYS).to(tl.int64)
    step = (hi - lo) // (WAYS - 1) + 1
    return tl.minimum(tl.where(j == 1, lo + 1, lo + tl.maximum(j - 1, 0) * step), hi + 1).to(tl.int32)


@triton.jit
def _narrow(lo, hi, t, f, goal, EXACT_STOP: tl.constexpr):
    """One search step over the masses f of the rising thresholds t (t[0] = lo): the last threshold
    whose mass reaches goal becomes lo, the next one - 1 becomes hi. With EXACT_STOP (counts), a
    threshold whose count is exactly goal ends the search there (the set key >= t is then the
    answer). Returns (lo, hi), int64."""
    nlo = tl.max(tl.where(f >= goal, t.to(tl.int64), lo), axis=0)
    nhi = tl.minimum(tl.min(tl.where(t > nlo, t.to(tl.int64), hi + 1), axis=0) - 1, hi)
    if EXACT_STOP:
        nhi = tl.where(tl.max((f == goal).to(tl.int32), axis=0) > 0, nlo, nhi)
    return nlo, nhi


@triton.jit
def _linear(lo, hi, WAYS: tl.constexpr):
    """WAYS int32 thresholds in [lo, hi + 1] after the first step when [lo, hi] spans a wide range of
    logits: lo, lo + 1, then the keys of logits evenly spaced between lo's and hi's (candidate logits
    spread roughly evenly in value, not in key: even key steps over a range that crosses zero put
    every threshold near 0 or near the ends)."""
    j = tl.arange(0, WAYS)
    a = _key_logit(lo.to(tl.int32))
    b = _key_logit(hi.to(tl.int32))
    finite = (a > float("-inf")) & (b < float("inf"))  # (the caller uses these thresholds only then)
    a = tl.where(finite, a, 0.0)
    b = tl.where(finite, b, 0.0)
    v = a + (b - a) * ((j - 1).to(tl.float32) / (WAYS - 1))
    t = tl.minimum(tl.maximum(_order_key(v).to(tl.int64), lo), hi + 1)
    return tl.where(j == 0, lo, tl.where(j == 1, tl.minimum(lo + 1, hi + 1), t)).to(tl.int32)


@triton.jit
def _search(partials_ptr, key, wt, goal, lo, hi, top, CAND: tl.constexpr):
    """The largest key threshold v in [lo, hi] with sum(wt over key >= v) >= goal (lo when none
    reaches it; wt >= 0, hi the key of ``top``, the largest logit). A _WAYS-ary mass search: each step
    one [_WAYS, n] compare with two sums (the masses and the counts of wt > 0 at each threshold)
    narrows [lo, hi] to two neighbouring thresholds (the first step's on _ladder's float ladder, then
    _linear's even logits while the range is wide, else _even's key steps). It stops as soon as at
    most CAND weighted entries lie in [lo, hi]: they are compacted into partials row 0's CAND slots
    (free once the merge has read every row; the candidate's key and wt) and v found among them
    pairwise: the mass at or above slot i's key is the mass above hi plus the slots' wt at keys >=
    key_i; v is the largest slot key whose mass reaches goal (the mass changes only at those keys)."""
    lo = lo + tl.zeros([], tl.int64)  # (lo may be a constant)
    hi = hi.to(tl.int64)
    live = wt > 0.0
    above = tl.zeros([], tl.float32)  # the mass at keys > hi
    c_above = tl.zeros([], tl.int32)  # the count of live entries at keys > hi
    n_in = tl.full([], CAND + 1, tl.int32)  # live entries in [lo, hi] (unknown before the first step)
    t = _ladder(lo, hi, top, _WAYS)
    while (lo < hi) & (n_in > CAND):
        ge = key[None, :] >= t[:, None]
        f = tl.sum(tl.where(ge, wt[None, :], 0.0), axis=1)
        c = tl.sum((ge & live[None, :]).to(tl.int32), axis=1)
        nlo = tl.max(tl.where(f >= goal, t.to(tl.int64), lo), axis=0)
        up = t.to(tl.int64) > nlo  # the thresholds above the new lo: their masses are below goal
        any_up = tl.max(up.to(tl.int32), axis=0) > 0
        nhi = tl.minimum(tl.min(tl.where(up, t.to(tl.int64), hi + 1), axis=0) - 1, hi)
        above = tl.where(any_up, tl.max(tl.where(up, f, 0.0), axis=0), above)
        c_above = tl.where(any_up, tl.max(tl.where(up, c, 0), axis=0), c_above)
        n_in = tl.min(tl.where(up, 2147483647, c), axis=0) - c_above  # count(key >= nlo) - count(key > nhi)
        lo, hi = nlo, nhi
        wide = ((hi - lo > 1048576) & (_key_logit(lo.to(tl.int32)) > float("-inf"))
                & (_key_logit(hi.to(tl.int32)) < float("inf")))
        t = tl.where(wide, _linear(lo, hi, _WAYS), _even(lo, hi, _WAYS))
    if lo < hi:  # at most CAND weighted entries in [lo, hi]: finish pairwise
        inside = live & (key >= lo) & (key <= hi)
        pos = tl.cumsum(inside.to(tl.int32), axis=0) - 1
        tl.debug_barrier()  # every thread has read the rows before they are reused
        tl.store(partials_ptr + _HDR + pos, key.to(tl.float32, bitcast=True), mask=inside)
        tl.store(partials_ptr + _HDR + CAND + pos, wt, mask=inside)
        tl.debug_barrier()
        s = tl.arange(0, CAND)
        sl = s < n_in
        ks = tl.load(partials_ptr + _HDR + s, mask=sl, other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
        ws = tl.load(partials_ptr + _HDR + CAND + s, mask=sl, other=0.0, cache_modifier=".cg")
        at = above + tl.sum(tl.where(sl[None, :] & (ks[None, :] >= ks[:, None]), ws[None, :], 0.0), axis=1)
        lo = tl.max(tl.where(sl & (at >= goal), ks.to(tl.int64), lo), axis=0)
    return lo.to(tl.int32)


@triton.jit
def _kth_key(key, member, goal, top, cap):
    """A key v with goal <= count(key >= v) <= cap over the members (any prefix of the order of at
    least goal and at most cap members: the search stops at the first threshold that makes one), or
    when ties leave none such, the goal-th largest key (count(key > v) <= goal <= count(key >= v));
    the key of -inf when there are fewer than goal. cap = goal: exactly the goal-th largest (or a
    threshold with exactly goal members at or above it). A search whose steps each count four
    thresholds in one reduction (no vector results to exchange): the first step's on a float ladder
    below ``top`` (the members' largest logit: top - 64, - 8, - 1, - 1/8), then lo + 1 and three even
    steps over (lo, hi] (steps even in logit value instead were measured: +-1 us, no gain; stop 21);
    it stops at a threshold with goal..cap members at or above it, and as soon
    as lo + 1 has fewer than goal. A wider [goal, cap] ends the search in a few steps (a handful of
    thresholds brackets some count in it) where an exact count takes ~10."""
    lo = tl.full([], _KEY_NEG_INF, tl.int64)
    hi = _order_key(top).to(tl.int64)
    l1 = _order_key(top - 64.0).to(tl.int64)
    l2 = _order_key(top - 8.0).to(tl.int64)
    l3 = _order_key(top - 1.0).to(tl.int64)
    l4 = _order_key(top - 0.125).to(tl.int64)
    first = lo < hi  # the first step: the ladder
    while lo < hi:
        step = (hi - lo) // 4 + 1
        t1 = tl.where(first, l1, lo + 1)  # lo + 1: a search whose answer is lo (a shared key) ends at once
        t2 = tl.where(first, l2, lo + step)
        t3 = tl.where(first, l3, lo + 2 * step)
        t4 = tl.where(first, l4, lo + 3 * step)
        t1 = tl.minimum(tl.maximum(t1, lo), hi + 1)  # rising thresholds in [lo, hi + 1]
        t2 = tl.minimum(tl.maximum(t2, t1), hi + 1)
        t3 = tl.minimum(tl.maximum(t3, t2), hi + 1)
        t4 = tl.minimum(tl.maximum(t4, t3), hi + 1)
        # the four counts from ONE reduction: 16-bit fields of an int64 sum (fewer than 65536 members)
        ge = ((key >= t1.to(tl.int32)).to(tl.int64) + ((key >= t2.to(tl.int32)).to(tl.int64) << 16)
              + ((key >= t3.to(tl.int32)).to(tl.int64) << 32) + ((key >= t4.to(tl.int32)).to(tl.int64) << 48))
        c = tl.sum(tl.where(member, ge, 0), axis=0)
        c1, c2, c3, c4 = c & 0xFFFF, (c >> 16) & 0xFFFF, (c >> 32) & 0xFFFF, (c >> 48) & 0xFFFF
        # the counts fall with t: the thresholds reaching goal are t1 .. tj
        j = ((c1 >= goal).to(tl.int32) + (c2 >= goal).to(tl.int32) + (c3 >= goal).to(tl.int32)
             + (c4 >= goal).to(tl.int32))
        nlo = tl.where(j == 0, lo, tl.where(j == 1, t1, tl.where(j == 2, t2, tl.where(j == 3, t3, t4))))
        nxt = tl.where(j == 0, t1, tl.where(j == 1, t2, tl.where(j == 2, t3, tl.where(j == 3, t4, hi + 1))))
        cj = tl.where(j == 1, c1, tl.where(j == 2, c2, tl.where(j == 3, c3, c4)))
        hi = tl.where((j > 0) & (cj <= cap), nlo, tl.minimum(nxt - 1, hi))
        lo = nlo
        first = tl.full([], False, tl.int1)
    return lo.to(tl.int32)


@triton.jit
def _take_top(key, member, v, goal):
    """The first ``goal`` members in the order (key desc, index asc) when count(key > v) <= goal <=
    count(key >= v) (or all of them when there are fewer): the members with key > v and the first
    goal - count(key > v) ties at v in index order (a prefix count, skipped when all ties fit). The
    entries must lie in ascending index order. Both counts come from one reduction (ties << 16:
    fewer than 65536 entries)."""
    gt = member & (key > v)
    tie = member & (key == v)
    tie_n = tie.to(tl.int32)
    both = tl.sum(gt.to(tl.int32) + (tie_n << 16), axis=0)
    take = gt | tie
    if (both >> 16) > goal - (both & 0xFFFF):
        take = gt | (tie & (tl.cumsum(tie_n, axis=0) <= goal - (both & 0xFFFF)))
    return take


@triton.jit
def _pick(kept, w, idx, target, V: tl.constexpr):
    """Inverse CDF in vocabulary order (entries in ascending idx): the first kept entry whose running
    sum of w exceeds target; the last kept one when rounding leaves none."""
    wk = tl.where(kept, w, 0.0)
    first = tl.min(tl.where(kept & (tl.cumsum(wk, axis=0) > target), idx, V), axis=0)
    return tl.where(first < V, first, tl.max(tl.where(kept, idx, -1), axis=0))


@triton.jit
def _global_prefix(key, idx, kept, e_tile, g, TILE: tl.constexpr):
    """Whether the kept candidates are a prefix of the whole vocabulary's order: no tile's first
    left-out logit (key e_tile[g], after every candidate of tile g in that order) comes before the
    last kept candidate (the largest index among those with the smallest kept key)."""
    vmin = tl.min(tl.where(kept, key, _KEY_MAX), axis=0)
    last = tl.max(tl.where(kept & (key == vmin), idx, -1), axis=0)
    ahead = (e_tile > vmin) | ((e_tile == vmin) & (g < last // TILE))
    return tl.max(ahead.to(tl.int32), axis=0) == 0


@triton.jit
def _merge_tiles(logits_ptr, mass, g, m, inv_t, target, V: tl.constexpr, TILE: tl.constexpr, G: tl.constexpr):
    """Temperature without truncation: the tile by inverse CDF over the tile masses (tile order; the
    last tile when rounding leaves none), then the token inside it, its logits re-read (L2-hot)."""
    cm = tl.cumsum(mass, axis=0)
    gsel = tl.min(tl.where(cm > target, g, G - 1), axis=0)
    rem = target - tl.sum(tl.where(g == gsel, cm - mass, 0.0), axis=0)
    idx = gsel * TILE + tl.arange(0, TILE)
    valid = idx < V
    x = tl.load(logits_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32)
    w = tl.where(valid & (x > float("-inf")), tl.exp((x - m) * inv_t), 0.0)
    return _pick(valid, w, idx, rem, V)


@triton.jit
def _full_slice(logits_ptr, start, m, inv_t, V: tl.constexpr, BLOCK: tl.constexpr):
    """Slice [start, start + BLOCK) of the logits for _sample_full: (index, valid, key, w)."""
    idx = start + tl.arange(0, BLOCK)
    valid = idx < V
    x = tl.load(logits_ptr + idx, mask=valid, other=float("-inf")).to(tl.float32)
    w = tl.where(valid & (x > float("-inf")), tl.exp((x - m) * inv_t), 0.0)
    return idx, valid, _order_key(x), w


@triton.jit
def _full_kept(key, w, valid, idx, arg, vk, need_k, split_k, seen_k, vp, before, thr, split_p, seen_p, kappa):
    """Membership of one slice of the vocabulary (_sample_full): the top-k set (key > vk, or one of the
    first need_k ties at vk in index order), inside it the top-p set (key > vp, or a tie at vp whose
    exclusive prefix mass after ``before`` stays below thr), inside that the min-p set (key >= kappa);
    the argmax always. Off: vk = vp = kappa = _KEY_NONE. The prefix sums over the ties run only when
    their group is split (split_k / split_p), carried across slices in seen_k / seen_p. Returns
    (top-k member, kept, seen_k, seen_p)."""
    in_k = valid & (key >= vk)
    if split_k:
        tk = (valid & (key == vk)).to(tl.int32)
        in_k = valid & ((key > vk) | ((tk > 0) & (seen_k + tl.cumsum(tk, axis=0) <= need_k)))
        seen_k += tl.sum(tk, axis=0)
    in_p = in_k & (key >= vp)
    if split_p:
        tie_p = in_k & (key == vp)
        tw = tl.where(tie_p, w, 0.0)
        in_p = in_k & ((key > vp) | (tie_p & (before + (seen_p + tl.cumsum(tw, axis=0) - tw) < thr)))
        seen_p += tl.sum(tw, axis=0)
    kept = (in_p & (key >= kappa)) | (idx == arg)
    return in_k, kept, seen_k, seen_p


@triton.jit
def _sample_full(logits_ptr, m, arg, inv_t, u, k_on, top_k, p_on, top_p, mp_on, min_p, V: tl.constexpr,
                 BLOCK: tl.constexpr):
    """sample_ref over the whole vocabulary in one program, in BLOCK-wide slices re-read from memory
    (the exact fallback: slow, ~10-30 passes over the logits). Each pass accumulates per lane across
    the slices and reduces once at its end (no barrier per slice). Top-k: a _FULL_WAYS-ary search for
    the k-th largest key (each step a pass counting the keys >= _FULL_WAYS thresholds; the first step
    on _ladder's), ties by index; top-p: the same search on the mass of the top-k set, ties by their
    prefix mass in vocabulary order; min-p: the smallest kept key whose w reaches min_p; then a pass
    summing the kept mass and one finding the slice, then the token, where the running sum exceeds u
    times it (the last kept token when rounding leaves none)."""
    key_top = _order_key(m)
    vk = tl.full([], _KEY_NONE, tl.int32)
    need_k = tl.zeros([], tl.int32)
    split_k = tl.full([], False, tl.int1)  # a tie group at vk split by top-k
    if k_on:
        lo = tl.full([], _KEY_NEG_INF, tl.int64)
        hi = key_top.to(tl.int64)
        t = _ladder(lo, hi, m, _FULL_WAYS)
        while lo < hi:
            acc = tl.zeros([_FULL_WAYS, BLOCK], tl.float32)
            for start in tl.range(0, V, BLOCK, num_stages=2):
                idx, valid, key, w = _full_slice(logits_ptr, start, m, inv_t, V, BLOCK)
                acc += tl.where((key[None, :] >= t[:, None]) & valid[None, :], 1.0, 0.0)
            lo, hi = _narrow(lo, hi, t, tl.sum(acc, axis=1), top_k.to(tl.float32), True)
            t = _even(lo, hi, _FULL_WAYS)
        vk = lo.to(tl.int32)
        n_gt = tl.zeros([BLOCK], tl.int32)
        n_tie = tl.zeros([BLOCK], tl.int32)
        for start in tl.range(0, V, BLOCK, num_stages=2):
            idx, valid, key, w = _full_slice(logits_ptr, start, m, inv_t, V, BLOCK)
            n_gt += (valid & (key > vk)).to(tl.int32)
            n_tie += (valid & (key == vk)).to(tl.int32)
        need_k = top_k - tl.sum(n_gt, axis=0)
        split_k = tl.sum(n_tie, axis=0) > need_k
    vp = tl.full([], _KEY_NONE, tl.int32)
    before = tl.zeros([], tl.float32)
    thr = tl.zeros([], tl.float32)
    split_p = tl.full([], False, tl.int1)  # a tie group at vp split by top-p
    if p_on:
        total = tl.zeros([BLOCK], tl.float32)
        seen_k = tl.zeros([], tl.int32)
        seen_p = tl.zeros([], tl.float32)
        for start in tl.range(0, V, BLOCK, num_stages=2):
            idx, valid, key, w = _full_slice(logits_ptr, start, m, inv_t, V, BLOCK)
            in_k, kept, seen_k, seen_p = _full_kept(key, w, valid, idx, arg, vk, need_k, split_k, seen_k, vp,
                                                    before, thr, split_p, seen_p, _KEY_NONE)
            total += tl.where(in_k, w, 0.0)
        thr = top_p * tl.sum(total, axis=0)
        lo = tl.full([], _KEY_NEG_INF, tl.int64)
        hi = key_top.to(tl.int64)
        t = _ladder(lo, hi, m, _FULL_WAYS)
        while lo < hi:
            acc = tl.zeros([_FULL_WAYS, BLOCK], tl.float32)
            seen_k = tl.zeros([], tl.int32)
            for start in tl.range(0, V, BLOCK, num_stages=2):
                idx, valid, key, w = _full_slice(logits_ptr, start, m, inv_t, V, BLOCK)
                in_k, kept, seen_k, seen_p = _full_kept(key, w, valid, idx, arg, vk, need_k, split_k, seen_k, vp,
                                                        before, thr, split_p, seen_p, _KEY_NONE)
                acc += tl.where(key[None, :] >= t[:, None], tl.where(in_k, w, 0.0)[None, :], 0.0)
            lo, hi = _narrow(lo, hi, t, tl.sum(acc, axis=1), thr, False)
            t = _even(lo, hi, _FULL_WAYS)
        vp = lo.to(tl.int32)
        mass_gt = tl.zeros([BLOCK], tl.float32)
        n_tie = tl.zeros([BLOCK], tl.int32)
        seen_k = tl.zeros([], tl.int32)
        for start in tl.range(0, V, BLOCK, num_stages=2):
            idx, valid, key, w = _full_slice(logits_ptr, start, m, inv_t, V, BLOCK)
            in_k, kept, seen_k, seen_p = _full_kept(key, w, valid, idx, arg, vk, need_k, split_k, seen_k,
                                                    _KEY_NONE, before, thr, split_p, seen_p, _KEY_NONE)
            mass_gt += tl.where(in_k & (key > vp), w, 0.0)
            n_tie += (in_k & (key == vp)).to(tl.int32)
        before = tl.sum(mass_gt, axis=0)
        split_p = tl.sum(n_tie, axis=0) > 1  # a single tie at vp is always kept: before < thr <= before + its w
    kappa = tl.full([], _KEY_NONE, tl.int32)
    if mp_on:
        low = tl.full([BLOCK], _KEY_MAX, tl.int32)
        seen_k = tl.zeros([], tl.int32)
        seen_p = tl.zeros([], tl.float32)
        for start in tl.range(0, V, BLOCK, num_stages=2):
            idx, valid, key, w = _full_slice(logits_ptr, start, m, inv_t, V, BLOCK)
            in_k, kept, seen_k, seen_p = _full_kept(key, w, valid, idx, arg, vk, need_k, split_k, seen_k, vp,
                                                    before, thr, split_p, seen_p, _KEY_NONE)
            low = tl.minimum(low, tl.where(kept & (w >= min_p), key, _KEY_MAX))
        kappa = tl.min(low, axis=0)
    total = tl.zeros([BLOCK], tl.float32)
    seen_k = tl.zeros([], tl.int32)
    seen_p = tl.zeros([], tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=2):
        idx, valid, key, w = _full_slice(logits_ptr, start, m, inv_t, V, BLOCK)
        in_k, kept, seen_k, seen_p = _full_kept(key, w, valid, idx, arg, vk, need_k, split_k, seen_k, vp, before,
                                                thr, split_p, seen_p, kappa)
        total += tl.where(kept, w, 0.0)
    target = u * tl.sum(total, axis=0)
    run = tl.zeros([], tl.float32)
    chosen = tl.full([], V, tl.int32)
    last = tl.full([BLOCK], -1, tl.int32)
    seen_k = tl.zeros([], tl.int32)
    seen_p = tl.zeros([], tl.float32)
    for start in tl.range(0, V, BLOCK, num_stages=2):
        idx, valid, key, w = _full_slice(logits_ptr, start, m, inv_t, V, BLOCK)
        in_k, kept, seen_k, seen_p = _full_kept(key, w, valid, idx, arg, vk, need_k, split_k, seen_k, vp, before,
                                                thr, split_p, seen_p, kappa)
        last = tl.maximum(last, tl.where(kept, idx, -1))
        if chosen == V:  # still before the slice where the running sum passes target
            wk = tl.where(kept, w, 0.0)
            mass = tl.sum(wk, axis=0)
            if run + mass > target:
                chosen = tl.min(tl.where(kept & (run + tl.cumsum(wk, axis=0) > target), idx, V), axis=0)
            run += mass
    return tl.where(chosen < V, chosen, tl.max(last, axis=0))  # rounding left none: the last kept token


@triton.jit
def _small_keep(partials_ptr, x, idx, kept, m, arg, inv_t, n, top_k, p_on, top_p, mp_on, min_p,
                V: tl.constexpr, CAND: tl.constexpr):
    """Top-k, top-p and min-p over a prefix of the order holding the top-k set (n kept
    candidates, top_k <= n <= CAND, or all of them when fewer): the prefix is compacted in vocabulary
    order into CAND slots (written to partials row 0, free once every row has been read, and read
    back); a [CAND, CAND] compare gives each slot the slots ahead of it in the order (logit desc,
    index asc): its rank (top-k: rank < top_k) and its exclusive prefix mass over the top-k set (the
    reference's cumsum without a sort); top-p keeps the slots whose prefix stays below top_p * the
    set's mass (and the first), min-p those with key >= the smallest kept key whose w reaches min_p;
    returns (keep, ws, ids, ks) over the CAND slots: the kept set, the weights (0 outside the top-k set),
    the indices (V past n) and the order keys (_sample_small draws from them; kernels/speculative.py's
    filter reads the kept set's last element and mass)."""
    pos = tl.cumsum(kept.to(tl.int32), axis=0) - 1
    tl.debug_barrier()  # every thread has read the rows before they are reused
    tl.store(partials_ptr + _HDR + pos, x, mask=kept)
    tl.store(partials_ptr + _HDR + CAND + pos, idx.to(tl.float32, bitcast=True), mask=kept)
    tl.debug_barrier()
    c = tl.arange(0, CAND)
    live = c < n
    xs = tl.load(partials_ptr + _HDR + c, mask=live, other=float("-inf"), cache_modifier=".cg")
    ids = tl.load(partials_ptr + _HDR + CAND + c, mask=live, other=0.0, cache_modifier=".cg")
    ids = tl.where(live, ids.to(tl.int32, bitcast=True), V)
    ks = _order_key(xs)
    ahead = live[None, :] & ((ks[None, :] > ks[:, None]) |
                             ((ks[None, :] == ks[:, None]) & (ids[None, :] < ids[:, None])))  # [i, j]: j before i
    keep = live & (tl.sum(ahead.to(tl.int32), axis=1) < top_k)  # the top-k set (its slots ahead are in it too)
    ws = tl.where(keep & (xs > float("-inf")), tl.exp((xs - m) * inv_t), 0.0)
    if p_on:
        excl = tl.sum(tl.where(ahead, ws[None, :], 0.0), axis=1)  # [i]: the mass of the slots ahead of slot i
        keep = keep & ((excl < top_p * tl.sum(ws, axis=0)) | (ids == arg))
    if mp_on:
        kappa = tl.min(tl.where(keep & (ws >= min_p), ks, _KEY_MAX), axis=0)
        keep = (keep & (ks >= kappa)) | (ids == arg)
    return keep, ws, ids, ks


@triton.jit
def _sample_small(partials_ptr, x, idx, kept, m, arg, inv_t, u, n, top_k, p_on, top_p, mp_on, min_p,
                  V: tl.constexpr, CAND: tl.constexpr):
    """_small_keep's kept set, then the draw (_pick)."""
    keep, ws, ids, ks = _small_keep(partials_ptr, x, idx, kept, m, arg, inv_t, n, top_k, p_on, top_p, mp_on, min_p,
                                    V, CAND)
    return _pick(keep, ws, ids, u * tl.sum(tl.where(keep, ws, 0.0), axis=0), V)


@triton.jit
def _candidates(partials_ptr, m, inv_t, V: tl.constexpr, CAND: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """The G * CAND candidates of partials rows 0 .. G - 1 as one vector in vocabulary order: (x, idx, valid,
    key, w = exp((x - m) * inv_t)); padding has index V and w 0."""
    W: tl.constexpr = _HDR + 2 * CAND
    N: tl.constexpr = GP * CAND
    o = tl.arange(0, N)
    live = o // CAND < G
    slot = partials_ptr + (o // CAND) * W + _HDR + o % CAND
    x = tl.load(slot, mask=live, other=float("-inf"), cache_modifier=".cg")
    idx = tl.load(slot + CAND, mask=live, other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
    idx = tl.where(live, idx, V)  # ascending over the valid entries: tiles in order, each in index order
    valid = idx < V
    w = tl.where(valid & (x > float("-inf")), tl.exp((x - m) * inv_t), 0.0)
    return x, idx, valid, _order_key(x), w


@triton.jit
def _large_keep(partials_ptr, key, idx, valid, w, m, arg, D, inv_t, k_on, top_k, p_on, top_p, mp_on, min_p,
                TILE: tl.constexpr, CAND: tl.constexpr, G: tl.constexpr, GP: tl.constexpr):
    """The kept set among the candidates when top-k is off or above CAND (sample_kernel's docstring,
    "otherwise"): returns (kept, exact), exact when it is provably the reference's whole set."""
    W: tl.constexpr = _HDR + 2 * CAND
    g = tl.arange(0, GP)
    e_tile = tl.load(partials_ptr + g * W + 3, mask=g < G, other=0.0, cache_modifier=".cg")
    e_tile = tl.where(g < G, e_tile.to(tl.int32, bitcast=True), _KEY_NONE)
    e_max = tl.max(e_tile, axis=0)
    none_left = e_max == _KEY_NONE  # every logit is a candidate
    key_top = _order_key(m)
    kept = valid
    exact = tl.full([], True, tl.int1)
    closed = tl.full([], False, tl.int1)  # a step bounded the kept set (before that it may pass the candidates)
    if k_on:
        n_cand = tl.sum(tl.load(partials_ptr + g * W + 4, mask=g < G, other=0.0, cache_modifier=".cg")
                        .to(tl.int32, bitcast=True), axis=0)
        kept = _take_top(key, valid, _kth_key(key, valid, top_k, m, top_k), top_k)
        exact = none_left | ((n_cand >= top_k) & _global_prefix(key, idx, kept, e_tile, g, TILE))
        closed = tl.full([], True, tl.int1)
    if p_on:
        wk = tl.where(kept, w, 0.0)
        mass = tl.sum(wk, axis=0)
        thr = top_p * tl.where(k_on, mass, D)
        if k_on | (mass >= thr):  # without top-k and below thr the candidates run out: all kept, still open
            vp = _search(partials_ptr, key, wk, thr, tl.min(tl.where(kept, key, _KEY_MAX), axis=0), key_top, m, CAND)
            before = tl.sum(tl.where(key > vp, wk, 0.0), axis=0)
            tie = kept & (key == vp)
            in_tie = tl.where(before < thr, tie, False)  # (a scalar test broadcast by where: Triton's
            # interpreter mistypes scalar comparisons splat into a tensor &)
            if tl.sum(tie.to(tl.int32), axis=0) > 1:
                tw = tl.where(tie, w, 0.0)
                in_tie = tie & (before + (tl.cumsum(tw, axis=0) - tw) < thr)
            kept = (kept & (key > vp)) | in_tie | (idx == arg)
            if not k_on:
                exact = _global_prefix(key, idx, kept, e_tile, g, TILE)
                closed = tl.full([], True, tl.int1)
    if mp_on:
        kappa = tl.min(tl.where(kept & (w >= min_p), key, _KEY_MAX), axis=0)
        kept = (kept & (key >= kappa)) | (idx == arg)
        if not closed:  # exact when every left-out logit fails min-p (they all have keys <= e_max)
            exact = none_left | (tl.exp((_key_logit(e_max) - m) * inv_t) < min_p)
            closed = tl.full([], True, tl.int1)
    if not closed:
        exact = none_left
    return kept, exact


@triton.jit
def _merge_candidates(partials_ptr, logits_ptr, m, arg, D, inv_t, u, k_on, top_k, p_on, top_p, mp_on, min_p,
                      V: tl.constexpr, TILE: tl.constexpr, CAND: tl.constexpr, BLOCK: tl.constexpr,
                      G: tl.constexpr, GP: tl.constexpr):
    """Truncated sampling over the G * CAND candidates (sample_kernel's docstring); the full-vocabulary
    fallback when the result is not provably the reference's. Returns (token, path: 2 candidates,
    3 fallback)."""
    x, idx, valid, key, w = _candidates(partials_ptr, m, inv_t, V, CAND, G, GP)
    path = tl.full([], 2, tl.int32)
    if k_on & (top_k <= CAND):  # the top-k set is inside the candidates (each tile holds its share of it)
        kept = _take_top(key, valid, _kth_key(key, valid, top_k, m, CAND), CAND)  # a prefix of top_k..CAND
        token = _sample_small(partials_ptr, x, idx, kept, m, arg, inv_t, u, tl.sum(kept.to(tl.int32), axis=0), top_k,
                              p_on, top_p, mp_on, min_p, V,
                              CAND)
    else:
        kept, exact = _large_keep(partials_ptr, key, idx, valid, w, m, arg, D, inv_t, k_on, top_k, p_on, top_p, mp_on,
                                  min_p, TILE, CAND, G, GP)
        if exact:
            token = _pick(kept, w, idx, u * tl.sum(tl.where(kept, w, 0.0), axis=0), V)
        else:
            token = _sample_full(logits_ptr, m, arg, inv_t, u, k_on, top_k, p_on, top_p, mp_on, min_p, V, BLOCK)
            path = tl.full([], 3, tl.int32)
    return token, path


@triton.jit
def _tile_candidates(row, x, offs, valid, m_t, k_on, top_k, pid, V: tl.constexpr, TILE: tl.constexpr,
                     CAND: tl.constexpr):
    """Phase 1's truncation words of tile ``pid`` (logits x at offs): its first CAND candidates in the order
    (logit desc, index asc) at words _HDR.. (logits) and _HDR + CAND.. (indices; the unused slots -inf / V),
    its first left-out key at word 3 and the count at word 4 (sample_kernel; spec_filter_kernel likewise)."""
    key = _order_key(x)
    cnt = tl.minimum(V - pid * TILE, CAND)  # the most _take_top takes
    # top-k <= CAND: any prefix of top_k..cnt holds the tile's share of the top-k set (without
    # top-k all cnt: a prefix of cnt / 2..cnt sent flat logits' top-p 0.9 to the full fallback on
    # the H200, 1.6 ms; bench/results/stop21)
    goal = tl.where(k_on & (top_k < cnt), top_k, cnt)
    take = _take_top(key, valid, _kth_key(key, valid, goal, m_t, cnt), cnt)
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1
    n_take = tl.sum(take.to(tl.int32), axis=0)
    tl.store(row + _HDR + slot, x, mask=take)
    tl.store(row + _HDR + CAND + slot, offs.to(tl.float32, bitcast=True), mask=take)
    c = tl.arange(0, CAND)
    tl.store(row + _HDR + c, tl.full([CAND], float("-inf"), tl.float32), mask=c >= n_take)
    tl.store(row + _HDR + CAND + c, tl.full([CAND], V, tl.int32).to(tl.float32, bitcast=True), mask=c >= n_take)
    tl.store(row + 3, tl.max(tl.where(valid & ~take, key, _KEY_NONE), axis=0).to(tl.float32, bitcast=True))
    tl.store(row + 4, n_take.to(tl.float32, bitcast=True))


@triton.jit
def sample_kernel(logits_ptr, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, seed_ptr, pos_ptr,
                  partials_ptr, ticket_ptr, sampled_ptr, V: tl.constexpr, TILE: tl.constexpr,
                  CAND: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """sample_ref on the device: one launch of G = ceil(V / TILE) programs; the last to finish merges.

    Operands: logits fp32 [V]; temperature, top_p, min_p fp32 [1]; top_k, seed, pos int32 [1];
    partials fp32 [G, W] (scratch, garbage between launches), W = 8 + 2 * CAND; ticket int32 [1]
    (zero before the first launch, left at zero); sampled int32 [1]. Truncation is on when
    0 < top_k < V, top_p < 1 or min_p > 0. Keys: the order key of a logit is its fp32 bits as an
    int32, ^ 0x7FFFFFFF when negative (the int32 order is the fp32 order; -0 counts as +0).

    Phase 1, program g over logits [g * TILE, (g + 1) * TILE) (masked past V), loaded once and kept in
    registers. Row g of partials: word 0 the tile max m_g, word 2 its first argmax (int32 bits); with
    temperature > 0, word 1 s_g = sum exp((x - m_g) / T); with truncation, the tile's first
    candidates in the order (logit desc, index asc): the top CAND (by _kth_key, a 4-5-ary search
    whose steps each count four thresholds in one reduction: the CAND-th largest key, every key above
    it and the first ties at it by index), or with top-k <= CAND any prefix of top_k to CAND of them
    (the search stops at the first threshold with that many at or above it: a few steps, not ~10).
    They are written compacted in index order (slot = prefix count - 1): logits in
    words [8, 8 + CAND), indices in [8 + CAND, 8 + 2 * CAND) (int32 bits), padded with -inf / V; word 3
    e_g, the largest key NOT taken (-2^31 when all were), word 4 the count. Word 5 of row 0 gets the
    merge's path (0 greedy, 1 tiles, 2 candidates, 3 full fallback), for tests and profiles.

    Then a CTA barrier and a ticket (an int32 atomic, acquire-release at GPU scope); the program that
    draws G - 1 reads every row back from L2 in program order (so the token never depends on which
    program came last: no float atomics, fixed reduction orders), stores the token and resets the
    ticket to 0. m = max m_g, u = uniform_from(seed, pos).
      greedy: the first index among the tile maxima equal to m.
      temperature, no truncation: D = sum_g s_g exp((m_g - m) / T); the tile by inverse CDF over the
        tile masses in tile order with target u * D, then the token inside it by inverse CDF with the
        rest of the target, its logits re-read (L2-hot); the last tile / index when rounding leaves none.
      truncation: the G * CAND candidates as one vector in vocabulary order, w = exp((x - m) / T).
        top-k <= CAND (the common case): a prefix of top_k to CAND candidates of the merged order by
        _kth_key (every tile's share of the top-k set is among its candidates: it took a prefix of at
        least k); _sample_small compacts it, ranks it pairwise (the top-k set: rank < k, ties by
        index) and does top-p and min-p there, by pairwise prefix masses in the sorted order, then the
        draw.
        otherwise: top-k (k > CAND) as above; top-p: the largest key v whose mass over the top-k set
        (key >= v) reaches top_p * total (total: the top-k set's mass, or D without top-k; _search, a
        mass search), the ties at v kept while their exclusive prefix mass in vocabulary order stays
        below the threshold (the reference's cumsum); min-p: key >= the smallest kept key with w >= min_p;
        the argmax always. The kept set is the reference's order[:L] exactly when every step's set is
        provably the whole vocabulary's: top-k when its k candidates are a prefix of the global order
        (no tile's first left-out logit, e_g, comes before the last kept candidate); top-p without
        top-k likewise for its kept set; when no step bounded the set (top-p without top-k whose
        candidates' mass stays below the threshold, min-p alone), only if every left-out logit fails
        min-p (w(e) < min_p, e = max e_g) or none was left out. The draw is an inverse CDF over the
        kept candidates in vocabulary order.
      fallback (not provable: top-k above CAND with more than CAND of the top-k in one tile; top-p
        or min-p without top-k whose kept set runs past some tile's CAND candidates, e.g. flat or
        high-temperature logits): _sample_full, the same steps over all V logits in BLOCK-wide slices
        inside this one program: exact but slow (10-30 passes over the vocabulary, milliseconds at
        V = 248320).
    """
    pdl_wait(PDL)
    G: tl.constexpr = (V + TILE - 1) // TILE
    Q1: tl.constexpr = (G - 1) | ((G - 1) >> 1)
    Q2: tl.constexpr = Q1 | (Q1 >> 2)
    Q3: tl.constexpr = Q2 | (Q2 >> 4)
    Q4: tl.constexpr = Q3 | (Q3 >> 8)
    GP: tl.constexpr = (Q4 | (Q4 >> 16)) + 1  # G rounded up to a power of two
    W: tl.constexpr = _HDR + 2 * CAND
    pid = tl.program_id(0)
    temperature = tl.load(temperature_ptr)
    top_p = tl.load(top_p_ptr)
    top_k = tl.load(top_k_ptr)
    min_p = tl.load(min_p_ptr)
    k_on = (top_k > 0) & (top_k < V)
    p_on = top_p < 1.0
    mp_on = min_p > 0.0
    trunc = k_on | p_on | mp_on

    offs = pid * TILE + tl.arange(0, TILE)
    valid = offs < V
    x = tl.load(logits_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32)
    m_t = tl.max(x, axis=0)
    row = partials_ptr + pid * W
    tl.store(row, m_t)
    tl.store(row + 2, tl.min(tl.where(x == m_t, offs, V), axis=0).to(tl.float32, bitcast=True))
    if temperature > 0.0:
        inv_t = 1.0 / temperature
        tl.store(row + 1, tl.sum(tl.where(x > float("-inf"), tl.exp((x - m_t) * inv_t), 0.0), axis=0))
        if trunc:
            _tile_candidates(row, x, offs, valid, m_t, k_on, top_k, pid, V, TILE, CAND)

    tl.debug_barrier()  # every thread's stores precede the ticket (released at GPU scope)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    if ticket == G - 1:  # the last program merges the G rows, in program order
        g = tl.arange(0, GP)
        gm = g < G
        head = partials_ptr + g * W
        m_all = tl.load(head, mask=gm, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(m_all, axis=0)
        a_all = tl.load(head + 2, mask=gm, other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
        token = tl.min(tl.where(gm & (m_all == m), a_all, V), axis=0)
        path = tl.zeros([], tl.int32)
        if temperature > 0.0:
            inv_t = 1.0 / temperature
            u = _uniform(tl.load(seed_ptr), tl.load(pos_ptr))
            s_all = tl.load(head + 1, mask=gm, other=0.0, cache_modifier=".cg")
            mass = tl.where(gm & (m_all > float("-inf")), s_all * tl.exp((m_all - m) * inv_t), 0.0)
            D = tl.sum(mass, axis=0)
            if trunc:
                token, path = _merge_candidates(partials_ptr, logits_ptr, m, token, D, inv_t, u, k_on, top_k, p_on,
                                                top_p, mp_on, min_p, V, TILE, CAND, BLOCK, G, GP)
            else:
                token = _merge_tiles(logits_ptr, mass, g, m, inv_t, u * D, V, TILE, G)
                path = tl.full([], 1, tl.int32)
        tl.store(sampled_ptr, token)
        tl.store(partials_ptr + 5, path.to(tl.float32, bitcast=True))
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def step_end_kernel(pos_ptr, sampled_ptr, n_prompt_ptr, tokens_ptr, pos_out_ptr, token_out_ptr, S: tl.constexpr,
                    PDL: tl.constexpr = False):
    """step_end_ref on the device: the next step reads its input token from the dyn buffer, and the
    host reads the sampled tokens from ``tokens`` every few steps."""
    pdl_wait(PDL)
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
                    BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``last_row_ref``: out = x[the chunk's last valid row] (row 0 when none is valid)."""
    pdl_wait(PDL)
    r = tl.maximum(_chunk_rows(tl.load(pos_ptr), tl.load(n_prompt_ptr), ROWS) - 1, 0)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(out_ptr + offs, tl.load(x_ptr + r * N + offs, mask=mask), mask=mask)


@triton.jit
def chunk_last_kernel(pos_ptr, n_prompt_ptr, last_ptr, rows, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr = False):
    """``chunk_last_ref``: dyn.last = pos + (valid rows - 1), or pos when none is valid."""
    pdl_wait(PDL)
    pos = tl.load(pos_ptr)
    tl.store(last_ptr, pos + tl.maximum(_chunk_rows(pos, tl.load(n_prompt_ptr), ROWS) - 1, 0))


@triton.jit
def prefill_end_kernel(pos_ptr, sampled_ptr, n_prompt_ptr, tokens_ptr, pos_out_ptr, token_out_ptr, rows,
                       ROWS: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``prefill_end_ref``: step_end at the chunk's last valid row (pos advances past the valid rows;
    at the prompt's end the sampled token is appended and fed in); with no valid row, pos stays and
    the token is re-read. One program: every read happens before the writes to the same slots."""
    pdl_wait(PDL)
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
