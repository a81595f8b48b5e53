"""Qwen3-Next's MoE kernels (kernels/moe.py) in Triton's interpreter against their torch references:
the router's top-k (moe_topk over the matvec's logits: softmax, top-k with ties, renormalisation) and the grouped expert matvecs reading
the expert ids from the routing buffer (f32, bf16, q4; one row and several rows routed differently);
and each AOT-compiled for every GPU target at the 80B-A3B shapes."""

import dataclasses

import pytest
import torch

from kernel_harness import assert_close, interpret, split_compile_fixture
from kestrel.compiler.ops import OPS
from kestrel.kernels.matvec import matvec_launch, matvec_ref, q4_pack, q4_unpack
from kestrel.kernels.moe import (moe_down_add_kernel, moe_down_add_ref, moe_down_kernel, moe_down_launch, moe_down_ref,
                                 moe_gate_up_kernel, moe_gate_up_launch, moe_gate_up_ref, moe_router_ref, moe_topk_kernel,
                                 moe_topk_launch, rmsnorm_moe_gate_up_kernel, rmsnorm_moe_gate_up_ref, route_ref)
from kestrel.kernels import moe
from kestrel.kernels.targets import ALL_TARGETS, TARGETS, override_rules

SM90 = TARGETS["sm_90"]


def _router(x, w, k, norm, sort=False):
    """The router as the GPU runs it after fuse: the logits (the matvec's product, tested in
    test_kernels_matvec.py) then moe_topk_kernel (``sort``: its SORT form, one bitonic top-k)."""
    rows, h = x.shape
    e = w.shape[0]
    logits = matvec_ref(x, w).contiguous()
    ids = torch.full((rows, k), -7, dtype=torch.int32)
    wts = torch.full((rows, k), float("nan"))
    c = moe_topk_launch(rows, e, k, SM90)
    interpret(moe_topk_kernel)[tuple(c["grid"])](logits, ids, wts, k, norm, **(c["constexprs"] | {"SORT": sort}))
    return ids, wts


@pytest.mark.parametrize("sort", [False, True])
@pytest.mark.parametrize("e,k,norm,dtype", [(8, 2, 1, torch.float32), (60, 10, 1, torch.bfloat16),
                                            (16, 4, 0, torch.float32), (5, 5, 1, torch.bfloat16)])
def test_router(e, k, norm, dtype, sort):
    g = torch.Generator().manual_seed(e + k)
    h = 96  # not a power of two: a masked K tail
    x = torch.randn(3, h, generator=g)
    w = (torch.randn(e, h, generator=g) * h ** -0.5 * 3).to(dtype)
    ids, wts = _router(x, w, k, norm, sort)
    ref_ids, ref_wts = moe_router_ref(x, w, k, norm)
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    assert_close(wts, ref_wts, 1e-6, 1e-7, "routing weights")
    if norm:
        assert torch.allclose(wts.sum(-1), torch.ones(3))
    assert len(set(ids[0].tolist())) == k  # k distinct experts


@pytest.mark.parametrize("sort", [False, True])
def test_router_ties_lower_index_first(sort):
    """Experts 1, 4 and 6 have equal router rows (equal logits, equal probabilities): the kernel (either form)
    and the reference rank the lower index first."""
    g = torch.Generator().manual_seed(3)
    h, e = 64, 8
    w = torch.randn(e, h, generator=g) * 0.1
    x = torch.randn(1, h, generator=g)
    w[4] = w[1] = w[6] = x[0] / x[0].norm() * 2  # the largest logit, three times
    ids, wts = _router(x, w, 2, 1, sort)
    ref_ids, _ = moe_router_ref(x, w, 2, 1)
    assert ids[0].tolist() == ref_ids[0].tolist() == [1, 4]
    assert wts[0, 0] == wts[0, 1] == 0.5


def test_topk_sort_form_equals_the_max_rounds_bit_for_bit():
    """At the 80B-A3B router (E 512, k 10), with a block of tied logits among the largest: the SORT form's ids and
    weights are the serial max rounds' bit for bit (the same distinct keys, the sum in rank order)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 512, generator=g)
    logits[1, 100:140] = logits[1].max()  # 40 experts tied for first place
    out = []
    for sort in (False, True):
        ids = torch.full((2, 10), -7, dtype=torch.int32)
        wts = torch.full((2, 10), float("nan"))
        c = moe_topk_launch(2, 512, 10, SM90)
        interpret(moe_topk_kernel)[tuple(c["grid"])](logits, ids, wts, 10, 1, **(c["constexprs"] | {"SORT": sort}))
        out.append((ids, wts))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert out[1][0][1].tolist() == list(range(100, 110))
    assert torch.equal(out[1][0], moe.moe_topk_ref(logits, 10, 1)[0])


def test_torch_topk_has_no_fixed_tie_order_but_agrees_without_ties():
    """Why the reference does not call torch.topk: on the CPU its order among equal values depends on
    the vector (here it puts a higher index first); without ties it equals route_ref's choice."""
    x = torch.zeros(16)
    x[[3, 5, 9, 11]] = 1
    assert torch.topk(x, 2).indices.tolist() != [3, 5]  # torch 2.13 CPU gives [5, 9]
    assert route_ref(x, 2)[0].tolist() == [3, 5]
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        p = torch.softmax(torch.randn(512, generator=g), -1)
        assert torch.equal(torch.topk(p, 10).indices, route_ref(p, 10)[0])


def _experts(dtype: str, e: int, h: int, inter: int, shared: int, g):
    """Stacked expert weights as the plan stores them (and as the references take them)."""
    def mat(n, k, q4_ok=True):
        w = torch.randn(n, k, generator=g) * k ** -0.5
        if dtype == "q4" and q4_ok:
            grp = 64 if k % 64 == 0 else 32
            buf = q4_pack(w, grp)
            return buf, q4_unpack(buf, n, k, grp), grp
        t = w.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
        return t, t, 0
    names = ("wg", "wu", "sg", "su", "wd", "sd")
    shapes = ((e * inter, h), (e * inter, h), (shared, h), (shared, h), (e * h, inter), (h, shared))
    out = {n: mat(*s) for n, s in zip(names, shapes)}
    out["sgate"] = mat(1, h, q4_ok=False)  # bf16 / f32 (quantize keeps the shared gate unquantised)
    return out


@pytest.mark.parametrize("dtype,rows", [("f32", 1), ("bf16", 1), ("q4", 1), ("bf16", 3), ("q4", 2)])
def test_grouped_experts(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    e, h, inter, shared, k = 6, 128, 64, 96, 3
    w = _experts(dtype, e, h, inter, shared, g)
    x = torch.randn(rows, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)]).to(torch.int32)
    ids[0, 0] = e - 1  # the last expert's rows (the end of the stacked matrices, and of the q4 scales)
    wts = torch.softmax(torch.randn(rows, k, generator=g), -1)
    groups_gu = (w["wg"][2], w["sg"][2], w["sgate"][2])
    c = moe_gate_up_launch(rows, e, h, inter, shared, k, groups_gu, SM90)
    consts = dict(c["constexprs"], BLOCK_N=16)  # several blocks per expert
    act_n = k * inter + shared + 1
    grid = (k * (inter // 16) + shared // 16 + 1, rows)
    act = torch.full((rows, act_n), float("nan"))
    interpret(moe_gate_up_kernel)[grid](x, ids, w["wg"][0], w["wu"][0], w["sg"][0], w["su"][0], w["sgate"][0], act, e,
                                        **consts)
    ref_act = moe_gate_up_ref(x, ids, w["wg"][1], w["wu"][1], w["sg"][1], w["su"][1], w["sgate"][1], e)
    assert_close(act, ref_act, 2e-5, 1e-6, f"moe_gate_up {dtype}")
    d = moe_down_launch(rows, e, h, inter, shared, k, (w["wd"][2], w["sd"][2]), SM90)
    dconsts = dict(d["constexprs"], BLOCK_N=32)
    y = torch.full((rows, h), float("nan"))
    interpret(moe_down_kernel)[(h // 32, rows)](ref_act, ids, wts, w["wd"][0], w["sd"][0], y, **dconsts)
    ref_y = moe_down_ref(ref_act, ids, wts, w["wd"][1], w["sd"][1])
    assert_close(y, ref_y, 2e-5, 1e-6, f"moe_down {dtype}")
    # a wrong expert id changes the result: the kernels read the routing buffer
    ids2 = ids.clone()
    ids2[0, 0] = (ids[0, 0] + 1) % e if (ids[0, 0] + 1) % e not in ids[0].tolist() else ids[0, 0] - 1
    act2 = torch.full((rows, act_n), float("nan"))
    interpret(moe_gate_up_kernel)[grid](x, ids2, w["wg"][0], w["wu"][0], w["sg"][0], w["su"][0], w["sgate"][0], act2,
                                        e, **consts)
    assert not torch.equal(act2[0, :inter], act[0, :inter]) and torch.equal(act2[0, inter:], act[0, inter:])


@pytest.mark.parametrize("dtype", ["bf16", "q4"])
def test_fused_norm_and_residual(dtype):
    """One row with the residual add and the next norm folded in (fuse's rule 7): moe_down_add makes
    s = r + the block's output and its partial sums of s^2; rmsnorm_moe_gate_up norms s from those partials
    per tile. Against the references (the unfused ops composed); the down's expert loop spans two K tiles
    of each expert here (BLOCK_KD = I / 2) as well as one."""
    g = torch.Generator().manual_seed(5)
    e, h, inter, shared, k = 6, 128, 64, 96, 3
    w = _experts(dtype, e, h, inter, shared, g)
    ids = torch.randperm(e, generator=g)[:k].to(torch.int32)
    wts = torch.softmax(torch.randn(k, generator=g), -1)
    act = torch.randn(k * inter + shared + 1, generator=g)
    r = torch.randn(h, generator=g) * 3
    for block_kd in (inter, inter // 2):
        d = moe_down_launch(1, e, h, inter, shared, k, (w["wd"][2], w["sd"][2]), SM90)
        consts = dict(d["constexprs"], BLOCK_N=16, BLOCK_KD=max(block_kd, w["wd"][2]))
        s, ss = torch.full((h,), float("nan")), torch.full((h // 16,), float("nan"))
        interpret(moe_down_add_kernel)[(h // 16, 1)](act, ids, wts, w["wd"][0], w["sd"][0], r, s, ss, 16, **consts)
        ref_s, ref_ss = moe_down_add_ref(act, ids, wts, w["wd"][1], w["sd"][1], r, 16)
        assert_close(s, ref_s, 2e-5, 1e-6, f"moe_down_add {dtype} BLOCK_KD {consts['BLOCK_KD']}")
        assert_close(ss, ref_ss, 2e-5, 1e-6, f"moe_down_add partials {dtype}")
    nw = torch.randn(h, generator=g) * 0.1
    c = moe_gate_up_launch(1, e, h, inter, shared, k, (w["wg"][2], w["sg"][2], w["sgate"][2]), SM90, partials=h // 16)
    consts = dict(c["constexprs"], BLOCK_N=16)
    out = torch.full((k * inter + shared + 1,), float("nan"))
    grid = (k * (inter // 16) + shared // 16 + 1, 1)
    interpret(rmsnorm_moe_gate_up_kernel)[grid](s, ss, nw, ids, w["wg"][0], w["wu"][0], w["sg"][0], w["su"][0],
                                                w["sgate"][0], out, e, 1e-6, **consts)
    ref = rmsnorm_moe_gate_up_ref(ref_s, ref_ss, nw, ids, w["wg"][1], w["wu"][1], w["sg"][1], w["su"][1],
                                  w["sgate"][1], e, 1e-6)
    assert_close(out, ref, 2e-5, 1e-6, f"rmsnorm_moe_gate_up {dtype}")
    # the norm is applied: the same kernel without it differs
    plain = moe_gate_up_ref(ref_s, ids, w["wg"][1], w["wu"][1], w["sg"][1], w["su"][1], w["sgate"][1], e)
    assert not torch.allclose(out, plain, rtol=1e-2, atol=1e-3)


def test_moe_down_gathered_form():
    """moe_down's gathered form (the rule's ``down_gather``: every routed expert's q4 rows in one tile, the
    ranks' products summed as a tree): moe_down at two rows and moe_down_add at one against the references, k = 3
    (one of BLOCK_T's 4 ranks masked), an expert at the end of the stacked matrix and its scales; near the unrolled
    form (same products, another order of the ranks' sum); another expert id changes the result."""
    g = torch.Generator().manual_seed(11)
    e, h, inter, shared, k, rows = 6, 128, 64, 96, 3, 2
    w = _experts("q4", e, h, inter, shared, g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)]).to(torch.int32)
    ids[1, 2] = e - 1
    wts = torch.softmax(torch.randn(rows, k, generator=g), -1)
    act = torch.randn(rows, k * inter + shared + 1, generator=g)
    groups = (w["wd"][2], w["sd"][2])
    def gather(tiles):
        return dataclasses.replace(SM90, rules={**SM90.rules, "moe": dataclasses.replace(SM90.rules["moe"],
                                                                                        down_gather=tiles)})
    d = moe_down_launch(rows, e, h, inter, shared, k, groups, gather((16, 2)))
    assert d["constexprs"]["STAGES"] == -1 and d["constexprs"]["BLOCK_KD"] == inter and d["num_warps"] == 2
    u = moe_down_launch(rows, e, h, inter, shared, k, groups, gather(()))
    assert u["constexprs"]["STAGES"] >= 0
    # the shipped sm_90 rule gathers q4 experts, not floating-point ones
    assert moe_down_launch(rows, e, h, inter, shared, k, groups, SM90)["constexprs"]["STAGES"] == -1
    assert moe_down_launch(rows, e, h, inter, shared, k, (0, 0), SM90)["constexprs"]["STAGES"] >= 0
    grid = (h // 16, rows)

    def down(i):
        y = torch.full((rows, h), float("nan"))
        interpret(moe_down_kernel)[grid](act, i, wts, w["wd"][0], w["sd"][0], y, **d["constexprs"])
        return y
    y = down(ids)
    assert_close(y, moe_down_ref(act, ids, wts, w["wd"][1], w["sd"][1]), 2e-5, 1e-6, "moe_down gathered")
    unrolled = torch.full((rows, h), float("nan"))
    interpret(moe_down_kernel)[(h // u["constexprs"]["BLOCK_N"], rows)](act, ids, wts, w["wd"][0], w["sd"][0], unrolled,
                                                                        **u["constexprs"])
    assert_close(y, unrolled, 1e-6, 1e-7, "gathered against unrolled")
    ids2 = ids.clone()
    ids2[1, 1] = next(x for x in range(e) if x not in ids[1].tolist())
    y2 = down(ids2)
    assert torch.equal(y2[0], y[0]) and not torch.allclose(y2[1], y[1], rtol=1e-3, atol=1e-4)
    r = torch.randn(h, generator=g)
    s, ss = torch.full((h,), float("nan")), torch.full((h // 16,), float("nan"))
    interpret(moe_down_add_kernel)[(h // 16, 1)](act[0], ids[0], wts[0], w["wd"][0], w["sd"][0], r, s, ss, 16,
                                                 **d["constexprs"])
    ref_s, ref_ss = moe_down_add_ref(act[0], ids[0], wts[0], w["wd"][1], w["sd"][1], r, 16)
    assert_close(s, ref_s, 2e-5, 1e-6, "moe_down_add gathered")
    # EARLY (the rule's down_early): the routing and the routed rows loaded before the PDL wait, bit for bit the same
    early = dict(d["constexprs"], EARLY=True)
    ye = torch.full((rows, h), float("nan"))
    interpret(moe_down_kernel)[grid](act, ids, wts, w["wd"][0], w["sd"][0], ye, **early)
    assert torch.equal(ye, y)
    se, sse = torch.full((h,), float("nan")), torch.full((h // 16,), float("nan"))
    interpret(moe_down_add_kernel)[(h // 16, 1)](act[0], ids[0], wts[0], w["wd"][0], w["sd"][0], r, se, sse, 16,
                                                 **early)
    assert torch.equal(se, s) and torch.equal(sse, ss)
    on = dataclasses.replace(SM90, rules={**SM90.rules, "moe": dataclasses.replace(SM90.rules["moe"], down_early=True)})
    assert moe_down_launch(rows, e, h, inter, shared, k, groups, on)["constexprs"]["EARLY"]
    assert not moe_down_launch(rows, e, h, inter, shared, k, (0, 0), on)["constexprs"]["EARLY"]  # (gathered q4 only)
    assert_close(ss, ref_ss, 2e-5, 1e-6, "moe_down_add gathered partials")


def test_rule_override_takes_a_tuple(monkeypatch):
    """KESTREL_RULES / bench/build_variant.py: a tuple value's commas are the value's, not separators."""
    monkeypatch.setitem(TARGETS, "sm_90", TARGETS["sm_90"])  # restored after the test
    assert override_rules("sm_90", "moe.down_gather=(8, 4), moe.router_warps=2") == ["moe.down_gather=(8, 4)",
                                                                                    "moe.router_warps=2"]
    assert TARGETS["sm_90"].rules["moe"].down_gather == (8, 4) and TARGETS["sm_90"].rules["moe"].router_warps == 2
    with pytest.raises(ValueError, match="not a Python literal"):
        override_rules("sm_90", "moe.down_gather=(8")


@pytest.mark.parametrize("dtype,rows", [("bf16", 16), ("q4", 20)])
def test_grouped_experts_at_m_rows(dtype, rows):
    """The M-row MoE grouped by expert (fuse's form from 16 rows): moe_group's sort and chunk table exactly
    the reference's (some experts with more than 4 rows: several chunks; unused chunks zero), the grouped
    gate/up and down over the chunks and moe_combine against their references, and the whole equal to the
    per-row block (moe_experts_ref) within rounding."""
    g = torch.Generator().manual_seed(rows)
    e, h, inter, shared, k = 6, 128, 64, 96, 3
    w = _experts(dtype, e, h, inter, shared, g)
    x = torch.randn(rows, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(rows)]).to(torch.int32)
    wts = torch.softmax(torch.randn(rows, k, generator=g), -1)
    pairs = rows * k
    gl = moe.moe_group_launch(pairs, e, k, moe.GROUPED_CHUNK, SM90)
    c_max = gl["constexprs"]["C"]
    src, pos = torch.full((pairs,), -5, dtype=torch.int32), torch.full((pairs,), -5, dtype=torch.int32)
    chunks = torch.full((c_max, 4), -5, dtype=torch.int32)
    interpret(moe.moe_group_kernel)[tuple(gl["grid"][:1])](ids, src, pos, chunks, e, moe.GROUPED_CHUNK, **gl["constexprs"])
    ref_src, ref_pos, ref_chunks = moe.moe_group_ref(ids, e, moe.GROUPED_CHUNK)
    assert torch.equal(src, ref_src) and torch.equal(pos, ref_pos) and torch.equal(chunks, ref_chunks)
    used = int((chunks[:, 2] > 0).sum())
    assert used > e and used < c_max and (chunks[:, 2] <= moe.GROUPED_CHUNK).all()  # runs cut, zero rows left over
    group = w["wg"][2]
    gu = moe.moe_grouped_launch(pairs, e, inter, h, group, moe.GROUPED_CHUNK, SM90, pair=True)
    act = torch.full((pairs, inter), float("nan"))
    interpret(moe.moe_gate_up_grouped_kernel)[tuple(gu["grid"][:2])](x, src, chunks, w["wg"][0], w["wu"][0], act, e, moe.GROUPED_CHUNK,
                                                                    **gu["constexprs"])
    ref_act = moe.moe_gate_up_grouped_ref(x, ref_src, ref_chunks, w["wg"][1], w["wu"][1], e)
    assert_close(act, ref_act, 2e-5, 1e-6, f"moe_gate_up_grouped {dtype}")
    dn = moe.moe_grouped_launch(pairs, e, h, inter, w["wd"][2], moe.GROUPED_CHUNK, SM90)
    ys = torch.full((pairs, h), float("nan"))
    interpret(moe.moe_down_grouped_kernel)[tuple(dn["grid"][:2])](ref_act, chunks, w["wd"][0], ys, e, moe.GROUPED_CHUNK,
                                                                   **dn["constexprs"])
    ref_ys = moe.moe_down_grouped_ref(ref_act, ref_chunks, w["wd"][1], e)
    assert_close(ys, ref_ys, 2e-5, 1e-6, f"moe_down_grouped {dtype}")
    sh = matvec_ref(torch.nn.functional.silu(matvec_ref(x, w["sg"][1])) * matvec_ref(x, w["su"][1]), w["sd"][1])
    cb = moe.moe_combine_launch(rows, h, k, SM90)
    y = torch.full((rows, h), float("nan"))
    interpret(moe.moe_combine_kernel)[tuple(cb["grid"][:2])](ref_ys, pos, wts, x, w["sgate"][0], sh, y,
                                                             **cb["constexprs"])
    ref_y = moe.moe_combine_ref(ref_ys, ref_pos, wts, x, w["sgate"][1], sh)
    assert_close(y, ref_y, 2e-5, 1e-6, f"moe_combine {dtype}")
    # the grouped composition is the per-row block's arithmetic, product for product
    whole = moe.moe_experts_ref(x, ids, wts, w["wg"][1], w["wu"][1], w["wd"][1], w["sg"][1], w["su"][1], w["sd"][1],
                                w["sgate"][1])
    assert_close(ref_y, whole, 1e-6, 1e-7, "grouped against per-row")


def aot_jobs():
    """(key, kernel, signature, constexprs, warps, cc) at the 80B-A3B shapes, bf16 and q4, every target."""
    jobs = []
    e, h, inter, shared, k = 512, 2048, 512, 512, 10
    for name in ALL_TARGETS:
        if name == "cpu":
            continue
        t = TARGETS[name]
        r = moe_topk_launch(1, e, k, t)
        for sort in (False, True):  # (both forms: the rule picks one)
            jobs.append([f"moe_topk/{name}" + ("-sort" if sort else ""), "kestrel.kernels.moe:moe_topk_kernel",
                         ["*fp32", "*i32", "*fp32", "i32", "i32"], r["constexprs"] | {"SORT": sort}, r["num_warps"],
                         t.cc])
        gr = moe.moe_group_launch(256 * k, e, k, moe.GROUPED_CHUNK, t)
        jobs.append([f"moe_group/{name}", "kestrel.kernels.moe:moe_group_kernel",
                     ["*i32", "*i32", "*i32", "*i32", "i32", "i32"], gr["constexprs"], gr["num_warps"], t.cc])
        cb = moe.moe_combine_launch(256, h, k, t)
        jobs.append([f"moe_combine/{name}", "kestrel.kernels.moe:moe_combine_kernel",
                     ["*fp32", "*i32", "*fp32", "*fp32", "*bf16", "*fp32", "*fp32"], cb["constexprs"], cb["num_warps"],
                     t.cc])
        for q, wt, groups in (("bf16", "*bf16", (0, 0, 0)), ("q4", "*u8", (128, 128, 0))):
            gu = moe_gate_up_launch(1, e, h, inter, shared, k, groups, t)
            jobs.append([f"moe_gate_up_{q}/{name}", "kestrel.kernels.moe:moe_gate_up_kernel",
                         ["*fp32", "*i32", wt, wt, wt, wt, "*bf16", "*fp32", "i32"], gu["constexprs"], gu["num_warps"],
                         t.cc])
            dn = moe_down_launch(256, e, h, inter, shared, k, groups[:2], t)
            jobs.append([f"moe_down_{q}/{name}", "kestrel.kernels.moe:moe_down_kernel",
                         ["*fp32", "*i32", "*fp32", wt, wt, "*fp32"], dn["constexprs"], dn["num_warps"], t.cc])
            # one row, the norm and the residual folded in (fuse's rule 7)
            p = h // matvec_launch(h, 4096, groups[0], t)["constexprs"]["BLOCK_N"]
            gn = moe_gate_up_launch(1, e, h, inter, shared, k, groups, t, partials=p)
            jobs.append([f"rmsnorm_moe_gate_up_{q}/{name}", "kestrel.kernels.moe:rmsnorm_moe_gate_up_kernel",
                         ["*fp32", "*fp32", "*fp32", "*i32", wt, wt, wt, wt, "*bf16", "*fp32", "i32", "fp32"],
                         gn["constexprs"], gn["num_warps"], t.cc])
            pairs = 256 * k  # the M-row step's 256 rows, grouped by expert
            gg = moe.moe_grouped_launch(pairs, e, inter, h, groups[0], moe.GROUPED_CHUNK, t, pair=True)
            jobs.append([f"moe_gate_up_grouped_{q}/{name}", "kestrel.kernels.moe:moe_gate_up_grouped_kernel",
                         ["*fp32", "*i32", "*i32", wt, wt, "*fp32", "i32", "i32"], gg["constexprs"], gg["num_warps"],
                         t.cc])
            dg = moe.moe_grouped_launch(pairs, e, h, inter, groups[0], moe.GROUPED_CHUNK, t)
            jobs.append([f"moe_down_grouped_{q}/{name}", "kestrel.kernels.moe:moe_down_grouped_kernel",
                         ["*fp32", "*i32", wt, "*fp32", "i32", "i32"], dg["constexprs"], dg["num_warps"], t.cc])
            da = moe_down_launch(1, e, h, inter, shared, k, groups[:2], t)
            jobs.append([f"moe_down_add_{q}/{name}", "kestrel.kernels.moe:moe_down_add_kernel",
                         ["*fp32", "*i32", "*fp32", wt, wt, "*fp32", "*fp32", "*fp32", "i32"], da["constexprs"],
                         da["num_warps"], t.cc])
            if da["constexprs"]["STAGES"] < 0:  # the gathered form with its loads before the PDL wait (EARLY)
                jobs.append([f"moe_down_add_{q}_early/{name}", "kestrel.kernels.moe:moe_down_add_kernel",
                             ["*fp32", "*i32", "*fp32", wt, wt, "*fp32", "*fp32", "*fp32", "i32"],
                             da["constexprs"] | {"EARLY": True}, da["num_warps"], t.cc])
    return jobs


_COMPILE_ALL = """
import json, sys
from kestrel.compiler.codegen import compile_kernel
res = {}
for key, fn, types, consts, num_warps, cc in json.loads(sys.stdin.read()):
    try:
        ck = compile_kernel(key.split("/")[0], fn, types, consts, num_warps, cc, [t.startswith("*") for t in types])
        res[key] = [len(ck.cubin), ck.num_warps, ck.arch, ck.cubin[:4].hex()]
    except Exception as e:  # reported per (kernel, target) by the test
        res[key] = repr(e)[-2000:]
print(json.dumps(res))
"""


# the jobs split between clean processes started with the module, beside its interpreter tests
_aot = split_compile_fixture(_COMPILE_ALL, aot_jobs, "test_aot_compiles_every_moe_kernel")


def test_aot_compiles_every_moe_kernel_for_every_target(_aot):
    jobs = aot_jobs()
    compiled = _aot.compiled()
    assert len(jobs) == 17 * (len(ALL_TARGETS) - 1)
    for key, fn, types, consts, warps, cc in jobs:
        res = compiled[key]
        assert isinstance(res, list), f"{key}: {res}"
        size, num_warps, arch, magic = res
        assert size > 0 and magic == "7f454c46" and num_warps == warps and arch.startswith(f"sm_{cc}"), key
    for kind in ("moe_topk", "moe_gate_up", "moe_down", "rmsnorm_moe_gate_up", "moe_down_add", "moe_group",
                 "moe_gate_up_grouped", "moe_down_grouped", "moe_combine"):
        assert any(fn.endswith(":" + OPS[kind].kernel.jit.fn.__name__) for _, fn, *_ in jobs), kind
