"""The speculative iteration's decisions, made on the device (greedy; kestrel's ``--speculative mtp``).

An iteration (compiler/qwen3_5.py, ``lower_speculative``) starts at position pos with tokens[pos] the
last accepted token and tokens[pos + 1 .. pos + K] the K drafts of the previous iteration (or of the
prefill), verifies the K + 1 rows pos .. pos + K in one M-row pass of the target model, and then:

* ``spec_begin_ref``: vend = pos + K + 1, the verify's row bound (rows pos + r < vend are valid);
* ``argmax_rows_ref``: the target's greedy choice at every verified row (the first index among equal
  maxima, as ``sample_ref`` at temperature 0);
* ``accept_ref``: the longest prefix of drafts equal to the target's choices, plus the target's own
  next token: a drafts accepted (0 .. K), tokens[pos + a + 1] = the target's token at row a (the
  accepted drafts already sit at pos + 1 .. pos + a), npos = pos + a + 1 (the next iteration's
  position), dpos = pos + a (the position the next draft chain starts from), sampled = that token;
* ``draft_end_ref``: after each draft of the MTP head, the draft is written at tokens[dpos + 2] (the
  position it predicts; never a prompt position) and dpos advances;
* ``spec_end_ref``: pos = npos, token = the accepted next token: where the one-token step would be.

Every index into the token sequence is clamped into it (the host keeps iterations where they fit).
Kernels: one program each (a handful of scalars), except ``argmax_rows``: one program per row, and the
speculative sampler (below): many programs a row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kestrel.kernels.pdl import pdl_wait
from kestrel.kernels.sample import (SCRATCH_HEADER, _HDR, _KEY_MAX, _KEY_NONE, _candidates, _kth_key, _large_keep,
                                    _sample_shape, _small_keep, _take_top, _tile_candidates, counter_hash,
                                    counter_hash32)
from kestrel.kernels.targets import pow2_at_least


def _clamp(i: int, n: int) -> int:
    return min(max(i, 0), n - 1)


def spec_begin_ref(pos: int, rows: int) -> int:
    """vend: the bound of the verify's rows (pos + r < vend for r < rows)."""
    return pos + rows


def argmax_rows_ref(logits: torch.Tensor) -> torch.Tensor:
    """Per row of logits [R, V]: the first index among equal maxima (i32[R])."""
    return torch.argmax(logits.float(), dim=-1).to(torch.int32)


def accept_ref(targets: torch.Tensor, pos: int, tokens: torch.Tensor) -> tuple[int, int, int, int]:
    """Greedy acceptance of the drafts tokens[pos + 1 .. pos + K] against the target's choices
    targets[0 .. K] (targets[i]: the target's token after row pos + i). Returns (npos, dpos, sampled,
    accepted) and writes tokens[pos + accepted + 1] = sampled (in place)."""
    k, s = targets.numel() - 1, tokens.numel()
    a = 0
    while a < k and int(tokens[_clamp(pos + 1 + a, s)]) == int(targets[a]):
        a += 1
    t = int(targets[a])
    tokens[_clamp(pos + a + 1, s)] = t
    return pos + a + 1, pos + a, t, a


def draft_end_ref(dpos: int, draft: int, n_prompt: int, tokens: torch.Tensor) -> int:
    """A draft made at position dpos predicts the token at dpos + 2: written there unless that is a
    prompt position (a prefill chunk that does not end the prompt drafts in vain). Returns dpos + 1."""
    at = dpos + 2
    if at > n_prompt:
        tokens[_clamp(at, tokens.numel())] = draft
    return dpos + 1


def spec_end_ref(npos: int, sampled: int) -> tuple[int, int]:
    """(pos, token) for the next step: the position after the accepted tokens and the token there."""
    return npos, sampled


def scalar_launch(target) -> dict:
    """spec_begin / accept / draft_end / spec_end: one program of ``target.rules["step_end"]``'s warps."""
    return {"grid": [1, 1, 1], "num_warps": target.rules["step_end"].num_warps, "constexprs": {}}


def argmax_rows_launch(rows: int, vocab: int, target) -> dict:
    """One program per row, each scanning the row in slices of BLOCK (``target.rules["speculative"]``)."""
    r = target.rules["speculative"]
    return {"grid": [rows, 1, 1], "num_warps": r.num_warps,
            "constexprs": {"V": vocab, "BLOCK": min(r.block, pow2_at_least(vocab))}}


@triton.jit
def spec_begin_kernel(pos_ptr, vend_ptr, rows, PDL: tl.constexpr = False):
    """``spec_begin_ref``."""
    pdl_wait(PDL)
    tl.store(vend_ptr, tl.load(pos_ptr) + rows)


@triton.jit
def argmax_rows_kernel(logits_ptr, out_ptr, V: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``argmax_rows_ref``: program r scans row r slice by slice, keeping the largest value and its
    first index (a later slice replaces it only when strictly larger: the first index among ties)."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(logits_ptr + r * V + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        i = tl.min(tl.where(x == m, idx, V), axis=0)
        take = m > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + r, best_i)


@triton.jit
def accept_kernel(targets_ptr, pos_ptr, tokens_ptr, npos_ptr, dpos_ptr, sampled_ptr, accepted_ptr,
                  R: tl.constexpr, S: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    """``accept_ref``: one program; the drafts are read before the one write to the sequence."""
    pdl_wait(PDL)
    pos = tl.load(pos_ptr)
    i = tl.arange(0, BLOCK_R)
    t = tl.load(targets_ptr + i, mask=i < R, other=0)
    d = tl.load(tokens_ptr + tl.minimum(tl.maximum(pos + 1 + i, 0), S - 1), mask=i < R - 1, other=0)
    a = tl.min(tl.where((i < R - 1) & (t != d), i, R - 1), axis=0)
    tok = tl.sum(tl.where(i == a, t, 0), axis=0)
    tl.store(tokens_ptr + tl.minimum(tl.maximum(pos + a + 1, 0), S - 1), tok)
    tl.store(npos_ptr, pos + a + 1)
    tl.store(dpos_ptr, pos + a)
    tl.store(sampled_ptr, tok)
    tl.store(accepted_ptr, a)


@triton.jit
def draft_end_kernel(dpos_ptr, draft_ptr, n_prompt_ptr, tokens_ptr, dpos_out_ptr, S: tl.constexpr,
                     PDL: tl.constexpr = False):
    """``draft_end_ref`` (dpos read before it is advanced in place)."""
    pdl_wait(PDL)
    dpos = tl.load(dpos_ptr)
    at = dpos + 2
    tl.store(tokens_ptr + tl.minimum(tl.maximum(at, 0), S - 1), tl.load(draft_ptr), mask=at > tl.load(n_prompt_ptr))
    tl.store(dpos_out_ptr, dpos + 1)


@triton.jit
def spec_end_kernel(npos_ptr, sampled_ptr, pos_ptr, token_ptr, PDL: tl.constexpr = False):
    """``spec_end_ref``."""
    pdl_wait(PDL)
    tl.store(pos_ptr, tl.load(npos_ptr))
    tl.store(token_ptr, tl.load(sampled_ptr))


# --- speculative sampling at temperature > 0, and controlled acceptance (replay) --------------------------
#
# The distributions. p_r, the target's at verified row r, and q_j, the MTP head's at draft j, are both the
# *filtered* distribution the plain sampler draws from (``sample_ref``): softmax of logits / T over the
# tokens kept by top-k, then top-p over those, then min-p, renormalised (0 elsewhere), each at the
# request's own temperature / top-k / top-p / min-p. ``filtered_probs_ref`` defines it.
#
# An iteration at T > 0 (Leviathan et al. 2023, Chen et al. 2023): draft j was drawn from q_j
# (``draft_sample_ref``, which also keeps q_j as row j of the state ``spec.draft_probs``); at row r < K the
# draft d = tokens[pos + 1 + r] is accepted when u * q_r(d) < p_r(d) (probability min(1, p/q)), and on the
# first rejection the row's token is drawn from the normalised residual max(0, p_r - q_r); row K (all
# accepted) draws from p_K. ``spec_sample_rows_ref`` makes each row's token so that ``accept_ref``'s
# "longest prefix of drafts equal to the row tokens" is exactly this rule: an accepted draft is its own
# row token, and a residual draw never equals a rejected draft (rejection implies p(d) < q(d), so the
# residual is 0 at d). At T = 0 the row tokens are the greedy choices, unchanged.
#
# On the device (many programs a row, kernels/sample.py's design): ``spec_filter`` finds each row's filtered
# distribution (G = ceil(V / TILE) programs a row write per-tile maxima, masses and top-CAND candidates; the
# last to take the row's ticket merges them in program order into the kept set, as the order's prefix ending
# at (kc, ic), and its normaliser Z; the exact one-program search when the candidates cannot prove the set),
# then ``draft_sample`` (G programs: q's tile and its mass; the last draws the draft) or ``spec_sample_rows``
# (G programs a row: the acceptance test, then on rejection the tile's mass of max(0, p - q); the last draws
# the tile by the masses' prefix and the token inside it). The references are unchanged and stay the
# definition (the CPU path runs them); the kernels sum the normaliser and the masses in another order (per
# tile, then tiles in order), so a token can differ only where a uniform lands within rounding of a boundary
# of the inverse CDF or of u * q = p, as with sample_kernel against sample_ref; the tests compare every seed.
#
# The random numbers are counter-based (``spec_uniform``): a hash of (seed, position, purpose), the
# position being that of the token decided, so a run repeats exactly for a seed and a position's draws
# are used by one decision only (positions after a rejection are drawn again in the next iteration;
# nothing emitted ever depended on their earlier draws).
#
# Controlled acceptance (``kestrel-run --draft-source replay:FILE --draft-accept A``): with dyn.replay = 1
# the drafts the verify reads are replaced on the device by a replayed token sequence (state
# ``spec.replay``: a previous greedy run's prompt + tokens), each corrupted with probability 1 - A into
# another token (``replay_drafts_ref``), and the row tokens are the replayed ones (``spec_sample_rows_ref``):
# so draft i is accepted exactly when it and every draft before it were left intact, whatever the model
# computes; the MTP head still runs (its drafts are overwritten), so an iteration does all its work.

ACCEPT, RESIDUAL, DRAFT, CORRUPT, CORRUPT_TOKEN = 1, 2, 3, 4, 5  # the purposes of spec_uniform's draws


def spec_uniform(seed: int, pos: int, purpose: int) -> float:
    """A uniform in [0, 1) with 24 bits from (seed, position, purpose) only."""
    return (counter_hash32(counter_hash32(seed, purpose), pos) >> 8) / float(1 << 24)


def _weights(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """w = exp((x - max x) * (1 / T)) in fp32, as the kernels compute it (max w = 1)."""
    x = logits.float()
    inv_t = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
    return torch.exp((x - x.max()) * inv_t)


def filtered_probs_ref(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """The distribution ``sample_ref`` draws from at temperature > 0, as probabilities [V] (fp32, 0 for the
    tokens top-k / top-p / min-p drop): its kept set order[:L] (order: logits descending, ties by lower
    index), each kept token's w over the kept tokens' sum."""
    x = logits.float()
    w = _weights(x, temperature)
    p, mp = (torch.tensor(v, dtype=torch.float32) for v in (top_p, min_p))
    order = torch.sort(x, descending=True, stable=True).indices
    n = x.numel()
    L = min(n, top_k) if 0 < top_k else n
    if p < 1:
        ws = w[order[:L]]
        L = min(L, 1 + int(torch.searchsorted(torch.cumsum(ws, 0), (p * ws.sum()).reshape(1))[0]))
    if mp > 0:
        L = max(1, min(L, int((w[order[:L]] >= mp).sum())))
    out = torch.zeros(n, dtype=torch.float32)
    kept = order[:L]
    out[kept] = w[kept] / w[kept].sum()
    return out


def draw_ref(weights: torch.Tensor, u: float) -> int:
    """Inverse CDF in vocabulary order: the first index whose running sum of ``weights`` (>= 0) exceeds
    u * their sum; if rounding leaves none, the last index of positive weight."""
    c = torch.cumsum(weights.float(), 0)
    target = torch.tensor(u, dtype=torch.float32) * c[-1]
    hit = ((c > target) & (weights > 0)).nonzero()
    if hit.numel():
        return int(hit[0])
    return int((weights > 0).nonzero()[-1])


def draft_sample_ref(logits, draft: int, temperature: float, top_p: float, top_k: int, min_p: float, seed: int,
                     dpos: int, q: torch.Tensor, row: int) -> int:
    """Draft ``row`` of the chain (made at dpos, predicting the token at dpos + 2). T <= 0: the greedy
    ``draft`` (the sampler's argmax) stands. T > 0: q = filtered_probs_ref of the head's logits is kept in
    q[row] (in place) and the draft drawn from it with spec_uniform(seed, dpos + 2, DRAFT)."""
    if temperature <= 0:
        return int(draft)
    probs = filtered_probs_ref(logits, temperature, top_p, top_k, min_p)
    q[row] = probs
    return draw_ref(probs, spec_uniform(seed, dpos + 2, DRAFT))


def accept_rule(u: float, p: float, q: float) -> bool:
    """Accept a draft with probability min(1, p / q): u * q < p for a uniform u in [0, 1) (the kernel's
    rule; tests swap this function for biased ones to show the statistical test catches them)."""
    return u * q < p


def spec_sample_rows_ref(logits, greedy, q, tokens, replay, pos: int, temperature: float, top_p: float, top_k: int,
                         min_p: float, seed: int, replay_on: int) -> torch.Tensor:
    """Each verified row's token (i32[K + 1]), for ``accept_ref``. T <= 0: ``greedy`` (argmax_rows). T > 0,
    row r < K, draft d = tokens[pos + 1 + r]: d when u * q_r(d) < p_r(d) (u = spec_uniform(seed, pos + 1 + r,
    ACCEPT)), else a draw from max(0, p_r - q_r) (spec_uniform(..., RESIDUAL); d itself if that is all zero,
    i.e. p = q); row K: a draw from p_K (RESIDUAL). replay_on: every row's token is the replayed one,
    replay[pos + 1 + r] (controlled acceptance: the model's choice is not consulted)."""
    rows, v = logits.shape
    k, s = rows - 1, tokens.numel()
    out = greedy.clone().to(torch.int32)
    if temperature > 0:
        for r in range(rows):
            p = filtered_probs_ref(logits[r], temperature, top_p, top_k, min_p)
            at = pos + 1 + r
            u2 = spec_uniform(seed, at, RESIDUAL)
            if r == k:
                out[r] = draw_ref(p, u2)
                continue
            d = min(max(int(tokens[_clamp(at, s)]), 0), v - 1)
            if accept_rule(spec_uniform(seed, at, ACCEPT), float(p[d]), float(q[r, d])):
                out[r] = d
                continue
            res = torch.clamp(p - q[r].float(), min=0.0)
            out[r] = draw_ref(res, u2) if float(res.sum()) > 0 else d
    if replay_on:
        out = torch.tensor([int(replay[_clamp(pos + 1 + r, s)]) for r in range(rows)], dtype=torch.int32)
    return out


def corrupt_ref(token: int, seed: int, at: int, vocab: int) -> int:
    """A token other than ``token`` (vocab >= 2), chosen by spec_uniform(seed, at, CORRUPT_TOKEN)."""
    off = 1 + min(int(spec_uniform(seed, at, CORRUPT_TOKEN) * (vocab - 1)), vocab - 2)
    return (token + off) % vocab


def replay_drafts_ref(pos: int, replay_on: int, replay_accept: float, seed: int, replay: torch.Tensor,
                      tokens: torch.Tensor, rows: int, vocab: int) -> None:
    """With replay_on: the drafts tokens[pos + 1 .. pos + rows - 1] <- the replayed tokens there, each left
    intact when spec_uniform(seed, position, CORRUPT) < replay_accept, else corrupt_ref's other token."""
    if not replay_on:
        return
    s = tokens.numel()
    a = torch.tensor(replay_accept, dtype=torch.float32)
    for i in range(1, rows):
        at = _clamp(pos + i, s)
        t = int(replay[at])
        tokens[at] = t if torch.tensor(spec_uniform(seed, pos + i, CORRUPT), dtype=torch.float32) < a \
            else corrupt_ref(t, seed, pos + i, vocab)


def spec_sampler_shape(vocab: int, target) -> tuple[int, int, int, int]:
    """(TILE, CAND, G, BLOCK): the plain sampler's (kernels/sample.py ``sample_launch``, ``target.rules["sample"]``)."""
    return _sample_shape(vocab, target)


def spec_scratch_shape(rows: int, vocab: int, target) -> tuple[int, int]:
    """The scratch the speculative sampler's launches share (f32 [rows * (G + 1), W], W = 8 + 2 * CAND): per
    row r (a verified row, or row 0 for a draft) G tile rows of W words (the filter's per-tile partials, laid
    out as sample_kernel's; then the finishing launch's per-tile masses in word 6) and one row of the
    filter's result (``spec_filter_kernel``'s docstring). The tickets: i32 [rows]."""
    _, cand, g, _ = spec_sampler_shape(vocab, target)
    return rows * (g + 1), SCRATCH_HEADER + 2 * cand


def spec_filter_launch(rows: int, vocab: int, target) -> dict:
    """spec_filter: grid [G, rows], G = ceil(V / TILE) programs per row of the plain sampler's warps; the last
    program of each row to take its ticket merges (TILE, CAND, BLOCK as sample_launch)."""
    tile, cand, g, block = spec_sampler_shape(vocab, target)
    return {"grid": [g, rows, 1], "num_warps": target.rules["sample"].num_warps,
            "constexprs": {"V": vocab, "TILE": tile, "CAND": cand, "BLOCK": block}}


def spec_rows_launch(rows: int, vocab: int, target) -> dict:
    """spec_sample_rows (rows = K + 1) and draft_sample (rows = 1): grid [G, rows], as spec_filter."""
    tile, cand, g, _ = spec_sampler_shape(vocab, target)
    return {"grid": [g, rows, 1], "num_warps": target.rules["sample"].num_warps,
            "constexprs": {"V": vocab, "TILE": tile, "CAND": cand}}


def spec_filter_ref(logits, temperature, top_p, top_k, min_p, partials, tickets) -> None:
    """The CPU path keeps nothing: the filter's result (kept set and normaliser) is what
    ``draft_sample_ref`` and ``spec_sample_rows_ref`` compute through ``filtered_probs_ref``."""
    return None


@triton.jit
def _spec_uniform(seed, pos, purpose: tl.constexpr):
    """spec_uniform on the device."""
    h = counter_hash(seed, tl.full([], purpose, tl.int32))
    return (counter_hash(h, pos) >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _key(x):
    """The int32 whose order is the order of the fp32 x (bits ^ 0x7FFFFFFF when negative; -0 as +0)."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _in_prefix(key, idx, kc, ic):
    """Membership of the prefix of the order (key descending, index ascending) that ends at (kc, ic)."""
    return (key > kc) | ((key == kc) & (idx <= ic))


@triton.jit
def _agg(x, idx, key, inl, m, inv_t, mass):
    """The values a prefix search adds up: w = exp((x - m) * inv_t) with ``mass``, else 1, on ``inl``."""
    return tl.where(inl, tl.where(mass, tl.exp((x - m) * inv_t), 1.0), 0.0)


@triton.jit
def _prefix_cut(x_ptr, m, inv_t, lim_kc, lim_ic, goal_count, frac, mass, V: tl.constexpr, BLOCK: tl.constexpr):
    """The shortest prefix of the order, within the prefix (lim_kc, lim_ic), whose count reaches goal_count
    (or with ``mass``, whose sum of w = exp((x - m) * inv_t) reaches frac * the limit's), as its last element
    (kc, ic); the limit itself when the whole limit falls short. A sweep for the limit's total, then two
    16-ary searches, each pass a sweep over the row: the last element's key (the largest kc with
    agg(key >= kc) >= goal), then, only when several tokens share key kc (a sweep counts them), its index
    among them (the smallest ic with agg(key > kc) + agg(key == kc, index <= ic) >= goal). ``mass`` is a runtime flag: one copy of the code serves top-k
    and top-p."""
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, 16).to(tl.int64)
    total = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(x_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        key = _key(x)
        total += tl.sum(_agg(x, idx, key, (idx < V) & _in_prefix(key, idx, lim_kc, lim_ic), m, inv_t, mass), axis=0)
    goal = tl.where(mass, frac * total, goal_count)
    kc = lim_kc
    ic = lim_ic
    if total >= goal:
        lo = tl.full([], -2147483648, tl.int64)  # agg(key >= lo) = total >= goal
        hi = tl.full([], 2147483647, tl.int64)
        while lo < hi:
            step = (hi - lo) // 16 + 1
            t = lo + j * step
            f = tl.zeros([16], tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                x = tl.load(x_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
                key = _key(x)
                val = _agg(x, idx, key, (idx < V) & _in_prefix(key, idx, lim_kc, lim_ic), m, inv_t, mass)
                f += tl.sum(tl.where(key.to(tl.int64)[None, :] >= t[:, None], val[None, :], 0.0), axis=1)
            ok = (f >= goal) & (t <= hi)
            nlo = tl.max(tl.where(ok, t, lo), axis=0)
            hi = tl.min(tl.where((t > nlo) & (t <= hi), t - 1, hi), axis=0)
            lo = nlo
        kc = lo.to(tl.int32)
        ties = tl.zeros([], tl.int32)  # the limit's tokens at key kc; with one, the prefix ends at it
        last = tl.full([], -1, tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(x_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            key = _key(x)
            tie = (idx < V) & (key == kc) & _in_prefix(key, idx, lim_kc, lim_ic)
            ties += tl.sum(tie.to(tl.int32), axis=0)
            last = tl.maximum(last, tl.max(tl.where(tie, idx, -1), axis=0))
        lo = tl.zeros([], tl.int64)  # the smallest ic with the goal reached: in [lo, hi]
        hi = tl.full([], V - 1, tl.int64)
        if ties <= 1:
            lo = last.to(tl.int64)
            hi = lo
        while lo < hi:
            step = (hi - lo) // 16 + 1
            t = lo + j * step
            f = tl.zeros([16], tl.float32)
            for start in range(0, V, BLOCK):
                idx = start + offs
                x = tl.load(x_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
                key = _key(x)
                val = _agg(x, idx, key, (idx < V) & (key >= kc) & _in_prefix(key, idx, lim_kc, lim_ic), m, inv_t,
                           mass)
                f += tl.sum(tl.where((key > kc) | (idx.to(tl.int64)[None, :] <= t[:, None]), val[None, :], 0.0),
                            axis=1)
            ok = (f >= goal) | (t >= hi)
            nhi = tl.min(tl.where(ok, tl.minimum(t, hi), hi), axis=0)
            lo = tl.max(tl.where(~ok & (t < nhi), t + 1, lo), axis=0)
            hi = nhi
        ic = lo.to(tl.int32)
    return kc, ic


@triton.jit
def _filter(x_ptr, temperature, top_p, top_k, min_p, V: tl.constexpr, BLOCK: tl.constexpr):
    """filtered_probs_ref's kept set and normaliser for one row of logits: (m, inv_t, kc, ic, Z): token i is
    kept when it lies in the order's prefix ending at (kc, ic) and w_i >= min_p (w_i = exp((x_i - m) *
    inv_t)); its probability is w_i / Z. Top-k, then top-p over the top-k set: one prefix search each."""
    offs = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        m = tl.maximum(m, tl.max(tl.load(x_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32), axis=0))
    inv_t = 1.0 / temperature
    kc = tl.full([], -2147483648, tl.int32)  # the whole vocabulary
    ic = tl.full([], V - 1, tl.int32)
    for phase in range(2):  # 0: top-k (a count), 1: top-p (a mass within the top-k set)
        mass = phase == 1
        if tl.where(mass, top_p < 1.0, (top_k > 0) & (top_k < V)):
            kc, ic = _prefix_cut(x_ptr, m, inv_t, kc, ic, top_k.to(tl.float32), top_p, mass, V, BLOCK)
    z = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        idx = start + offs
        x = tl.load(x_ptr + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        w = tl.exp((x - m) * inv_t)
        z += tl.sum(tl.where((idx < V) & _in_prefix(_key(x), idx, kc, ic) & (w >= min_p), w, 0.0), axis=0)
    return m, inv_t, kc, ic, z


@triton.jit
def _probs(x, idx, m, inv_t, kc, ic, min_p, z, V: tl.constexpr):
    """The filtered probabilities of a slice of logits x at indices idx."""
    w = tl.exp((x - m) * inv_t)
    return tl.where((idx < V) & _in_prefix(_key(x), idx, kc, ic) & (w >= min_p), w / z, 0.0)


@triton.jit
def _prefix_end(keep, key, idx):
    """The last element (kc, ic) in the order (key desc, index asc) of a kept set that is a prefix of it."""
    kc = tl.min(tl.where(keep, key, _KEY_MAX), axis=0)
    return kc, tl.max(tl.where(keep & (key == kc), idx, -1), axis=0)


@triton.jit
def spec_filter_kernel(logits_ptr, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, partials_ptr, tickets_ptr,
                       V: tl.constexpr, TILE: tl.constexpr, CAND: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """The filtered distribution of each row of logits [R, V] (``filtered_probs_ref``'s kept set and normaliser),
    many programs a row: grid [G, R], G = ceil(V / TILE); nothing at temperature <= 0.

    Phase 1, program (g, r) over the row's logits [g * TILE, (g + 1) * TILE): sample_kernel's phase 1 into
    tile row g of row r's scratch block (base = partials + r * (G + 1) * W): the tile max and first argmax,
    s_g = sum exp((x - m_g) / T), and with truncation (top-k, top-p or min-p on) the tile's first CAND
    candidates in the order (logit desc, index asc), its first left-out key and the count. Then the row's
    ticket; the program that draws G - 1 merges the G rows in program order (no float atomics) as
    sample_kernel's merge does, but keeps the kept set instead of drawing from it: the kept set is a prefix of
    the order (top-k, then top-p over it, then min-p), stored as its last element (kc, ic), so that token i
    is kept when key_i > kc or (key_i == kc and i <= ic), and the normaliser Z = the kept tokens' sum of
    w = exp((x - m) / T):
      no truncation: every token, Z = sum_g s_g exp((m_g - m) / T)  (path 1);
      top-k <= CAND: _small_keep over the candidates' prefix (path 2);
      otherwise: _large_keep, when it proves the candidates' kept set is the whole vocabulary's (path 2),
        else the exact one-program search over the row (``_filter``: slow, ~25 sweeps; path 3: top-k above
        CAND with more than CAND of the top-k in one tile, top-p or min-p without top-k whose kept set runs
        past a tile's candidates, e.g. flat or high-temperature logits).
    The merge writes row G of the block: word 0 m, 1 inv_t = 1 / T, 2 kc, 3 ic (int32 bits), 4 Z, 5 the
    min-p still to apply (0: folded into (kc, ic); path 3's kept set is (kc, ic) and w >= min_p), 6 the path;
    and puts the ticket back at 0. ``draft_sample_kernel`` and ``spec_sample_rows_kernel`` read it."""
    pdl_wait(PDL)
    G: tl.constexpr = (V + TILE - 1) // TILE
    Q1: tl.constexpr = (G - 1) | ((G - 1) >> 1)
    Q2: tl.constexpr = Q1 | (Q1 >> 2)
    Q3: tl.constexpr = Q2 | (Q2 >> 4)
    Q4: tl.constexpr = Q3 | (Q3 >> 8)
    GP: tl.constexpr = (Q4 | (Q4 >> 16)) + 1  # G rounded up to a power of two (sample_kernel's GP)
    W: tl.constexpr = _HDR + 2 * CAND
    pid = tl.program_id(0)
    r = tl.program_id(1)
    temperature = tl.load(temperature_ptr)
    if temperature > 0.0:
        top_p = tl.load(top_p_ptr)
        top_k = tl.load(top_k_ptr)
        min_p = tl.load(min_p_ptr)
        k_on = (top_k > 0) & (top_k < V)
        p_on = top_p < 1.0
        mp_on = min_p > 0.0
        trunc = k_on | p_on | mp_on
        inv_t = 1.0 / temperature
        x_row = logits_ptr + r.to(tl.int64) * V
        base = partials_ptr + r * ((G + 1) * W)
        offs = pid * TILE + tl.arange(0, TILE)
        valid = offs < V
        x = tl.load(x_row + offs, mask=valid, other=float("-inf")).to(tl.float32)
        # a NaN logit (the q4 product's range, kernels/matvec.py: an MTP draft's) counts as -inf, never kept: an
        # all-NaN tile would otherwise store no argmax (V), and the merge would read past the row with it
        x = tl.where(x == x, x, float("-inf"))
        m_t = tl.max(x, axis=0)
        row = base + pid * W
        tl.store(row, m_t)
        tl.store(row + 2, tl.min(tl.where(x == m_t, offs, V), axis=0).to(tl.float32, bitcast=True))
        tl.store(row + 1, tl.sum(tl.where(x > float("-inf"), tl.exp((x - m_t) * inv_t), 0.0), axis=0))
        if trunc:  # the tile's candidates, as sample_kernel takes them
            _tile_candidates(row, x, offs, valid, m_t, k_on, top_k, pid, V, TILE, CAND)
        tl.debug_barrier()  # every thread's stores precede the ticket (released at GPU scope)
        ticket = tl.atomic_add(tickets_ptr + r, 1, sem="acq_rel", scope="gpu")
        if ticket == G - 1:  # the last program of the row merges its G tile rows, in program order
            g = tl.arange(0, GP)
            gm = g < G
            head = base + g * W
            m_all = tl.load(head, mask=gm, other=float("-inf"), cache_modifier=".cg")
            m = tl.max(m_all, axis=0)
            a_all = tl.load(head + 2, mask=gm, other=0.0, cache_modifier=".cg").to(tl.int32, bitcast=True)
            arg = tl.min(tl.where(gm & (m_all == m), a_all, V), axis=0)
            s_all = tl.load(head + 1, mask=gm, other=0.0, cache_modifier=".cg")
            z = tl.sum(tl.where(gm & (m_all > float("-inf")), s_all * tl.exp((m_all - m) * inv_t), 0.0), axis=0)
            kc = tl.full([], _KEY_NONE, tl.int32)  # no truncation: every token
            ic = tl.full([], V - 1, tl.int32)
            mp_left = tl.zeros([], tl.float32)
            path = tl.full([], 1, tl.int32)
            if trunc:
                xc, idx, cv, key, w = _candidates(base, m, inv_t, V, CAND, G, GP)
                path = tl.full([], 2, tl.int32)
                if k_on & (top_k <= CAND):  # the top-k set is inside the candidates
                    kept = _take_top(key, cv, _kth_key(key, cv, top_k, m, CAND), CAND)
                    keep, ws, ids, ks = _small_keep(base, xc, idx, kept, m, arg, inv_t,
                                                    tl.sum(kept.to(tl.int32), axis=0), top_k, p_on, top_p, mp_on,
                                                    min_p, V, CAND)
                    kc, ic = _prefix_end(keep, ks, ids)
                    z = tl.sum(tl.where(keep, ws, 0.0), axis=0)
                else:
                    kept, exact = _large_keep(base, key, idx, cv, w, m, arg, z, inv_t, k_on, top_k, p_on, top_p,
                                              mp_on, min_p, TILE, CAND, G, GP)
                    if exact:
                        kc, ic = _prefix_end(kept, key, idx)
                        z = tl.sum(tl.where(kept, w, 0.0), axis=0)
                    else:  # not provable from the candidates: the exact one-program search (slow)
                        _m, _i, kc, ic, z = _filter(x_row, temperature, top_p, top_k, min_p, V, BLOCK)
                        mp_left = min_p
                        path = tl.full([], 3, tl.int32)
            prm = base + G * W
            tl.store(prm, m)
            tl.store(prm + 1, inv_t)
            tl.store(prm + 2, kc.to(tl.float32, bitcast=True))
            tl.store(prm + 3, ic.to(tl.float32, bitcast=True))
            tl.store(prm + 4, z)
            tl.store(prm + 5, mp_left)
            tl.store(prm + 6, path.to(tl.float32, bitcast=True))
            tl.atomic_xchg(tickets_ptr + r, 0, sem="relaxed", scope="gpu")  # ready for the next launch


@triton.jit
def _filter_result(prm):
    """spec_filter_kernel's result row: (m, inv_t, kc, ic, Z, min-p left)."""
    m = tl.load(prm, cache_modifier=".cg")
    inv_t = tl.load(prm + 1, cache_modifier=".cg")
    kc = tl.load(prm + 2, cache_modifier=".cg").to(tl.int32, bitcast=True)
    ic = tl.load(prm + 3, cache_modifier=".cg").to(tl.int32, bitcast=True)
    return m, inv_t, kc, ic, tl.load(prm + 4, cache_modifier=".cg"), tl.load(prm + 5, cache_modifier=".cg")


@triton.jit
def _tile_weights(x_row, q_row, pid, m, inv_t, kc, ic, mp, z, resid, V: tl.constexpr, TILE: tl.constexpr):
    """Tile pid's indices and draw weights: p (the filtered probabilities), or with ``resid`` max(0, p - q)."""
    idx = pid * TILE + tl.arange(0, TILE)
    valid = idx < V
    x = tl.load(x_row + idx, mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.where(x == x, x, float("-inf"))  # NaN: -inf, as spec_filter takes it
    q = tl.load(q_row + idx, mask=valid & resid, other=0.0)
    return idx, tl.maximum(_probs(x, idx, m, inv_t, kc, ic, mp, z, V) - q, 0.0)


@triton.jit
def _two_level_draw(base, x_row, q_row, m, inv_t, kc, ic, mp, z, u, resid, V: tl.constexpr, TILE: tl.constexpr,
                    CAND: tl.constexpr, G: tl.constexpr):
    """draw_ref over the row's weights (_tile_weights) from the G tile masses in word 6 of the tile rows: the
    tile by inverse CDF over the masses in tile order (target u * their sum), then the token inside it by
    inverse CDF with the rest of the target, its weights recomputed (L2-hot); the last token of positive
    weight in the chosen tile (the last tile of positive mass) when rounding leaves none. Returns (token
    or -1, the total mass)."""
    Q1: tl.constexpr = (G - 1) | ((G - 1) >> 1)
    Q2: tl.constexpr = Q1 | (Q1 >> 2)
    Q3: tl.constexpr = Q2 | (Q2 >> 4)
    Q4: tl.constexpr = Q3 | (Q3 >> 8)
    GP: tl.constexpr = (Q4 | (Q4 >> 16)) + 1  # G rounded up to a power of two (sample_kernel's GP)
    W: tl.constexpr = _HDR + 2 * CAND
    g = tl.arange(0, GP)
    mass = tl.load(base + g * W + 6, mask=g < G, other=0.0, cache_modifier=".cg")
    mass = tl.where(mass > 0.0, mass, 0.0)  # (NaN weights, from non-finite logits, count as none)
    total = tl.sum(mass, axis=0)
    target = u * total
    cm = tl.cumsum(mass, axis=0)
    gsel = tl.min(tl.where((cm > target) & (mass > 0.0), g, GP), axis=0)
    gsel = tl.where(gsel < GP, gsel, tl.max(tl.where(mass > 0.0, g, 0), axis=0))
    rem = target - tl.sum(tl.where(g == gsel, cm - mass, 0.0), axis=0)
    idx, wv = _tile_weights(x_row, q_row, gsel, m, inv_t, kc, ic, mp, z, resid, V, TILE)
    first = tl.min(tl.where((tl.cumsum(wv, axis=0) > rem) & (wv > 0.0), idx, V), axis=0)
    return tl.where(first < V, first, tl.max(tl.where(wv > 0.0, idx, -1), axis=0)), total


@triton.jit
def draft_sample_kernel(logits_ptr, draft_ptr, temperature_ptr, top_p_ptr, top_k_ptr, min_p_ptr, seed_ptr, dpos_ptr,
                        q_ptr, partials_ptr, tickets_ptr, draft_out_ptr, row, V: tl.constexpr, TILE: tl.constexpr,
                        CAND: tl.constexpr, PDL: tl.constexpr = False):
    """``draft_sample_ref`` after spec_filter (one row: scratch block 0, ticket 0), G programs; at T <= 0
    nothing (the greedy draft stands). Program g writes q[row]'s tile g (the filtered probabilities, 0 outside
    the kept set) and its mass; the last to take the ticket draws the draft from q (_two_level_draw,
    spec_uniform(seed, dpos + 2, DRAFT))."""
    pdl_wait(PDL)
    G: tl.constexpr = (V + TILE - 1) // TILE
    W: tl.constexpr = _HDR + 2 * CAND
    pid = tl.program_id(0)
    temperature = tl.load(temperature_ptr)
    if temperature > 0.0:
        m, inv_t, kc, ic, z, mp = _filter_result(partials_ptr + G * W)
        q_row = q_ptr + tl.cast(row, tl.int64) * V
        idx, p = _tile_weights(logits_ptr, q_row, pid, m, inv_t, kc, ic, mp, z, False, V, TILE)
        tl.store(q_row + idx, p, mask=idx < V)
        tl.store(partials_ptr + pid * W + 6, tl.sum(p, axis=0))
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == G - 1:
            u = _spec_uniform(tl.load(seed_ptr), tl.load(dpos_ptr) + 2, 3)  # DRAFT
            tok, total = _two_level_draw(partials_ptr, logits_ptr, q_row, m, inv_t, kc, ic, mp, z, u, False, V, TILE,
                                         CAND, G)
            # no token of positive weight (non-finite logits: the q4 product's range, kernels/matvec.py): the
            # greedy draft stands, never an id outside the vocabulary (the next embedding would read past the table)
            tl.store(draft_out_ptr, tok, mask=(total > 0.0) & (tok >= 0) & (tok < V))
            tl.atomic_xchg(tickets_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def spec_sample_rows_kernel(logits_ptr, greedy_ptr, q_ptr, tokens_ptr, replay_ptr, pos_ptr, temperature_ptr, top_p_ptr,
                            top_k_ptr, min_p_ptr, seed_ptr, replay_on_ptr, partials_ptr, tickets_ptr, out_ptr,
                            K: tl.constexpr, S: tl.constexpr, V: tl.constexpr, TILE: tl.constexpr,
                            CAND: tl.constexpr, PDL: tl.constexpr = False):
    """``spec_sample_rows_ref`` after spec_filter over the K + 1 rows: grid [G, K + 1]. At T <= 0 program
    (0, r) writes the greedy choice. At T > 0 every program of row r makes the acceptance test itself (p(d) from
    the filter's result, q(d) from q's row r: a few loads); when the draft is rejected (and at row K) program g
    writes its tile's mass of max(0, p - q) (row K: of p); the last to take row r's ticket writes d when
    accepted, else the two-level draw (d itself when the residual is all zero)."""
    pdl_wait(PDL)
    G: tl.constexpr = (V + TILE - 1) // TILE
    W: tl.constexpr = _HDR + 2 * CAND
    pid = tl.program_id(0)
    r = tl.program_id(1)
    pos = tl.load(pos_ptr)
    at = pos + 1 + r
    at_c = tl.minimum(tl.maximum(at, 0), S - 1)
    replay_on = tl.load(replay_on_ptr) != 0
    temperature = tl.load(temperature_ptr)
    if temperature > 0.0:
        seed = tl.load(seed_ptr)
        base = partials_ptr + r * ((G + 1) * W)
        m, inv_t, kc, ic, z, mp = _filter_result(base + G * W)
        x_row = logits_ptr + r.to(tl.int64) * V
        q_row = q_ptr + tl.minimum(r, K - 1).to(tl.int64) * V
        drafted = r < K  # row K (every draft accepted) draws from p
        d = tl.minimum(tl.maximum(tl.load(tokens_ptr + at_c), 0), V - 1)
        pd = _probs(tl.load(x_row + d).to(tl.float32), d, m, inv_t, kc, ic, mp, z, V)
        qd = tl.load(q_row + d, mask=drafted, other=0.0)
        accepted = drafted & (_spec_uniform(seed, at, 1) * qd < pd)  # ACCEPT: probability min(1, p / q)
        if not accepted:  # the residual max(0, p - q) (row K: p itself)
            idx, wv = _tile_weights(x_row, q_row, pid, m, inv_t, kc, ic, mp, z, drafted, V, TILE)
            tl.store(base + pid * W + 6, tl.sum(wv, axis=0))
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + r, 1, sem="acq_rel", scope="gpu")
        if ticket == G - 1:
            tok = d
            if not accepted:
                res, total = _two_level_draw(base, x_row, q_row, m, inv_t, kc, ic, mp, z,
                                             _spec_uniform(seed, at, 2), drafted, V, TILE, CAND, G)  # RESIDUAL
                tok = tl.where((total > 0.0) & (res >= 0), res, d)
            tok = tl.where(replay_on, tl.load(replay_ptr + at_c), tok)
            tl.store(out_ptr + r, tok)
            tl.atomic_xchg(tickets_ptr + r, 0, sem="relaxed", scope="gpu")
    elif pid == 0:
        tok = tl.load(greedy_ptr + r)
        tl.store(out_ptr + r, tl.where(replay_on, tl.load(replay_ptr + at_c), tok))


@triton.jit
def replay_drafts_kernel(pos_ptr, replay_on_ptr, replay_accept_ptr, seed_ptr, replay_ptr, tokens_ptr, rows, vocab,
                         S: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    """``replay_drafts_ref``: one program; nothing unless dyn.replay is set."""
    pdl_wait(PDL)
    if tl.load(replay_on_ptr) != 0:
        pos = tl.load(pos_ptr)
        seed = tl.load(seed_ptr)
        i = tl.arange(0, BLOCK_R)
        live = (i >= 1) & (i < rows)
        at = pos + i
        at_c = tl.minimum(tl.maximum(at, 0), S - 1)
        t = tl.load(replay_ptr + at_c, mask=live, other=0)
        keep = _spec_uniform(seed, at, 4) < tl.load(replay_accept_ptr)  # CORRUPT
        off = 1 + tl.minimum((_spec_uniform(seed, at, 5) * (vocab - 1)).to(tl.int32), vocab - 2)  # CORRUPT_TOKEN
        tl.store(tokens_ptr + at_c, tl.where(keep, t, (t + off) % vocab), mask=live)
