"""The many-program speculative sampler (kernels/speculative.py: spec_filter, then draft_sample or
spec_sample_rows) at a vocabulary of several tiles, in Triton's interpreter against the references for
many seeds: every filter (temperature alone, top-k, top-p, min-p, their mixes, ties straddling top-k, a
top-p so small it is greedy, and the exact one-program fallback for a kept set the candidates cannot
prove), the q rows written (the same kept set, probabilities within rounding), the drafts drawn, and the
verified rows' accepted drafts, residual draws and last-row draws."""
import pytest
import torch

from kernel_harness import interpret
from kestrel.kernels import speculative as sp
from kestrel.kernels.sample import SCRATCH_HEADER
from kestrel.kernels.targets import TARGETS
from test_spec_sampling import run_draft_sample, run_filter, run_spec_rows, spec_scratch

V, TILE, CAND, BLOCK = 3000, 512, 16, 1024  # 6 tiles (the last one partial)


def _logits(kind: str, seed: int = 0, v: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + len(kind))
    x = torch.randn(v, generator=g)
    if kind == "sharp":  # top-p 0.9 keeps a handful of tokens
        return 6 * x
    if kind == "ties":  # 30 tokens at 2.0 and 40 at 1.0 over the tiles: top-50 cuts the 1.0 ties by index
        x = torch.randn(v, generator=g) * 0.1 - 3
        perm = torch.randperm(v, generator=g)
        x[perm[:30]], x[perm[30:70]] = 2.0, 1.0
        return x
    if kind == "flat":  # top-p 0.9 keeps ~2700 tokens: past every tile's candidates
        return x * 0.01
    return 3 * x


# (id, logits, (temperature, top_p, top_k, min_p), the filter's merge path)
CASES = [
    ("temperature", "randn", (1.0, 1.0, 0, 0.0), 1),
    ("top_k", "randn", (1.0, 1.0, 12, 0.0), 2),
    ("top_p", "sharp", (1.0, 0.9, 0, 0.0), 2),
    ("min_p", "randn", (1.0, 1.0, 0, 0.1), 2),
    ("top_k_top_p", "randn", (0.7, 0.8, 20, 0.0), 2),  # top-k above CAND: the large merge, provable
    ("all_three", "randn", (0.7, 0.8, 10, 0.05), 2),
    ("top_p_tiny_is_greedy", "randn", (1.0, 1e-6, 0, 0.0), 2),
    ("ties_straddle_top_k", "ties", (1.0, 1.0, 50, 0.0), 3),  # a tile holds more than CAND of the top-50
    ("ties_straddle_small_top_k", "ties", (1.0, 0.9, 12, 0.0), 2),  # the 2.0 ties cut by index
    ("fallback_flat_top_p", "flat", (1.0, 0.9, 0, 0.0), 3),
]


def test_launch_and_scratch_shape():
    t = TARGETS["sm_90"]
    tile, cand, g, _ = sp.spec_sampler_shape(248320, t)
    assert (tile, cand) == (t.rules["sample"].tile, t.rules["sample"].cand) and g == -(-248320 // tile)
    assert sp.spec_filter_launch(4, 248320, t)["grid"] == [g, 4, 1]
    assert sp.spec_rows_launch(1, 248320, t)["grid"] == [g, 1, 1]
    assert sp.spec_scratch_shape(4, 248320, t) == (4 * (g + 1), SCRATCH_HEADER + 2 * cand)


@pytest.mark.parametrize("kind,filt,path", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_draft_sample_many_programs(kind, filt, path):
    """draft_sample after spec_filter: q[row] holds exactly filtered_probs_ref's kept set (probabilities
    within rounding: the normaliser is summed in another order) and the draft is draft_sample_ref's for
    every seed, through the expected merge path."""
    x = _logits(kind)
    t, top_p, top_k, min_p = filt
    want_q = sp.filtered_probs_ref(x, *filt)
    part, tickets = spec_scratch(V, 1, TILE, CAND)
    assert run_filter(x, filt, part, tickets, TILE, CAND, BLOCK) == [path]
    drawn = set()
    for seed in range(12):
        q = torch.full((2, V), float("nan"))
        q_ref = q.clone()
        draft = torch.tensor([-7], dtype=torch.int32)
        dpos = 5 * seed + 1
        # the filter's result does not depend on the seed: one spec_filter, a draft_sample per seed
        g = -(-V // TILE)
        interpret(sp.draft_sample_kernel)[(g, 1)](
            x, draft, torch.tensor([t]), torch.tensor([top_p]), torch.tensor([top_k], dtype=torch.int32),
            torch.tensor([min_p]), torch.tensor([seed], dtype=torch.int32), torch.tensor([dpos], dtype=torch.int32),
            q, part, tickets, draft, 1, V=V, TILE=TILE, CAND=CAND)
        assert not tickets.any()
        want = sp.draft_sample_ref(x, -7, t, top_p, top_k, min_p, seed, dpos, q_ref, 1)
        assert int(draft[0]) == want, (seed, int(draft[0]), want)
        assert torch.equal(q[1] > 0, want_q > 0) and torch.allclose(q[1], want_q, rtol=1e-5, atol=1e-7)
        assert q[0].isnan().all()  # only row 1 written
        drawn.add(want)
    if top_p < 1e-3:
        assert drawn == {int(torch.argmax(x))}
    elif kind != "flat":
        assert len(drawn) > 1
    # temperature 0: nothing filtered, nothing written, the greedy draft stands
    q = torch.zeros(1, V)
    draft = torch.tensor([42], dtype=torch.int32)
    assert run_draft_sample(x, draft, (0.0,) + filt[1:], 3, 0, q, 0, TILE, CAND, BLOCK) == 0
    assert int(draft[0]) == 42 and not q.any()


def _rows_case(kind, filt, k, case_seed):
    """Verify logits [K + 1, V] and the head's q rows: draft row 0 from the target's own logits (p = q:
    accepted, or a zero residual), row 1 from slightly perturbed ones, the rest from far ones (mostly
    rejected: residual draws)."""
    g = torch.Generator().manual_seed(1000 + case_seed)
    logits = torch.stack([_logits(kind, case_seed * 10 + r) for r in range(k + 1)])
    noise = torch.tensor([0.0, 0.3] + [3.0] * (k - 2)).reshape(k, 1)
    head = logits[:k] + torch.randn(k, V, generator=g) * noise
    q = torch.zeros(k, V)
    for j in range(k):
        q[j] = sp.filtered_probs_ref(head[j], *filt)
    return logits, head, q


@pytest.mark.parametrize("kind,filt,path", [c[1:] for c in CASES if c[0] in (
    "temperature", "top_k", "top_p", "min_p", "all_three", "top_p_tiny_is_greedy")],
    ids=["temperature", "top_k", "top_p", "min_p", "all_three", "top_p_tiny_is_greedy"])
def test_spec_sample_rows_many_programs(kind, filt, path):
    """spec_sample_rows after spec_filter over K + 1 = 4 rows: every row token equals spec_sample_rows_ref's
    for every seed (drafts drawn from q by the reference per seed), and the seeds exercise accepted drafts,
    rejected drafts (residual draws) and the last row's draws from p."""
    k, pos, s = 3, 6, 40
    t, top_p, top_k, min_p = filt
    logits, head, q = _rows_case(kind, filt, k, len(kind))
    greedy = sp.argmax_rows_ref(logits)
    part, tickets = spec_scratch(V, k + 1, TILE, CAND)
    assert run_filter(logits, filt, part, tickets, TILE, CAND, BLOCK) == [path] * (k + 1)
    replay = torch.arange(s, dtype=torch.int32) + 7
    seen = set()
    for seed in range(10):
        tokens = torch.randint(0, V, (s,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
        for j in range(k):
            tokens[pos + 1 + j] = sp.draw_ref(q[j], sp.spec_uniform(seed, pos + 1 + j, sp.DRAFT))
        out = run_spec_rows(logits, greedy, q, tokens, replay, pos, filt, seed, 0, TILE, CAND, BLOCK,
                            filtered=(part, tickets))
        ref = sp.spec_sample_rows_ref(logits, greedy, q, tokens, replay, pos, t, top_p, top_k, min_p, seed, 0)
        assert torch.equal(out, ref), (seed, out, ref)
        p = [sp.filtered_probs_ref(logits[r], *filt) for r in range(k + 1)]
        for r in range(k):
            d = int(tokens[pos + 1 + r])
            seen.add("accepted" if int(ref[r]) == d else "residual")
            assert p[r][int(ref[r])] > 0
        seen.add("last")
    assert seen == {"accepted", "residual", "last"} or (top_p < 1e-3 and "accepted" in seen)
    out = run_spec_rows(logits, greedy, q, tokens, replay, pos, filt, 0, 1, TILE, CAND, BLOCK,
                        filtered=(part, tickets))  # controlled acceptance: the replayed tokens
    assert out.tolist() == [7 + pos + 1 + r for r in range(k + 1)]
    out = run_spec_rows(logits, greedy, q, tokens, replay, pos, (0.0,) + filt[1:], 0, 0, TILE, CAND, BLOCK)
    assert torch.equal(out, greedy)  # temperature 0: argmax_rows' choices


@pytest.mark.parametrize("filt", [(0.7, 0.8, 20, 0.0), (1.0, 1.0, 0, 0.0), (1.0, 0.9, 0, 0.0)],
                         ids=["qwen", "temperature", "top_p"])
def test_non_finite_draft_logits(filt):
    """An MTP head's q4 drafts can be NaN (the q4 product's range, kernels/matvec.py; seen at 27B q4 with
    random weights on the H200, where the GPU read outside the logits until this): spec_filter counts a NaN
    logit as -inf, so every tile's argmax stays inside the row; an all-NaN row keeps the greedy draft, and a
    half-NaN row draws only tokens of finite logits."""
    all_nan = torch.full((V,), float("nan"))
    half = torch.where(torch.arange(V) % 2 == 0, _logits("randn"), torch.tensor(float("nan")))
    g = -(-V // TILE)
    for x, greedy_stays in ((all_nan, True), (half, False)):
        part, tickets = spec_scratch(V, 1, TILE, CAND)
        run_filter(x, filt, part, tickets, TILE, CAND, BLOCK)
        args = part[:g, 2].view(torch.int32)
        assert ((args >= 0) & (args < V)).all(), args
        q = torch.zeros(1, V)
        draft = torch.tensor([42], dtype=torch.int32)
        run_draft_sample(x, draft, filt, 3, 0, q, 0, TILE, CAND, BLOCK)
        assert not tickets.any()
        d = int(draft[0])
        assert d == 42 if greedy_stays else (0 <= d < V and d % 2 == 0), d
