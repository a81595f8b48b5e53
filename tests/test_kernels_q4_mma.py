"""kernels/q4_mma.py, the tensor-core q4 product for a few rows (CUDA C through NVRTC). Without a GPU:
its reference against the exact product and the one-token q4 reference, its CPU emulation (what the
launch-plan tests run) against the reference, the launch rule (which matmuls take it, which fall back),
and its AOT compile for every target it may run on. Its CUDA C runs on the device only
(bench/q4mma_sweep.py checks every configuration against ``q4_mma_ref``)."""
import dataclasses

import pytest
import torch

from kestrel.compiler.codegen import compile_kernel
from kestrel.kernels import q4_mma
from kestrel.kernels.matvec import matvec_ref, q4_codes, q4_pack, q4_unpack
from kestrel.kernels.targets import GPU_TARGETS, TARGETS

OFF = "q4_mma.max_rows=0 q4_mma.grouped_rows=0"


def _on(name: str = "sm_90"):
    """``name``'s target with the kernel on at 2..8 rows (other targets borrow the sm_90 row, where it is on)."""
    t = TARGETS[name]
    return dataclasses.replace(t, rules={**t.rules, "q4_mma": dataclasses.replace(t.rules["q4_mma"], max_rows=8)})


def _weight(n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    w = q4_pack(torch.randn(n, k, generator=g) / k ** 0.5, group)
    return w, q4_codes(w, n, k, group)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_reference_is_the_fp16_x_product_summed_exactly(group):
    m, n, k = 3, 48, 512
    w, (q, sc) = _weight(n, k, group, 1)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)) * 3
    y = q4_mma.q4_mma_ref(x, q, sc, group)
    xh = (x / 64).half().double()
    deq = (q.double().reshape(n, k // group, group) * sc.double()[:, :, None]).reshape(n, k)
    exact = xh @ deq.T * 64
    assert torch.allclose(y.double(), exact, rtol=1e-6, atol=1e-6 * exact.abs().max().item())
    # against the one-token kernel's product (fp16 lanes): within that product's own rounding
    one = matvec_ref(x, q4_unpack(w, n, k, group))
    assert ((y - one).abs().max() / one.abs().max()).item() < 3e-3


@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("m,group,rb,ks,cs", [(4, 128, 2, 2, 1), (1, 32, 1, 4, 2), (13, 64, 4, 1, 4)])
def test_emulated_launch_writes_the_reference(pair, m, group, rb, ks, cs):
    n, k = 64, 1024
    ws = [_weight(n, k, group, s) for s in (3, 4)[:2 if pair else 1]]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    launch = q4_mma.launch(m, n, k, group, rb, ks, cs, 2, pair)
    kernel = q4_mma.q4mma_rows_swiglu if pair else q4_mma.q4mma_rows
    y = torch.full((m * n + 7,), float("nan"))
    kernel[launch["grid"]](x.reshape(-1), *[w for w, _ in ws], y, **launch["constexprs"], PDL=True)
    if pair:
        ref = q4_mma.q4_mma_swiglu_ref(x, *ws[0][1], *ws[1][1], group)
    else:
        ref = q4_mma.q4_mma_ref(x, *ws[0][1], group)
    assert torch.equal(y[:m * n].reshape(m, n), ref) and y[m * n:].isnan().all()
    persist = q4_mma.launch(m, n, k, group, rb, ks, cs, 2, pair, persist=1)  # one cluster loops over them all
    assert persist["grid"] == [cs, 1, 1] and persist["constexprs"]["PERSIST"] == 1
    y2 = torch.full((m * n,), float("nan"))
    kernel[persist["grid"]](x.reshape(-1), *[w for w, _ in ws], y2, **persist["constexprs"], PDL=True)
    assert torch.equal(y2.reshape(m, n), ref)
    with pytest.raises(AssertionError, match="grid"):
        kernel[[launch["grid"][0] + 1, 1, 1]](x.reshape(-1), *[w for w, _ in ws], y, **launch["constexprs"])


@pytest.mark.parametrize("pair", [False, True])
def test_folded_add_and_norm_are_the_unfolded_ops(pair):
    """fold_row_norms' kernels, emulated: matmul_add at M rows (s = r + the product, 16 outputs a partial sum
    of squares) feeding rmsnorm_matmul(_swiglu) (rstd from those partials) give what the unfolded chain's
    references give: add_rmsnorm's sum and norm, then the product, within the product's fp16 rounding of x."""
    from kestrel.kernels.matvec import matvec_add_ref, matvec_swiglu_ref
    from kestrel.kernels.rmsnorm import rmsnorm_ref

    m, h, n, group, t = 4, 256, 512, 64, _on()
    g = torch.Generator().manual_seed(7)
    x, r = torch.randn(m, 512, generator=g), torch.randn(m, h, generator=g)
    nw = torch.randn(h, generator=g) * 0.1
    wo, (qo, so) = _weight(h, 512, group, 8)
    add = q4_mma.add_launch(m, h, 512, group, t)
    s, ss = torch.full((m * h,), float("nan")), torch.full((m * h // 16,), float("nan"))
    q4_mma.q4mma_add[add["grid"]](x.reshape(-1), wo, r.reshape(-1), s, ss, 16, **add["constexprs"], PDL=True)
    s_ref, ss_ref = matvec_add_ref(x, q4_unpack(wo, h, 512, group), r, 16)
    assert torch.allclose(s.reshape(m, h), s_ref, rtol=0, atol=3e-3 * s_ref.abs().max().item())
    assert torch.allclose(ss.reshape(m, h // 16), (s.reshape(m, h, 1) ** 2).reshape(m, h // 16, 16).sum(-1), rtol=1e-5)

    ws = [_weight(n, h, group, seed) for seed in (9, 10)[:2 if pair else 1]]
    norm = q4_mma.rule_launch(m, n, h, group, t, pair=pair, norm=True)
    assert norm["constexprs"]["NORM"] == 1 and norm["constexprs"]["NP"] == h // 16
    y = torch.full((m * n,), float("nan"))
    kernel = q4_mma.q4mma_norm_swiglu if pair else q4_mma.q4mma_norm
    kernel[norm["grid"]](s, ss, nw, *[w for w, _ in ws], y, 1e-6, **norm["constexprs"], PDL=True)
    xn = rmsnorm_ref(s.reshape(m, h), nw, 1e-6)
    unpacked = [q4_unpack(w, n, h, group) for w, _ in ws]
    ref = matvec_swiglu_ref(xn, *unpacked) if pair else matvec_ref(xn, unpacked[0])
    assert ((y.reshape(m, n) - ref).abs().max() / ref.abs().max()).item() < 3e-3
    # the partials decide the norm: scaled by 4, every rstd halves
    y2 = torch.full((m * n,), float("nan"))
    kernel[norm["grid"]](s, ss * 4, nw, *[w for w, _ in ws], y2, 1e-6, **norm["constexprs"], PDL=True)
    xh = rmsnorm_ref(s.reshape(m, h), nw, 1e-6) / 2
    ref2 = matvec_swiglu_ref(xh, *unpacked) if pair else matvec_ref(xh, unpacked[0])
    assert ((y2.reshape(m, n) - ref2).abs().max() / ref2.abs().max()).item() < 3e-3


def test_rule_takes_q4_at_a_few_rows_and_falls_back_elsewhere():
    assert q4_mma.rule_launch(16, 5120, 17408, 128, TARGETS["sm_90"]) is not None  # on from 2 to 16 rows
    t = _on()
    r = t.rules["q4_mma"]
    at = q4_mma.rule_launch(4, 5120, 17408, 128, t)
    assert at is not None and at["num_warps"] == at["constexprs"]["RB"] * at["constexprs"]["KS"]
    assert at["grid"][0] % at["constexprs"]["CS"] == 0
    assert q4_mma.rule_launch(1, 5120, 17408, 128, t) is None  # the one-token step keeps the matvec
    assert q4_mma.rule_launch(r.max_rows + 1, 5120, 17408, 128, t) is None
    assert q4_mma.rule_launch(4, 5128, 4096, 128, t) is None  # N not a multiple of 16
    small = q4_mma.rule_launch(4, 64, 64, 32, t)  # two groups: KS cut to what the K range holds
    assert small is not None and small["constexprs"]["KS"] * small["constexprs"]["CS"] <= 2
    # more staged x than a CTA may hold: no configuration fits sm_120's 99 KB at K = 17408, 8 rows
    assert q4_mma.fits(8, 5120, 17408, 128, 2, 4, 1, TARGETS["sm_120"]) is not None
    assert q4_mma.fits(4, 5120, 17408, 128, 2, 4, 2, TARGETS["sm_80"]) == "clusters need sm_90"
    # the gate / up pair: persistent, swiglu_persist CTAs per SM, where they fit an SM's shared memory (measured,
    # off by default: kernels/targets.py) ...
    t16 = dataclasses.replace(TARGETS["sm_90"], rules={**TARGETS["sm_90"].rules, "q4_mma": dataclasses.replace(
        TARGETS["sm_90"].rules["q4_mma"], swiglu_persist=2)})  # (max_rows 16)
    r = t16.rules["q4_mma"]
    at4 = q4_mma.rule_launch(4, 17408, 5120, 128, t16, pair=True)
    c4 = at4["constexprs"]
    assert (c4["RB"], c4["KS"], c4["CS"], c4["STAGES"], c4["PERSIST"]) == (r.swiglu_rb, r.swiglu_ks, 1, 0, 1)
    assert at4["grid"] == [r.swiglu_persist * t16.sms, 1, 1]
    # ... else its own split and the cp.async ring (sm_80 and later), whose shared memory counts
    pair = q4_mma.rule_launch(16, 17408, 5120, 128, t16, pair=True)["constexprs"]
    assert (pair["RB"], pair["KS"], pair["STAGES"], pair["PERSIST"]) == (r.swiglu_rb, r.swiglu_ks, r.swiglu_stages, 0)
    assert q4_mma.ring_bytes(pair) == 8 * pair["STAGES"] * 2 * (2 * 32 * 16 + 2 * 32 * 4)  # 8 warps, 2 weights
    assert q4_mma.shared_bytes(pair) == 16 * (2 * 5120 + 64) + q4_mma.ring_bytes(pair)  # after the staged x
    # persistent, the sums go after the staged x (which stays for the next row blocks) instead of over it
    assert q4_mma.shared_bytes(c4) == 4 * (2 * 5120 + 64) + 8 * 32 * 8 * 4 + 2 * 32 * 8 * 4
    # where neither fits (sm_86's 99 KB at 8 rows), the register form, a CTA per row block
    c86 = q4_mma.rule_launch(8, 17408, 5120, 128, _on("sm_86"), pair=True)["constexprs"]
    assert (c86["STAGES"], c86["PERSIST"]) == (0, 0)
    assert "cp.async" in q4_mma.fits(4, 5120, 6144, 128, 4, 4, 1, TARGETS["sm_90"], stages=1)
    # Qwen3-Next's grouped experts: gate / up on its own KS and ring, down in registers
    gu = q4_mma.grouped_launch(2560, 512, 512, 2048, 128, 300, TARGETS["sm_90"], True)["constexprs"]
    dn = q4_mma.grouped_launch(2560, 512, 2048, 512, 128, 300, TARGETS["sm_90"], False)["constexprs"]
    rule = TARGETS["sm_90"].rules["q4_mma"]
    assert (gu["KS"], gu["STAGES"]) == (rule.grouped_swiglu_ks, rule.grouped_swiglu_stages) != (rule.grouped_ks, 0)
    assert (dn["KS"], dn["STAGES"]) == (rule.grouped_ks, 0)


def test_matmuls_at_a_few_q4_rows_select_it():
    from kestrel.compiler.ir import Op, Program, TensorType, Value
    from kestrel.compiler.ops import OPS

    t = _on()
    p = Program("t")
    x = Value(TensorType("f32", (4, 5120)))
    for dtype, expect, jit in (("q4g128", "q4mma_rows_q4g128", q4_mma.q4mma_rows),
                               ("bf16", "matvec_rows_bf16", OPS["matmul"].kernel.variants[0][1])):  # (27B bf16:
        # the few-rows matvec, faster there than kernels/bf16_mma.py)
        w = p.add_weight(f"w_{dtype}", dtype, (17408, 5120))
        op = Op("matmul", [Value(TensorType("f32", (4, 17408)))], [x, w], {})
        op.launch = OPS["matmul"].kernel.launch(op, t)
        assert op.launch["kernel"] == expect and OPS["matmul"].kernel.jit_for(op) is jit


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_compiles_for_every_target(target):
    t = _on(target)
    cases = [(4, 5120, 6144, 128, False), (4, 17408, 5120, 128, True), (16, 512, 2048, 64, False),
             (2, 1024, 1024, 32, True)]
    for m, n, k, group, pair in cases:
        launch = q4_mma.rule_launch(m, n, k, group, t, pair) or q4_mma.launch(m, n, k, group, 1, 2, 1, 2, pair)
        c = launch["constexprs"]
        assert q4_mma.fits(m, n, k, group, c["RB"], c["KS"], c["CS"], t, pair, c["STAGES"], persist=c["PERSIST"]) is None
        assert c["STAGES"] in ((0, t.rules["q4_mma"].swiglu_stages) if pair else (0,))
        types = ["*fp32", "*u8"] + (["*u8"] if pair else []) + ["*fp32"]
        ck = compile_kernel("q4mma", q4_mma.q4mma_rows_swiglu if pair else q4_mma.q4mma_rows, types, c,
                            launch["num_warps"], t.cc)
        # the folded forms (fold_row_norms): the add, and the norm before the product
        if not pair and (add := q4_mma.add_launch(m, n, k, group, t)) is not None:
            assert compile_kernel("q4mma_add", q4_mma.q4mma_add, ["*fp32", "*u8", "*fp32", "*fp32", "*fp32", "i32"],
                                  add["constexprs"], add["num_warps"], t.cc).cubin[:4] == b"\x7fELF"
        norm = q4_mma.rule_launch(m, n, k, group, t, pair, norm=True)
        if norm is not None:
            fn = q4_mma.q4mma_norm_swiglu if pair else q4_mma.q4mma_norm
            nt = ["*fp32", "*fp32", "*fp32", "*u8"] + (["*u8"] if pair else []) + ["*fp32", "fp32"]
            assert compile_kernel("q4mma_norm", fn, nt, norm["constexprs"], norm["num_warps"], t.cc).cubin[:4] == b"\x7fELF"
        assert ck.cubin[:4] == b"\x7fELF" and ck.arch == f"sm_{t.cc}" and ck.compiler.startswith("nvrtc")
        assert ck.name == ("q4mma_rows_swiglu" if pair else "q4mma_rows") and ck.shared == q4_mma.shared_bytes(c)
        assert [p for p, _ in ck.params] == list((q4_mma.q4mma_rows_swiglu if pair else q4_mma.q4mma_rows).params)


def test_kestrel_rules_turns_it_off_for_a_build(tmp_path, monkeypatch):
    """KESTREL_RULES (kernels/targets.py's override_rules) changes a build's rule rows, says so in the log, and
    refuses what is not family.field=value in one line (exit 6)."""
    from conftest import run_cli
    from kestrel.artifacts.plan import load_plan

    path = str(tmp_path / "t.plan")
    args = ("kestrelc", "build", "tiny", "-o", path, "--target", "sm_90", "--quant", "q4", "--prefill-rows", "4")
    assert run_cli(*args).returncode == 0
    assert any(k["id"].startswith("q4mma_rows_") for k in load_plan(path).launch_plan["kernels"])
    monkeypatch.setenv("KESTREL_RULES", OFF)
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert f"changed by KESTREL_RULES: {OFF}" in r.stdout + r.stderr
    assert not any(k["id"].startswith("q4mma_") for k in load_plan(path).launch_plan["kernels"])
    monkeypatch.setenv("KESTREL_RULES", "q4_mma.max_rowz=8")
    r = run_cli("kestrelc", "build", "tiny", "-o", path, "--target", "sm_90", "--quant", "q4")
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 6 and "q4_mma.max_rowz=8" in last and last.endswith("fix or unset KESTREL_RULES")


def test_without_nvrtc_the_build_says_what_to_install(monkeypatch):
    from cuda.bindings import nvrtc

    from kestrel.artifacts.errors import BackendMissingError

    def missing():
        raise RuntimeError("libnvrtc.so.13: cannot open shared object file")

    monkeypatch.setattr(nvrtc, "nvrtcVersion", missing)
    launch = q4_mma.launch(4, 64, 256, 128, 1, 2, 1, 2, False)
    with pytest.raises(BackendMissingError, match=r"nvidia-cuda-nvrtc .*pip install -e '\.\[compile\]'"):
        compile_kernel("q4mma", q4_mma.q4mma_rows, ["*fp32", "*u8", "*fp32"], launch["constexprs"], 2, 90)
    assert BackendMissingError.exit_code == 9
