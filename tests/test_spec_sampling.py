"""Speculative sampling at temperature > 0 (kernels/speculative.py): the filtered distributions, the
draft draw, the acceptance / residual decision and the controlled-acceptance replay — each kernel in
Triton's interpreter against its torch reference — and the statistics: over thousands of seeded draws the
tokens emitted by accept-with-min(1, p/q)-else-residual follow p (a chi-square test at a fixed level),
and the same test rejects deliberately biased acceptance rules."""
import math

import pytest
import torch

from kernel_harness import interpret
from kestrel.kernels import speculative as sp
from kestrel.kernels.sample import sample_ref
from kestrel.kernels.targets import TARGETS
from kestrel.runtime.generate import expected_accepted

SM90 = TARGETS["sm_90"]
FILTERS = [  # (temperature, top_p, top_k, min_p)
    (1.0, 1.0, 0, 0.0), (0.7, 0.8, 20, 0.0), (1.3, 0.9, 0, 0.05), (0.5, 1.0, 5, 0.0), (2.0, 0.6, 0, 0.0),
    (1.0, 1.0, 0, 0.3)]


def i32(v):
    return torch.tensor([v], dtype=torch.int32)


def f32(v):
    return torch.tensor([v], dtype=torch.float32)


def _tile_shape(v, tile, cand):
    g = -(-v // tile)
    return g, 8 + 2 * cand


def spec_scratch(v, rows, tile, cand):
    """Garbage-filled partials (they are scratch between launches) and zeroed tickets."""
    g, w = _tile_shape(v, tile, cand)
    return torch.full((rows * (g + 1), w), float("nan")), torch.zeros(rows, dtype=torch.int32)


def run_filter(logits, filt, part, tickets, tile, cand, block):
    """spec_filter over logits [V] or [R, V]; returns each row's merge path (1 all kept, 2 candidates, 3 the
    one-program search)."""
    t, top_p, top_k, min_p = filt
    rows, v = (1, logits.numel()) if logits.dim() == 1 else logits.shape
    g, w = _tile_shape(v, tile, cand)
    interpret(sp.spec_filter_kernel)[(g, rows)](logits, f32(t), f32(top_p), i32(top_k), f32(min_p), part, tickets,
                                                 V=v, TILE=tile, CAND=cand, BLOCK=block)
    assert not tickets.any()
    return [int(part[r * (g + 1) + g, 6:7].view(torch.int32)[0]) for r in range(rows)]


def run_draft_sample(x, draft, filt, seed, dpos, q, row, tile=16, cand=8, block=16, part=None, tickets=None):
    """spec_filter then draft_sample (one row); returns the filter's path."""
    t, top_p, top_k, min_p = filt
    v = x.numel()
    if part is None:
        part, tickets = spec_scratch(v, 1, tile, cand)
    path = run_filter(x, filt, part, tickets, tile, cand, block) if t > 0 else [0]
    g, _ = _tile_shape(v, tile, cand)
    interpret(sp.draft_sample_kernel)[(g, 1)](x, draft, f32(t), f32(top_p), i32(top_k), f32(min_p), i32(seed),
                                              i32(dpos), q, part, tickets, draft, row, V=v, TILE=tile, CAND=cand)
    assert not tickets.any()
    return path[0]


def run_spec_rows(logits, greedy, q, tokens, replay, pos, filt, seed, replay_on, tile=16, cand=8, block=16,
                  filtered=None):
    """spec_filter over the K + 1 rows (or ``filtered``: (part, tickets) it already made for these logits and
    filter; its result does not depend on the seed), then spec_sample_rows; returns the row tokens."""
    t, top_p, top_k, min_p = filt
    rows, v = logits.shape
    part, tickets = filtered if filtered is not None else spec_scratch(v, rows, tile, cand)
    if filtered is None and t > 0:
        run_filter(logits, filt, part, tickets, tile, cand, block)
    g, _ = _tile_shape(v, tile, cand)
    out = torch.full((rows,), -1, dtype=torch.int32)
    interpret(sp.spec_sample_rows_kernel)[(g, rows)](
        logits, greedy, q, tokens, replay, i32(pos), f32(t), f32(top_p), i32(top_k), f32(min_p), i32(seed),
        i32(replay_on), part, tickets, out, K=rows - 1, S=tokens.numel(), V=v, TILE=tile, CAND=cand)
    assert not tickets.any()
    return out


def _logits(v, seed, ties=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(v, generator=g) * 2
    if ties:  # equal logits across slices and inside one: the order's ties go by index
        x[[3, v - 4]] = x.max() + 0.5
        x[[v // 2, v // 2 + 1, 7]] = float(x[v // 3])
    return x


@pytest.mark.parametrize("v,block,filt", [(37, 16, f) if i % 2 else (300, 128, f) for i, f in enumerate(FILTERS)])
def test_filtered_probs_keep_the_samplers_set(v, block, filt):
    """filtered_probs_ref keeps exactly sample_ref's set (every token sample_ref draws over many seeds has
    p > 0, and the kept mass is 1); draft_sample's kernel writes the same q row and draws the same draft."""
    t, top_p, top_k, min_p = filt
    x = _logits(v, v + top_k)
    p = sp.filtered_probs_ref(x, t, top_p, top_k, min_p)
    assert abs(float(p.sum()) - 1) < 1e-5
    drawn = {sample_ref(x, t, top_p, top_k, min_p, s, 0) for s in range(300)}
    assert all(p[i] > 0 for i in drawn) and len(drawn) > 1
    if top_k:
        assert int((p > 0).sum()) <= top_k
    for seed, dpos in [(7, 11)]:
        q = torch.zeros(3, v)
        q_ref = q.clone()
        draft = i32(-5)
        run_draft_sample(x, draft, filt, seed, dpos, q, 1, tile=block, cand=8, block=block)
        want = sp.draft_sample_ref(x, -5, t, top_p, top_k, min_p, seed, dpos, q_ref, 1)
        assert torch.allclose(q, q_ref, atol=1e-6) and torch.equal(q_ref[1], p)
        assert int(draft[0]) == want and p[want] > 0
    if filt != FILTERS[0]:
        return
    draft = i32(42)  # greedy: the sampler's argmax stands, no q row written
    q = torch.zeros(3, v)
    run_draft_sample(x, draft, (0.0, top_p, top_k, min_p), 0, 0, q, 1, tile=block, cand=8, block=block)
    assert int(draft[0]) == 42 == sp.draft_sample_ref(x, 42, 0.0, top_p, top_k, min_p, 0, 0, q, 1)
    assert not q.any()


@pytest.mark.parametrize("filt", [(1.0, 1.0, 3, 0.0), (1.0, 0.3, 0, 0.0), (1.0, 0.7, 6, 0.0)])
def test_filtered_cut_inside_a_tie(filt):
    """Equal logits straddling the cut (top-k's k-th token, top-p's crossing token): the ties are kept
    by index, as sample_ref's stable order keeps them, and the kernel's index search finds the same."""
    v, block = 40, 16
    x = torch.linspace(-2.0, 0.0, v)
    x[[5, 21, 30, 33]] = 1.0  # one tie group of four across slices: the 3rd / the crossing falls inside it
    x[12] = 2.0
    p = sp.filtered_probs_ref(x, *filt)
    kept_ties = [i for i in (5, 21, 30, 33) if p[i] > 0]
    assert 0 < len(kept_ties) < 4 and kept_ties == [5, 21, 30, 33][:len(kept_ties)]
    q = torch.zeros(1, v)
    draft = i32(-1)
    run_draft_sample(x, draft, filt, 2, 0, q, 0, tile=block, cand=4, block=block)
    assert torch.allclose(q[0], p, atol=1e-6), (q[0], p)


def _rows_case(v, k, seed, filt, same_q=False):
    """Verify logits [K + 1, V], q rows [K, V] from the head's own logits, drafts drawn from them."""
    t, top_p, top_k, min_p = filt
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, v, generator=g) * 2
    head = logits[:k] + torch.randn(k, v, generator=g) * (0.0 if same_q else 1.5)
    q = torch.zeros(k, v)
    pos, s = 6, 32
    tokens = torch.randint(0, v, (s,), dtype=torch.int32, generator=g)
    for j in range(k):
        tokens[pos + 1 + j] = sp.draft_sample_ref(head[j], 0, t, top_p, top_k, min_p, seed, pos - 1 + j, q, j)
    return logits, q, tokens, pos


@pytest.mark.parametrize("filt,k", [(FILTERS[0], 2), (FILTERS[1], 1), (FILTERS[2], 2)])
def test_spec_sample_rows_kernel_matches_reference(filt, k):
    t, top_p, top_k, min_p = filt
    v, block = 40, 16
    decisions = set()
    for seed in range(3):
        logits, q, tokens, pos = _rows_case(v, k, seed, filt, same_q=seed == 2)
        greedy = sp.argmax_rows_ref(logits)
        replay = torch.arange(32, dtype=torch.int32) + 1000
        for replay_on in (0, 1) if seed == 0 else (0,):
            out = run_spec_rows(logits, greedy, q, tokens, replay, pos, filt, seed, replay_on, tile=block, cand=8,
                                block=block)
            ref = sp.spec_sample_rows_ref(logits, greedy, q, tokens, replay, pos, t, top_p, top_k, min_p, seed,
                                          replay_on)
            assert torch.equal(out, ref), (seed, replay_on, out, ref)
            if replay_on:
                assert ref.tolist() == [1000 + pos + 1 + r for r in range(k + 1)]
            else:
                decisions |= {int(ref[r]) == int(tokens[pos + 1 + r]) for r in range(k)}
    assert decisions == {True, False}  # both acceptances and rejections were exercised
    out = run_spec_rows(logits, greedy, q, tokens, replay, pos, (0.0, 1.0, 0, 0.0), 0, 0, tile=block, cand=8,
                        block=block)  # greedy: argmax_rows' choices pass through
    assert torch.equal(out, greedy)


@pytest.mark.parametrize("accept", [0.0, 0.5, 1.0])
def test_replay_drafts_kernel_matches_reference(accept):
    s, v, pos, rows = 40, 50, 9, 4
    replay = torch.randint(0, v, (s,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    for seed in range(8):
        tokens = torch.arange(s, dtype=torch.int32) + 100
        ref = tokens.clone()
        interpret(sp.replay_drafts_kernel)[(1,)](i32(pos), i32(1), f32(accept), i32(seed), replay, tokens, rows, v,
                                                 S=s, BLOCK_R=4)
        sp.replay_drafts_ref(pos, 1, accept, seed, replay, ref, rows, v)
        assert torch.equal(tokens, ref)
        same = [int(ref[pos + i]) == int(replay[pos + i]) for i in range(1, rows)]
        assert all(same) if accept == 1 else (not any(same) if accept == 0 else True)
        assert torch.equal(ref[:pos + 1], torch.arange(pos + 1, dtype=torch.int32) + 100)  # only the drafts
        assert torch.equal(ref[pos + rows:], torch.arange(pos + rows, s, dtype=torch.int32) + 100)
    tokens = torch.arange(s, dtype=torch.int32)
    interpret(sp.replay_drafts_kernel)[(1,)](i32(pos), i32(0), f32(accept), i32(0), replay, tokens, rows, v,
                                             S=s, BLOCK_R=4)
    assert torch.equal(tokens, torch.arange(s, dtype=torch.int32))  # off: nothing written


def test_replay_acceptance_rate_is_set():
    """Per draft, intact with probability A: the mean leading intact drafts of K = 3 over many seeded
    positions is sum A^i (within 4 standard errors)."""
    for a in (0.0, 0.5, 0.8, 1.0):
        runs = []
        for pos in range(3000):
            intact = [sp.spec_uniform(11, pos + i, sp.CORRUPT) < a for i in range(1, 4)]
            runs.append(next((i for i, ok in enumerate(intact) if not ok), 3))
        mean = sum(runs) / len(runs)
        sd = (sum((r - mean) ** 2 for r in runs) / len(runs)) ** 0.5
        assert abs(mean - expected_accepted(a, 3)) <= 4 * sd / len(runs) ** 0.5 + 1e-9, (a, mean)


# --- the statistics -----------------------------------------------------------------------------------------

def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - alpha (z: the normal quantile; 3.09: alpha = 0.001), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts against p over p's support (a count outside it: infinite)."""
    n = float(counts.sum())
    if counts[p == 0].sum() > 0:
        return math.inf, 1
    keep = p > 0
    e = n * p[keep].double()
    return float(((counts[keep].double() - e) ** 2 / e).sum()), int(keep.sum()) - 1


def _emitted(p_logits, q_logits, filt, draws: int, k: int = 1) -> torch.Tensor:
    """Counts of the token emitted at the first drafted position over ``draws`` seeds: the draft drawn
    from q (draft_sample_ref), then spec_sample_rows_ref's row 0 (accepted draft, or residual draw)."""
    t, top_p, top_k, min_p = filt
    v = p_logits.numel()
    logits = p_logits.repeat(k + 1, 1)
    counts = torch.zeros(v, dtype=torch.int64)
    tokens = torch.zeros(8, dtype=torch.int32)
    for seed in range(draws):
        q = torch.zeros(k, v)
        for j in range(k):
            tokens[2 + j] = sp.draft_sample_ref(q_logits, 0, t, top_p, top_k, min_p, seed, j, q, j)
        out = sp.spec_sample_rows_ref(logits, torch.zeros(k + 1, dtype=torch.int32), q, tokens, tokens, 1, t, top_p,
                                      top_k, min_p, seed, 0)
        counts[int(out[0])] += 1
    return counts


STAT_CASES = [((1.0, 1.0, 0, 0.0), 0), ((0.8, 0.9, 8, 0.0), 1), ((1.0, 1.0, 0, 0.02), 2)]


def _stat_inputs(case_seed):
    g = torch.Generator().manual_seed(100 + case_seed)
    p_logits = torch.randn(12, generator=g)
    q_logits = p_logits + torch.randn(12, generator=g) * 1.2  # a draft model that is off, not useless
    return p_logits, q_logits


@pytest.mark.parametrize("filt,case_seed", STAT_CASES)
def test_speculative_sampling_preserves_the_target_distribution(filt, case_seed):
    """2500 seeded draws at a 12-token vocabulary: the emitted tokens pass a chi-square test against p
    (alpha 0.001), while q itself, a separate plain draw from q, fails it (the test has power)."""
    p_logits, q_logits = _stat_inputs(case_seed)
    p = sp.filtered_probs_ref(p_logits, *filt)
    q = sp.filtered_probs_ref(q_logits, *filt)
    counts = _emitted(p_logits, q_logits, filt, 2500)
    stat, df = _chi2(counts, p)
    assert stat < _chi2_critical(df), f"chi2 {stat:.1f} >= {_chi2_critical(df):.1f} (df {df})"
    plain_q = torch.bincount(torch.tensor([sp.draw_ref(q, sp.spec_uniform(s, 0, 9)) for s in range(2500)]),
                             minlength=12)
    stat_q, df_q = _chi2(plain_q, p)
    assert stat_q > _chi2_critical(df_q)


BIASED = {
    "always accept": lambda u, p, q: p > 0,
    "accept when p > q": lambda u, p, q: p > q,
    "accept with p / (p + q)": lambda u, p, q: u * (p + q) < p,
}


@pytest.mark.parametrize("rule", sorted(BIASED))
def test_the_statistical_test_rejects_a_biased_acceptance_rule(rule, monkeypatch):
    filt, case_seed = STAT_CASES[0]
    p_logits, q_logits = _stat_inputs(case_seed)
    p = sp.filtered_probs_ref(p_logits, *filt)
    monkeypatch.setattr(sp, "accept_rule", BIASED[rule])
    stat, df = _chi2(_emitted(p_logits, q_logits, filt, 800), p)
    assert stat > _chi2_critical(df), f"{rule}: chi2 {stat:.1f} passes"
