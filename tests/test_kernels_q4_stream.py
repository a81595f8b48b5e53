"""kernels/q4_stream.py, the one-row q4 product fed by bulk copies (CUDA C through NVRTC). Without a GPU: its CPU
emulation (what the launch-plan tests run) against the references of the ops it takes, the launch rule (which
forms and shapes it takes, where it falls back), and its AOT compile for every target with
the bulk copy engine. Its CUDA C runs on the device only (bench/q4stream_probe.py checks it against
``q4_matvec_ref`` at the 27B shapes)."""
import dataclasses

import pytest
import torch

from kestrel.compiler.codegen import compile_kernel
from kestrel.kernels import q4_stream
from kestrel.kernels.matvec import (matvec_add_ref, matvec_ref, matvec_swiglu_ref, q4_pack, q4_unpack,
                                    rmsnorm_matvec_ref, rmsnorm_matvec_swiglu_ref)
from kestrel.kernels.targets import GPU_TARGETS, TARGETS

ALL_FORMS = ("plain", "add", "norm_plain", "norm_swiglu")


def _on(name: str = "sm_90", **fields):
    """``name``'s target with the kernel on for every form (and ``fields`` of its row replaced)."""
    t = TARGETS[name]
    row = dataclasses.replace(t.rules["q4_stream"], **{"pair": True, "add": True, "plain": True, "norm_plain": True,
                                                        **fields})
    return dataclasses.replace(t, rules={**t.rules, "q4_stream": row})


def _weight(n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    w = q4_pack(torch.randn(n, k, generator=g) / k ** 0.5, group)
    return w, q4_unpack(w, n, k, group)


@pytest.mark.parametrize("group,rb,nc", [(128, 16, 4), (32, 8, 2), (64, 4, 4)])
def test_emulated_plain_writes_the_reference(group, rb, nc):
    n, k = 64, 512
    w, d = _weight(n, k, group, 1)
    x = torch.randn(k, generator=torch.Generator().manual_seed(3)) * 2
    plain = q4_stream.launch(n, k, group, rb, 2, nc, 132)
    assert plain["grid"] == [n // rb, 1, 1] and plain["num_warps"] == nc + 1
    y = torch.full((n + 5,), float("nan"))
    q4_stream.q4stream[plain["grid"]](x, w, y, **plain["constexprs"], PDL=True)
    assert torch.equal(y[:n], matvec_ref(x, d)) and y[n:].isnan().all()
    few = q4_stream.launch(n, k, group, rb, 2, nc, 3)  # fewer CTAs than blocks (they loop): a grid it accepts
    assert few["grid"] == [min(3, n // rb), 1, 1]
    y2 = torch.full((n,), float("nan"))
    q4_stream.q4stream[few["grid"]](x, w, y2, **few["constexprs"], PDL=True)
    assert torch.equal(y2, y[:n])
    with pytest.raises(AssertionError, match="grid"):  # more CTAs than blocks
        q4_stream.q4stream[[n // rb + 1, 1, 1]](x, w, y, **plain["constexprs"])


@pytest.mark.parametrize("pair", [False, True])
def test_emulated_add_feeds_the_norm_forms(pair):
    """matmul_add's form (s = r + W x, one partial sum of squares per consumer warp's RB / NC rows) feeding
    rmsnorm_matmul(_swiglu)'s (rstd from those partials) gives the unfused chain's references."""
    h, k, n, group = 256, 512, 128, 128
    g = torch.Generator().manual_seed(7)
    x, r, nw = torch.randn(k, generator=g), torch.randn(h, generator=g), torch.randn(h, generator=g) * 0.1
    wo, do = _weight(h, k, group, 8)
    add = q4_stream.launch(h, k, group, 16, 2, 4, 132, add=True)
    rows = add["constexprs"]["BLOCK_N"]
    assert rows == 4 and add["constexprs"]["ADD"] == 1
    # K split between the warps of a row group: a partial per group (8 warps in groups of 2: 4 groups, 4 rows each)
    split = q4_stream.launch(h, k, group, 16, 2, 8, 132, add=True, ks=2, minb=2)
    assert (split["constexprs"]["BLOCK_N"], split["constexprs"]["KS"], split["constexprs"]["MINB"]) == (4, 2, 2)
    assert q4_stream.shared_bytes(split["constexprs"]) == q4_stream.shared_bytes(add["constexprs"]) + 2 * 16 * 2 * 4
    s2, ss2 = torch.full((h,), float("nan")), torch.full((h // rows,), float("nan"))
    q4_stream.q4stream_add[split["grid"]](x, wo, r, s2, ss2, rows, **split["constexprs"], PDL=True)
    s, ss = torch.full((h,), float("nan")), torch.full((h // rows,), float("nan"))
    q4_stream.q4stream_add[add["grid"]](x, wo, r, s, ss, rows, **add["constexprs"], PDL=True)
    s_ref, ss_ref = matvec_add_ref(x, do, r, rows)
    assert torch.equal(s, s_ref) and torch.allclose(ss, ss_ref, rtol=1e-6)
    assert torch.equal(s2, s) and torch.equal(ss2, ss)

    ws = [_weight(n, h, group, seed) for seed in (9, 10)[:2 if pair else 1]]
    norm = q4_stream.launch(n, h, group, 8, 3, 2, 132, pair=pair, norm=True, partials=h // rows)
    assert norm["constexprs"]["NORM"] == 1 and norm["constexprs"]["NP"] == h // rows
    kernel = q4_stream.q4stream_norm_swiglu if pair else q4_stream.q4stream_norm
    y = torch.full((n,), float("nan"))
    kernel[norm["grid"]](s, ss, nw, *[w for w, _ in ws], y, 1e-6, **norm["constexprs"], PDL=True)
    ref = (rmsnorm_matvec_swiglu_ref(s, ss, nw, ws[0][1], ws[1][1], 1e-6) if pair
           else rmsnorm_matvec_ref(s, ss, nw, ws[0][1], 1e-6))
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-3  # rstd from the partials, not from s
    # the partials decide the norm: scaled by 4, rstd halves
    y2 = torch.full((n,), float("nan"))
    kernel[norm["grid"]](s, ss * 4, nw, *[w for w, _ in ws], y2, 1e-6, **norm["constexprs"], PDL=True)
    ref2 = (matvec_swiglu_ref(_normed(s, nw) / 2, ws[0][1], ws[1][1]) if pair
            else matvec_ref(_normed(s, nw) / 2, ws[0][1]))
    assert ((y2 - ref2).abs().max() / ref2.abs().max()).item() < 3e-3


def _normed(s, nw):
    from kestrel.kernels.rmsnorm import rmsnorm_ref

    return rmsnorm_ref(s, nw, 1e-6)


def test_rule_takes_the_27b_class_normed_pair_and_falls_back_elsewhere():
    t = TARGETS["sm_90"]
    r = t.rules["q4_stream"]
    assert r.pair and not (r.add or r.plain or r.norm_plain or r.wide)  # the forms the whole 27B step measured faster
    pair = q4_stream.stream_launch(17408, 5120, 128, t, pair=True, norm=True, partials=640)
    c = pair["constexprs"]
    assert (c["RB"], c["STAGES"], c["NC"], c["SWIGLU"], c["NORM"], c["NP"]) == (r.pair_rb, r.pair_stages, r.pair_nc,
                                                                                1, 1, 640)
    assert pair["grid"] == [t.sms, 1, 1] and pair["num_warps"] == r.pair_nc + 1
    assert q4_stream.stream_launch(17408, 5120, 128, t, pair=True) is None  # the unnormed pair: no form
    # the forms switched off keep the Triton matvec: the add, the normed in_proj, the plain product
    assert q4_stream.stream_launch(5120, 6144, 128, t, add=True) is None
    assert q4_stream.stream_launch(16480, 5120, 128, t, norm=True, partials=640) is None
    assert q4_stream.stream_launch(16480, 5120, 128, t) is None
    on = _on()
    add = q4_stream.stream_launch(5120, 6144, 128, on, add=True)
    assert add["constexprs"]["ADD"] == 1 and add["constexprs"]["BLOCK_N"] == r.rb // r.nc
    assert (add["constexprs"]["RB"], add["num_warps"]) == (r.rb, r.nc + 1)
    assert q4_stream.stream_launch(16480, 5120, 128, on, norm=True, partials=640)["constexprs"]["NORM"] == 1
    assert "NORM" not in q4_stream.stream_launch(16480, 5120, 128, on)["constexprs"]
    assert q4_stream.stream_launch(5120, 17408, 128, on, add=True) is None  # K above max_k: the matvec
    assert q4_stream.stream_launch(12288, 4096, 128, on, pair=True, norm=True, partials=512) is None  # 9B: K < min_k
    assert q4_stream.stream_launch(3584, 1024, 128, on, pair=True, norm=True, partials=128) is None  # 0.8B
    assert q4_stream.stream_launch(5128, 5120, 128, on) is None  # N not a multiple of RB
    assert q4_stream.stream_launch(5120, 5120, 0, on) is None  # bf16 weights
    assert q4_stream.stream_launch(5120, 5120, 128, _on("sm_80")) is None  # no bulk copies before sm_90
    # the down projection's K (above max_k) only with a wide split, which splits K over a row group's warps
    assert q4_stream.stream_launch(5120, 17408, 128, _on(add=True), add=True) is None  # the wide form off
    wide = q4_stream.stream_launch(5120, 17408, 128, _on(wide=True, add=False), add=True)
    c = wide["constexprs"]
    assert (c["RB"], c["NC"], c["KS"]) == (r.wide_rb, r.wide_nc, r.wide_ks)
    assert c["BLOCK_N"] == r.wide_rb // (r.wide_nc // r.wide_ks)  # a partial per row group
    assert wide["num_warps"] == r.wide_nc + 1 and "MINB" not in c
    assert q4_stream.stream_launch(17408, 17408, 128, _on(wide=True), pair=True, norm=True) is None  # no wide pair
    assert q4_stream.stream_launch(5120, 17408, 128, _on(wide=True), norm=True, partials=640) is None  # nor norm
    assert q4_stream.stream_launch(5120, 17408, 128, _on(wide=True, wide_ks=3), add=True) is None  # 544 chunks
    assert q4_stream.stream_launch(5120, 17536, 128, _on(wide=True), add=True) is None  # above wide_max_k
    split = q4_stream.stream_launch(16480, 5120, 128, _on(nc=10, ks=5, rb=8, minb=2), norm=True, partials=640)
    assert (split["constexprs"]["KS"], split["constexprs"]["MINB"], split["num_warps"]) == (5, 2, 11)
    # sm_120's 99 KB: the plain ring fits, the pair's at 16 rows a block (two weights a slot) does not
    assert q4_stream.stream_launch(5120, 5120, 128, _on("sm_120")) is not None
    assert q4_stream.stream_launch(17408, 5120, 128, _on("sm_120", pair_rb=16), pair=True, norm=True) is None


@pytest.mark.parametrize("target", [t for t in GPU_TARGETS if TARGETS[t].cc >= q4_stream.BULK_MIN_CC])
@pytest.mark.parametrize("form", ALL_FORMS)
def test_compiles_for_every_target_with_bulk_copies(target, form):
    pytest.importorskip("cuda.bindings.nvrtc")
    t = _on(target)
    pair, norm, add = form == "norm_swiglu", form.startswith("norm"), form == "add"
    n, k = (17408, 5120) if pair else (5120, 6144)
    if t.smem_optin < 100 * 1024:  # sm_120: a ring that fits its 99 KB
        n, k = 5120, 5120
    launch = q4_stream.stream_launch(n, k, 128, t, pair=pair, add=add, norm=norm, partials=640)
    assert launch is not None, (target, form)
    kernel = {"plain": q4_stream.q4stream, "add": q4_stream.q4stream_add,
              "norm_plain": q4_stream.q4stream_norm, "norm_swiglu": q4_stream.q4stream_norm_swiglu}[form]
    types = {"plain": ["*fp32", "*u8", "*fp32"],
             "add": ["*fp32", "*u8", "*fp32", "*fp32", "*fp32", "i32"],
             "norm_plain": ["*fp32", "*fp32", "*fp32", "*u8", "*fp32", "fp32"],
             "norm_swiglu": ["*fp32", "*fp32", "*fp32", "*u8", "*u8", "*fp32", "fp32"]}[form]
    ck = compile_kernel(f"q4stream_{form}", kernel, types, launch["constexprs"], launch["num_warps"], t.cc)
    assert ck.cubin[:4] == b"\x7fELF" and ck.arch == f"sm_{t.cc}" and ck.compiler.startswith("nvrtc")
    assert ck.shared == q4_stream.shared_bytes(launch["constexprs"]) <= t.smem_optin


@pytest.mark.parametrize("target", [t for t in GPU_TARGETS if TARGETS[t].cc >= q4_stream.BULK_MIN_CC])
def test_the_k_split_forms_compile(target):
    """Row groups of warps that split K (their sums meet in shared memory behind a named barrier per group) and the
    register cap for two CTAs an SM: the wide down projection, a split normed in_proj and a split pair."""
    pytest.importorskip("cuda.bindings.nvrtc")
    t = _on(target, wide=True, nc=10, ks=5, rb=8, minb=2, pair_nc=10, pair_ks=5, pair_minb=2)
    cases = [("add", (5120, 17408), q4_stream.q4stream_add, ["*fp32", "*u8", "*fp32", "*fp32", "*fp32", "i32"]),
             ("norm_plain", (16480, 5120), q4_stream.q4stream_norm,
              ["*fp32", "*fp32", "*fp32", "*u8", "*fp32", "fp32"]),
             ("norm_swiglu", (17408, 5120), q4_stream.q4stream_norm_swiglu,
              ["*fp32", "*fp32", "*fp32", "*u8", "*u8", "*fp32", "fp32"])]
    for form, (n, k), kernel, types in cases:
        launch = q4_stream.stream_launch(n, k, 128, t, pair=form == "norm_swiglu", add=form == "add",
                                         norm=form.startswith("norm"), partials=640)
        if launch is None:  # sm_120: the down projection's x and ring do not fit 99 KB
            assert t.smem_optin < 128 * 1024 and form != "norm_plain", (target, form)
            continue
        ck = compile_kernel(f"q4stream_{form}", kernel, types, launch["constexprs"], launch["num_warps"], t.cc)
        assert ck.cubin[:4] == b"\x7fELF" and ck.shared == q4_stream.shared_bytes(launch["constexprs"])
