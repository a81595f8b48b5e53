"""kernels/bf16_mma.py, the tensor-core bf16 product for a few rows (q4_mma's CUDA C with WBF16, through
NVRTC). Without a GPU: its reference (x split into bf16 hi + lo) against the exact product and the one-token
matvec's, its CPU emulation in every form (plain, the gate / up pair, the folded add and norm) against the
unfolded references, the launch rule (which matmuls take it, which fall back) and its AOT compile for every
target. Its CUDA C runs on the device only (bench/q4mma_sweep.py's bf16 folder checks every configuration
against ``bf16_mma_ref``)."""
import dataclasses

import pytest
import torch

from kestrel.compiler.codegen import compile_kernel
from kestrel.kernels import bf16_mma, q4_mma
from kestrel.kernels.matvec import matvec_ref
from kestrel.kernels.targets import GPU_TARGETS, TARGETS


def _w(n, k, seed):
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k ** 0.5).bfloat16()


def _x(m, k, seed, scale=3.0):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale


def test_split_keeps_sixteen_bits():
    x = _x(5, 4096, 1) * torch.logspace(-20, 20, 4096)
    hi, lo = bf16_mma.split_x(x)
    assert hi.dtype == lo.dtype == torch.bfloat16
    err = (hi.double() + lo.double() - x.double()).abs()
    assert (err <= x.double().abs() * 2.0 ** -16).all()
    assert (hi.float() == x.bfloat16().float()).all()  # hi is x rounded, lo what it lost


def test_reference_is_within_fp32_rounding_of_the_exact_product():
    """hi + lo keeps x to 2^-16 (relative), so the product is the fp32 matvec's to ~1e-5 of max |y|; x as bf16
    alone (what a plain bf16 MMA would multiply) is ~100x further off."""
    m, n, k = 4, 64, 2048
    w, x = _w(n, k, 2), _x(m, k, 3)
    exact = x.double() @ w.double().T
    y = bf16_mma.bf16_mma_ref(x, w)
    rel = lambda a: ((a.double() - exact).abs().max() / exact.abs().max()).item()  # noqa: E731
    assert rel(y) < 2e-5
    assert rel(matvec_ref(x, w)) < 2e-6  # (the one-token kernel's reference: fp32 x)
    assert rel((x.bfloat16().double() @ w.double().T)) > 20 * rel(y)


def _ref(x, ws, pair):
    return bf16_mma.bf16_mma_swiglu_ref(x, *ws) if pair else bf16_mma.bf16_mma_ref(x, ws[0])


@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("m,rb,ks,cs", [(4, 2, 2, 1), (1, 1, 4, 2), (13, 4, 1, 4)])
def test_emulated_launch_writes_the_reference(pair, m, rb, ks, cs):
    n, k = 64, 1024
    ws = [_w(n, k, s) for s in (3, 4)[:2 if pair else 1]]
    x = _x(m, k, 5)
    launch = q4_mma.launch(m, n, k, bf16_mma.GROUP, rb, ks, cs, 2, pair, bf16=True)
    assert launch["constexprs"]["WBF16"] == 1
    kernel = bf16_mma.bf16mma_rows_swiglu if pair else bf16_mma.bf16mma_rows
    y = torch.full((m * n + 7,), float("nan"))
    kernel[launch["grid"]](x.reshape(-1), *[w.reshape(-1) for w in ws], y, **launch["constexprs"], PDL=True)
    assert torch.equal(y[:m * n].reshape(m, n), _ref(x, ws, pair)) and y[m * n:].isnan().all()


@pytest.mark.parametrize("pair", [False, True])
def test_folded_add_and_norm_equal_the_unfolded_chain(pair):
    """fold_row_norms' pair at 4 rows: s = r + W x with each row's sums of s^2 per 16 outputs, then the next
    product of rmsnorm(s) with its rstd from those partials, against the add and norm done apart."""
    t = TARGETS["sm_90"]
    m, h, inter = 4, 256, 512
    wo, ws = _w(h, inter, 7), [_w(inter, h, s) for s in (8, 9)[:2 if pair else 1]]
    x, r, nw = _x(m, inter, 10, 1.0), _x(m, h, 11), _x(1, h, 12, 0.1)[0]
    add = bf16_mma.add_launch(m, h, inter, t)
    assert add["constexprs"]["ADD"] == 1 and add["constexprs"]["BLOCK_N"] == 16
    s, ss = torch.zeros(m * h), torch.zeros(m * h // 16)
    bf16_mma.bf16mma_add[add["grid"]](x.reshape(-1), wo.reshape(-1), r.reshape(-1), s, ss, 16, **add["constexprs"],
                                      PDL=True)
    want = r + bf16_mma.bf16_mma_ref(x, wo)
    assert torch.equal(s.reshape(m, h), want)
    assert torch.allclose(ss.reshape(m, h // 16).sum(-1), (want.double() ** 2).sum(-1).float(), rtol=1e-5)
    norm = bf16_mma.rule_launch(m, inter, h, t, pair=pair, norm=True)
    assert norm["constexprs"]["NORM"] == 1 and norm["constexprs"]["NP"] == h // 16
    y = torch.zeros(m * inter)
    kernel = bf16_mma.bf16mma_norm_swiglu if pair else bf16_mma.bf16mma_norm
    kernel[norm["grid"]](s, ss, nw, *[w.reshape(-1) for w in ws], y, 1e-6, **norm["constexprs"], PDL=True)
    normed = want * torch.rsqrt((want.double() ** 2).mean(-1, keepdim=True) + 1e-6).float() * (1 + nw)
    assert torch.allclose(y.reshape(m, inter), _ref(normed, ws, pair), rtol=1e-4, atol=1e-5)


def test_rule():
    t = TARGETS["sm_90"]
    r = t.rules["bf16_mma"]
    assert r.max_rows >= 4  # a verify's K + 1 rows at K = 3
    at4 = bf16_mma.rule_launch(4, 6144, 1024, t)  # 0.8B in_proj
    assert at4 is not None and at4["constexprs"]["WBF16"] == 1 and at4["constexprs"]["GROUP"] == 32
    assert q4_mma.shared_bytes(at4["constexprs"]) <= t.smem_optin
    assert bf16_mma.rule_launch(1, 6144, 1024, t) is None  # the one-token step keeps the matvec
    assert bf16_mma.rule_launch(r.max_rows + 1, 6144, 1024, t) is None
    assert bf16_mma.rule_launch(4, 6152, 1024, t) is None  # N not a multiple of 16
    # the 27B matrices keep the few-rows matvec (faster there: the rule's provenance); each weight counts
    assert bf16_mma.rule_launch(4, 5120, 6144, t) is None and 5120 * 6144 * 2 > r.max_weight_bytes
    assert bf16_mma.rule_launch(4, 3584, 1024, t, pair=True) is not None
    big = dataclasses.replace(t, rules={**t.rules, "bf16_mma": dataclasses.replace(r, max_weight_bytes=0)})
    # x is staged twice (hi, lo): 4 rows of K 17408 need a cluster on sm_90
    assert bf16_mma.rule_launch(4, 5120, 17408, big)["constexprs"]["CS"] >= 2
    assert q4_mma.fits(4, 5120, 17408, 32, 4, 4, 1, t, bf16=True) is not None
    assert "sm_80" in q4_mma.fits(4, 64, 64, 32, 1, 1, 1, dataclasses.replace(t, cc=75), bf16=True)
    assert q4_mma.fits(4, 64, 64, 64, 1, 1, 1, t, bf16=True) == "group 64"
    # the clusters' pick at 0.8 CTAs per SM: 0.8B gate + up (112 row-block pairs) unclustered, down in pairs
    assert bf16_mma.rule_launch(4, 3584, 1024, t, pair=True)["constexprs"]["CS"] == 1
    assert bf16_mma.rule_launch(4, 1024, 3584, t)["constexprs"]["CS"] == 2
    c4 = q4_mma.launch(4, 512, 256, 32, 4, 4, 1, 2, False, bf16=True)["constexprs"]
    # x rows hi and lo, then the warps' sums (NT = 1: 4 rows fill the 8 columns) over it
    assert q4_mma.shared_bytes(c4) == max(8 * (2 * 256 + 64), 16 * 32 * 4 * 4 + 4 * 32 * 4 * 4)


def test_matmuls_at_a_few_bf16_rows_select_it(monkeypatch):
    from kestrel.compiler.ir import Op, Program, TensorType, Value
    from kestrel.compiler.ops import OPS
    from kestrel.kernels import targets

    p = Program("t")
    w = p.add_weight("w", "bf16", (6144, 1024))
    for rows, expect in ((4, "bf16mma_rows_bf16"), (1, "matvec_bf16")):
        x = Value(TensorType("f32", (rows, 1024) if rows > 1 else (5120,)))
        op = Op("matmul", [Value(TensorType("f32", x.type.shape[:-1] + (6144,)))], [x, w], {})
        op.launch = OPS["matmul"].kernel.launch(op, TARGETS["sm_90"])
        assert op.launch["kernel"] == expect
    at4 = Op("matmul", [Value(TensorType("f32", (4, 6144)))], [Value(TensorType("f32", (4, 1024))), w], {})
    at4.launch = OPS["matmul"].kernel.launch(at4, TARGETS["sm_90"])
    assert OPS["matmul"].kernel.jit_for(at4) is bf16_mma.bf16mma_rows
    monkeypatch.setitem(targets.TARGETS, "sm_90", targets.TARGETS["sm_90"])
    targets.override_rules("sm_90", "bf16_mma.max_rows=0")
    op = Op("matmul", [Value(TensorType("f32", (4, 6144)))], [Value(TensorType("f32", (4, 1024))), w], {})
    assert OPS["matmul"].kernel.launch(op, targets.TARGETS["sm_90"])["kernel"] == "matvec_rows_bf16"


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_compiles_for_every_target(target):
    t = TARGETS[target]
    for m, n, k, pair in [(4, 5120, 6144, False), (4, 17408, 5120, True), (8, 1024, 1024, False), (2, 1024, 1024, True)]:
        launch = bf16_mma.rule_launch(m, n, k, t, pair) or q4_mma.launch(m, n, k, 32, 1, 2, 1, 2, pair, bf16=True)
        c = launch["constexprs"]
        assert q4_mma.fits(m, n, k, 32, c["RB"], c["KS"], c["CS"], t, pair, c["STAGES"], persist=c["PERSIST"],
                           bf16=True) is None
        fn = bf16_mma.bf16mma_rows_swiglu if pair else bf16_mma.bf16mma_rows
        types = ["*fp32", "*bf16"] + (["*bf16"] if pair else []) + ["*fp32"]
        ck = compile_kernel("bf16mma", fn, types, c, launch["num_warps"], t.cc)
        assert ck.cubin[:4] == b"\x7fELF" and ck.arch == f"sm_{t.cc}" and ck.shared == q4_mma.shared_bytes(c)
        if not pair and (add := bf16_mma.add_launch(m, n, k, t)) is not None:
            assert compile_kernel("bf16mma_add", bf16_mma.bf16mma_add, ["*fp32", "*bf16", "*fp32", "*fp32", "*fp32",
                                                                        "i32"],
                                  add["constexprs"], add["num_warps"], t.cc).cubin[:4] == b"\x7fELF"
        if (norm := bf16_mma.rule_launch(m, n, k, t, pair, norm=True)) is not None:
            fn = bf16_mma.bf16mma_norm_swiglu if pair else bf16_mma.bf16mma_norm
            nt = ["*fp32", "*fp32", "*fp32", "*bf16"] + (["*bf16"] if pair else []) + ["*fp32", "fp32"]
            assert compile_kernel("bf16mma_norm", fn, nt, norm["constexprs"], norm["num_warps"], t.cc).cubin[:4] == \
                b"\x7fELF"
    # the ring (STAGES) in the bf16 form: 16-byte copies, no scales
    ring = q4_mma.launch(4, 1024, 1024, 32, 2, 2, 1, 2, False, stages=3, bf16=True)
    assert q4_mma.ring_bytes(ring["constexprs"]) == 4 * 3 * 2 * 32 * 16
    assert compile_kernel("bf16mma", bf16_mma.bf16mma_rows, ["*fp32", "*bf16", "*fp32"], ring["constexprs"], 4,
                          t.cc).cubin[:4] == b"\x7fELF"
