"""The M-row GEMM (kernels/gemm.py) in Triton's interpreter against its torch reference, and AOT-compiled
for every target. (The interpreter computes bf16 dots wrongly, so the tests run the kernel with
DOT_FP32, which feeds the dot the same bf16-rounded values as fp32; the compiled kernels use the bf16
tensor-core dot. The H200 check, bench/device_gemm.py, compares those with the same reference.)"""
import pytest
import torch

from kernel_harness import COMPILE_SCRIPT, interpret, split_compile_fixture
from kestrel.compiler.codegen import jit_name
from kestrel.kernels.gemm import gemm_kernel, gemm_launch, gemm_ref, gemm_swiglu_kernel, gemm_swiglu_ref
from kestrel.kernels.matvec import q4_pack, q4_unpack
from kestrel.kernels.targets import TARGETS


def _case(m, n, k, group, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    wf = torch.randn(n, k, generator=g) / k ** 0.5
    return x, (q4_pack(wf, group) if group else wf.to(torch.bfloat16))


@pytest.mark.parametrize("m, n, k, group", [(16, 48, 64, 0), (20, 40, 96, 32), (33, 24, 128, 64), (8, 16, 32, 0),
                                            (130, 136, 256, 128), (5, 200, 64, 32)])
def test_gemm_matches_reference(m, n, k, group):
    x, w = _case(m, n, k, group, m * n + k)
    c = gemm_launch(m, n, k, group, TARGETS["sm_90"])
    c["constexprs"]["DOT_FP32"] = True
    y = torch.full((m, n), float("nan"))
    interpret(gemm_kernel)[tuple(c["grid"])](x, w, y, **c["constexprs"])
    ref = gemm_ref(x, w, group)
    assert torch.isfinite(y).all()  # every output written
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-6  # only the summation order differs
    # against fp32 weights and activations (the one-token step's CPU reference): the bf16 roundings
    wf = q4_unpack(w, n, k, group) if group else w.float()
    assert ((y - x @ wf.T).abs().max() / (x @ wf.T).abs().max()).item() < 2e-2


@pytest.mark.parametrize("m, n, k, group", [(16, 48, 64, 0), (20, 40, 96, 32), (5, 200, 64, 0)])
def test_gemm_swiglu_matches_reference(m, n, k, group):
    x, wg = _case(m, n, k, group, m + n + k)
    _, wu = _case(m, n, k, group, m + n + k + 1)
    c = gemm_launch(m, n, k, group, TARGETS["sm_90"], swiglu=True)
    if m > TARGETS["sm_90"].rules["gemm"].skinny_rows:  # two accumulators: half the N tile; a few rows: swept
        assert c["constexprs"]["BLOCK_N"] <= gemm_launch(m, n, k, group, TARGETS["sm_90"])["constexprs"]["BLOCK_N"]
    c["constexprs"]["DOT_FP32"] = True
    y = torch.full((m, n), float("nan"))
    interpret(gemm_swiglu_kernel)[tuple(c["grid"])](x, wg, wu, y, **c["constexprs"])
    ref = gemm_swiglu_ref(x, wg, wu, group)
    assert torch.isfinite(y).all()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-6


# The 27B projections at M rows: bf16, q4 (a tile inside one scale group), q4 at group 32 (tiles across
# groups), and the q4 MLP's gate/up pair
AOT_CASES = [(gemm_kernel, "gemm", (256, 5120, 5120, 0), False), (gemm_kernel, "gemm", (256, 17408, 5120, 128), False),
             (gemm_kernel, "gemm", (128, 1024, 1024, 32), False),
             (gemm_swiglu_kernel, "gemm_swiglu", (128, 17408, 5120, 128), True)]


def aot_jobs():
    jobs = []
    for target in sorted(TARGETS):
        for jit, name, (m, n, k, group), swiglu in AOT_CASES:
            c = gemm_launch(m, n, k, group, TARGETS[target], swiglu=swiglu)
            w = "*u8" if group else "*bf16"
            types = ["*fp32", w] + ([w] if swiglu else []) + ["*fp32"]
            kid = f"{name}_" + ("q4g%d" % group if group else "bf16")
            jobs.append([f"{kid}/{target}/{m}x{n}x{k}", jit_name(jit), types, c["constexprs"], c["num_warps"],
                         TARGETS[target].cc, [True] * len(types)])
    return jobs


# every (case, target) compile in clean processes started with the module, beside its interpreter tests
_aot = split_compile_fixture(COMPILE_SCRIPT, aot_jobs, "test_gemm_compiles_for_every_target")


@pytest.fixture(scope="module")
def aot_results(_aot):
    return _aot.result()


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_gemm_compiles_for_every_target(aot_results, target):
    """The AOT_CASES compile for every target."""
    rcs, res, errs = aot_results
    assert all(rc == 0 for rc in rcs), errs
    jobs = [j for j in aot_jobs() if j[0].split("/")[1] == target]
    assert len(jobs) == len(AOT_CASES)
    for key, _, _, _, num_warps, _, _ in jobs:
        k = res[key]
        assert isinstance(k, dict), f"{key}: {k}"
        assert k["magic"] == b"\x7fELF".hex() and k["num_warps"] == num_warps, key
