"""The residual add and RMSNorm folded into the matvecs around them (fuse's "norm into matmuls"):
matvec_add_kernel (s = r + W x and per-program partial sums of s^2) and rmsnorm_matvec_kernel /
rmsnorm_matvec_swiglu_kernel (W @ rmsnorm(s) from those partials), in Triton's interpreter against
the torch references for f32, bf16 and q4 weights, chained the way a plan chains them; AOT
compilation for every target at the 27B shapes (one subprocess, the suite runs interpreted)."""
import dataclasses
import json
import math
import os

import pytest
import torch

from kernel_harness import assert_close, interpret, run_aot_main
from kestrel.kernels.matvec import (NORM_AFTER, NORM_PARTIALS, NORM_TILE, matvec_add_kernel, matvec_add_ref,
                                    matvec_kernel, matvec_launch, matvec_ref, matvec_swiglu_kernel, norm_mode,
                                    rmsnorm_matvec_kernel, rmsnorm_matvec_launch, rmsnorm_matvec_ref,
                                    rmsnorm_matvec_swiglu_kernel, rmsnorm_matvec_swiglu_ref)
from kestrel.kernels.rmsnorm import add_rmsnorm_ref
from kestrel.kernels.targets import TARGETS
from test_kernels_matvec import consts_for, make_weight, with_tiles

RTOL = 1e-5
EPS = 1e-6

# (weight kind, hidden H, producer input K0, consumer rows N, producer overrides, consumer overrides):
# the producer is [H, K0] (its partials one per BLOCK_N rows, the last program's rows clamped), the
# consumer [N, H] (the rmsnorm over H inputs).
CASES = [
    ("f32", 40, 300, 24, None, None),
    ("f32", 37, 200, 45, {"BLOCK_N": 8, "BLOCK_K": 128}, {"BLOCK_N": 8, "BLOCK_K": 16}),  # 5 partials, tails
    ("bf16", 64, 96, 30, {"BLOCK_N": 16}, {"BLOCK_N": 4, "BLOCK_K": 32}),
    ("q4g32", 96, 64, 21, {"BLOCK_N": 4}, {"BLOCK_N": 8, "BLOCK_K": 32}),                  # 24 partials
    ("q4g64", 192, 128, 37, {"BLOCK_N": 16, "BLOCK_K": 64}, {"BLOCK_N": 16, "BLOCK_K": 128}),  # masked tile
    ("q4g128", 384, 256, 10, {"BLOCK_N": 8}, {"BLOCK_N": 8, "BLOCK_K": 256}),
    # the whole input in one tile (NORM_TILE), full and masked
    ("bf16", 64, 96, 30, {"BLOCK_N": 16}, {"BLOCK_N": 4, "BLOCK_K": 64}),
    ("f32", 37, 200, 45, {"BLOCK_N": 8, "BLOCK_K": 128}, {"BLOCK_N": 8, "BLOCK_K": 64}),
    ("q4g128", 384, 256, 10, {"BLOCK_N": 8}, {"BLOCK_N": 8, "BLOCK_K": 512}),
    # hidden 2048 at the rule's own launch: the whole input in one 2048-input tile (matvec.q4_norm_short_k)
    ("q4g128", 2048, 128, 12, {"BLOCK_N": 16}, None),
    # q4 with the first tile loaded before the wait (compiler/codegen.py's q4_preload_after): one of several tiles,
    # and all of K in it
    ("q4g64", 192, 256, 37, {"BLOCK_N": 16, "BLOCK_K": 64, "PRELOAD": True}, {"BLOCK_N": 16, "BLOCK_K": 64,
                                                                              "PRELOAD": True}),
    ("q4g128", 384, 1024, 10, {"BLOCK_N": 4, "BLOCK_K": 1024, "PRELOAD": True}, {"BLOCK_N": 8, "BLOCK_K": 512,
                                                                                 "PRELOAD": True}),
]


def _produce(kind, h, k0, override, g):
    """matvec_add_kernel on a random [H, K0] weight: (s, ss), checked against matvec_add_ref at the
    launch's partial rows (BLOCK_N)."""
    w, w_ref, group = make_weight(kind, h, k0, g)
    x, r = torch.randn(k0, generator=g), 4 * torch.randn(h, generator=g)
    c = consts_for(h, k0, group, override)
    p = math.ceil(h / c["BLOCK_N"])
    s = torch.full((h + 16,), float("nan"))
    ss = torch.full((p + 4,), float("nan"))
    interpret(matvec_add_kernel)[(p,)](x, w, r, s, ss, c["BLOCK_N"], **c)
    assert torch.isnan(s[h:]).all() and torch.isnan(ss[p:]).all(), "stored past the rows / partials"
    s_ref, ss_ref = matvec_add_ref(x, w_ref, r, c["BLOCK_N"])
    assert_close(s[:h], s_ref, RTOL, 0.0, f"matvec_add {kind} s")
    assert_close(ss[:p], ss_ref, 1e-5, 0.0, f"matvec_add {kind} ss")
    # the sum the unfused program makes (add_rmsnorm's first result)
    assert_close(s[:h], add_rmsnorm_ref(r, matvec_ref(x, w_ref), torch.zeros(h), EPS)[0], RTOL, 0.0, "s")
    return s[:h], ss[:p]


@pytest.mark.parametrize("kind,block_k", [("q4g64", 64), ("q4g128", 1024)])
def test_q4_preload_gives_the_same_bits(kind, block_k):
    """PRELOAD (compiler/codegen.py's q4_preload_after) only moves the first weight tile's load before the wait:
    matvec_add's s and partials and rmsnorm_matvec's y are bit for bit those without it."""
    g = torch.Generator().manual_seed(block_k)
    h, k0, n = 256, 1024, 24
    w, _, group = make_weight(kind, h, k0, g)
    x, r = torch.randn(k0, generator=g), torch.randn(h, generator=g)
    wn, _, _ = make_weight(kind, n, h, g)
    nw = 0.5 * torch.randn(h, generator=g)
    out = []
    for pre in (False, True):
        c = consts_for(h, k0, group, {"BLOCK_N": 8, "BLOCK_K": block_k, "PRELOAD": pre})
        p = math.ceil(h / 8)
        s, ss = torch.empty(h), torch.empty(p)
        interpret(matvec_add_kernel)[(p,)](x, w, r, s, ss, 8, **c)
        cn = rmsnorm_matvec_launch(n, h, group, p, TARGETS["sm_90"])["constexprs"] | {"BLOCK_N": 8, "BLOCK_K": group,
                                                                                     "PRELOAD": pre, "TOGETHER": False}
        y = torch.empty(n)
        interpret(rmsnorm_matvec_kernel)[(n // 8,)](s, ss, nw, wn, y, EPS, **cn)
        out.append((s, ss, y))
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("kind", ["q4g32", "q4g128"])
def test_q4_one_tile_together_gives_the_same_bits(kind):
    """TOGETHER (``matvec.q4_one_tile_together``): a one-tile q4 matrix's words and scales, both matrices' in the
    swiglu kernels, loaded at once after the wait (before it with PRELOAD): the five one-row kernels give bit for
    bit what they give without it (matvec, matvec_swiglu, matvec_add with its partials, rmsnorm_matvec from the
    partials and from its own tile, rmsnorm_matvec_swiglu). The launch rule sets it only where K is one tile."""
    g = torch.Generator().manual_seed(int(kind[3:]))
    group = int(kind[3:])
    h, n = 256, 24
    w, _, _ = make_weight(kind, h, h, g)
    wg, _, _ = make_weight(kind, n, h, g)
    wu, _, _ = make_weight(kind, n, h, g)
    x, r = torch.randn(h, generator=g), torch.randn(h, generator=g)
    nw = 0.5 * torch.randn(h, generator=g)
    runs = {}
    for pre in (False, True):
        for tog in (False, True):
            c = consts_for(h, h, group, {"BLOCK_N": 8, "BLOCK_K": h, "PRELOAD": pre, "TOGETHER": tog})
            p = h // 8
            out = {}
            out["y"], out["sw"] = torch.empty(h), torch.empty(n)
            interpret(matvec_kernel)[(p,)](x, w, out["y"], **c)
            interpret(matvec_swiglu_kernel)[(n // 8,)](x, wg, wu, out["sw"], **(c | {"N": n}))
            out["s"], out["ss"] = torch.empty(h), torch.empty(p)
            interpret(matvec_add_kernel)[(p,)](x, w, r, out["s"], out["ss"], 8, **c)
            for mode in (NORM_PARTIALS, NORM_TILE):
                cn = rmsnorm_matvec_launch(n, h, group, p, TARGETS["sm_90"])["constexprs"] | {
                    "BLOCK_N": 8, "BLOCK_K": h, "PRELOAD": pre, "TOGETHER": tog, "NORM": mode.value}
                out[f"n{mode.value}"], out[f"nsw{mode.value}"] = torch.empty(n), torch.empty(n)
                interpret(rmsnorm_matvec_kernel)[(n // 8,)](out["s"], out["ss"], nw, wg, out[f"n{mode.value}"], EPS,
                                                            **cn)
                interpret(rmsnorm_matvec_swiglu_kernel)[(n // 8,)](out["s"], out["ss"], nw, wg, wu,
                                                                   out[f"nsw{mode.value}"], EPS, **cn)
            runs[pre, tog] = out
    base = runs[False, False]
    for key, out in runs.items():
        for name, v in out.items():
            assert torch.equal(v, base[name]), f"{kind} PRELOAD, TOGETHER = {key}: {name} differs"
    on = TARGETS["sm_90"]  # (on in the sm_90 rule since stop 46)
    off = dataclasses.replace(on, rules={**on.rules, "matvec": dataclasses.replace(on.rules["matvec"],
                                                                                  q4_one_tile_together=False)})
    for launch, together in ((rmsnorm_matvec_launch(6144, 2048, 128, 8, on, pair=True), True),  # 2B's gate / up
                             (rmsnorm_matvec_launch(8224, 1024, 128, 8, on), True),  # 0.8B's in_proj
                             (matvec_launch(2048, 6144, 128, on), False),  # several tiles
                             (rmsnorm_matvec_launch(6144, 2048, 0, 8, on, pair=True), False),  # bf16
                             (rmsnorm_matvec_launch(6144, 2048, 128, 8, off, pair=True), False)):  # off in the rule
        c = launch["constexprs"]
        assert c["TOGETHER"] == together and (c["K"] == c["BLOCK_K"] or not together), c


def test_norm_mode_picks():
    """The input in one tile: its own sum (any dtype); more tiles: fp weights sum along the loop, q4
    takes the producer's partials; and the launch carries it (27B / 0.8B shapes on sm_90)."""
    assert norm_mode(1024, 1024, 128) == norm_mode(1024, 2048, 0) == NORM_TILE.value
    assert norm_mode(5120, 512, 0) == NORM_AFTER.value and norm_mode(5120, 512, 128) == NORM_PARTIALS.value
    t = TARGETS["sm_90"]
    assert rmsnorm_matvec_launch(17408, 5120, 128, 640, t, pair=True)["constexprs"] | {"P": 0} == \
        matvec_launch(17408, 5120, 128, t, pair=True)["constexprs"] | {"P": 0, "BLOCK_P": 1024,
                                                                       "NORM": NORM_PARTIALS.value}
    c = rmsnorm_matvec_launch(6144, 1024, 0, 1024, t)["constexprs"]
    assert (c["P"], c["BLOCK_P"], c["NORM"]) == (1024, 1024, NORM_TILE.value)


def _modes(kind, h, block_k):
    """The NORM modes a consumer of this dtype and tiling may run: norm_mode's pick first, then the
    others that apply (NORM_TILE needs the input in one tile; q4 never takes NORM_AFTER)."""
    group = 0 if kind in ("f32", "bf16") else int(kind[3:])
    first = norm_mode(h, block_k, group)
    others = [m.value for m in (NORM_PARTIALS, NORM_AFTER, NORM_TILE)
              if not (m.value == NORM_TILE.value and h > block_k) and not (group and m.value == NORM_AFTER.value)]
    return [first] + [m for m in others if m != first]


@pytest.mark.parametrize("kind,h,k0,n,prod,cons", CASES)
def test_norm_folded_into_matvecs(kind, h, k0, n, prod, cons):
    g = torch.Generator().manual_seed(h * 31 + k0 + n)
    s, ss = _produce(kind, h, k0, prod, g)
    nw = 0.5 * torch.randn(h, generator=g)
    w, w_ref, group = make_weight(kind, n, h, g)
    wg, wg_ref, _ = make_weight(kind, n, h, g)
    wu, wu_ref, _ = make_weight(kind, n, h, g)
    base = with_tiles(rmsnorm_matvec_launch(n, h, group, ss.numel(), TARGETS["sm_90"])["constexprs"], cons)
    for mode in _modes(kind, h, base["BLOCK_K"]):
        _consume(s, ss, nw, (w, w_ref), (wg, wg_ref), (wu, wu_ref), n, base | {"NORM": mode}, kind)


def _consume(s, ss, nw, w, wg, wu, n, c, kind):
    (w, w_ref), (wg, wg_ref), (wu, wu_ref) = w, wg, wu
    y = torch.full((n + 16,), float("nan"))
    interpret(rmsnorm_matvec_kernel)[(math.ceil(n / c["BLOCK_N"]),)](s, ss, nw, w, y, EPS, **c)
    assert torch.isnan(y[n:]).all(), "stored past N"
    assert_close(y[:n], rmsnorm_matvec_ref(s, ss, nw, w_ref, EPS), 2e-5, 0.0, f"rmsnorm_matvec {kind} {c}")
    if c["NORM"] == NORM_PARTIALS.value:  # the partials carry the norm: ignoring them is off by far more
        wrong = ss.clone()
        wrong[-1] += ss.sum()
        y2 = torch.full((n + 16,), float("nan"))
        interpret(rmsnorm_matvec_kernel)[(math.ceil(n / c["BLOCK_N"]),)](s, wrong, nw, w, y2, EPS, **c)
        assert (y2[:n] - y[:n]).abs().max() > 0.1 * y[:n].abs().max(), "the partials do not reach the norm"
    y = torch.full((n + 16,), float("nan"))
    interpret(rmsnorm_matvec_swiglu_kernel)[(math.ceil(n / c["BLOCK_N"]),)](s, ss, nw, wg, wu, y, EPS, **c)
    assert torch.isnan(y[n:]).all(), "stored past N"
    ref = rmsnorm_matvec_swiglu_ref(s, ss, nw, wg_ref, wu_ref, EPS)
    assert_close(y[:n], ref, 5e-5, 0.0, f"rmsnorm_matvec_swiglu {kind} {c}")


# --- AOT compilation: every target, the 27B shapes (down_proj feeding the MLP / GDN input projection) ---

H, INTER, IN_PROJ = 5120, 17408, 16480


def _jobs():
    jobs = [(t, kernel, 128) for t in TARGETS for kernel in ("add", "norm", "norm_swiglu")]
    # (q4-together: matvec.q4_one_tile_together at the 2B shape, hidden 2048, where the products are one tile)
    jobs += [(t, kernel, "q4-together") for t in TARGETS for kernel in ("add", "norm", "norm_swiglu")]
    return jobs + [("sm_90", kernel, 0) for kernel in ("add", "norm", "norm_swiglu")]


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel

    target, kernel, group = job
    together = group == "q4-together"
    group = 128 if together else group
    h, inter, in_proj = (2048, 2048, 6144) if together else (H, INTER, IN_PROJ)
    t, wt = TARGETS[target], "*u8" if group else "*bf16"
    if kernel == "add":  # down_proj: s = r + W x, ss
        c = matvec_launch(h, inter, group, t)
        fn, types = matvec_add_kernel, ["*fp32", wt, "*fp32", "*fp32", "*fp32", "i32"]
        consts = c["constexprs"]
    else:
        n = inter if kernel == "norm_swiglu" else in_proj
        p = math.ceil(h / matvec_launch(h, inter, group, t)["constexprs"]["BLOCK_N"])
        c = rmsnorm_matvec_launch(n, h, group, p, t, pair=kernel == "norm_swiglu")
        consts = c["constexprs"]
        fn = rmsnorm_matvec_swiglu_kernel if kernel == "norm_swiglu" else rmsnorm_matvec_kernel
        types = ["*fp32", "*fp32", "*fp32"] + [wt] * (2 if kernel == "norm_swiglu" else 1) + ["*fp32", "fp32"]
    if together:
        consts = consts | {"BLOCK_K": h, "TOGETHER": True}
    ck = compile_kernel(f"{kernel}_{group}", fn, types, consts, c["num_warps"], t.cc,
                        aligned=[ty.startswith("*") for ty in types])
    return {"job": list(job), "cubin": len(ck.cubin), "shared": ck.shared, "arch": ck.arch,
            "params": [ty for _, ty in ck.params], "types": types}


def _aot_main():
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(max(1, min(4, len(os.sched_getaffinity(0))))) as pool:
        print(json.dumps(pool.map(_compile, _jobs(), chunksize=1)))


@pytest.fixture(scope="module")
def aot():
    return {tuple(d["job"]): d for d in run_aot_main("test_kernels_norm_matvec")}


@pytest.mark.parametrize("job", _jobs(), ids=lambda j: f"{j[0]}-{j[1]}-{'q4g128' if j[2] == 128 else j[2] or 'bf16'}")
def test_aot_compile(aot, job):
    d = aot[job]
    assert d["cubin"] > 0 and d["params"] == d["types"]
    cc = TARGETS[job[0]].cc
    assert d["arch"] == f"sm_{cc}" + ("a" if cc >= 90 else "")
    assert d["shared"] <= 99 * 1024, "pipeline buffers must fit the 99 KB of sm_86/89/120 CTAs"
