"""Fused Gated DeltaNet decode step: gdn_delta_kernel then gdn_norm_kernel (what fuse emits), in the
interpreter against gdn_step_ref over several consecutive steps (state carried in place), each op
against its own reference, and AOT compilation of both for every GPU target."""
import dataclasses

import pytest
import torch

from kernel_harness import assert_close, interpret, split_compile_fixture
from kestrel.kernels.elementwise import l2norm_ref
from kestrel.kernels.gated_delta import (conv1d_step_ref, gated_delta_step_ref, gdn_delta_kernel, gdn_delta_launch,
                                         gdn_delta_ref, gdn_gates_ref, gdn_norm_kernel, gdn_norm_launch, gdn_norm_ref,
                                         gdn_step_ref)
from kestrel.kernels.rmsnorm import gated_rmsnorm_ref
from kestrel.kernels.targets import TARGETS

EPS, L2_EPS = 1e-6, 1e-6


def make_layer(hk, hv, dk, dv, kc, gen):
    c = 2 * hk * dk + hv * dv
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return {"conv_state": r(c, kc - 1), "conv_w": r(c, kc) * 0.5, "a_log": r(hv) * 0.5,
            "dt_bias": r(hv) * 0.5, "norm_w": 1.0 + 0.1 * r(dv), "rec_state": r(hv, dk, dv) * 0.3}


def make_token(hk, hv, dk, dv, gen):
    c = 2 * hk * dk + hv * dv
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return {"qkv": r(c), "z": r(hv * dv), "b": r(hv), "a": r(hv)}


GDN_SHAPES = [(2, 4, 16, 16, 4), (2, 2, 8, 16, 4), (1, 3, 32, 32, 4), (1, 2, 12, 24, 3)]


def run_split_step(tok, layer, hk, hv, dk, dv, kc, scale):
    """gdn_delta then gdn_norm in the interpreter (as a plan launches them); returns (o_raw, out)."""
    c = 2 * hk * dk + hv * dv
    dl, nl = gdn_delta_launch(hk, hv, dk, dv, kc, TARGETS["sm_90"]), gdn_norm_launch(hv, dv, c, kc, TARGETS["sm_90"])
    o_raw, out = torch.full((hv * dv,), float("nan")), torch.full((hv * dv,), float("nan"))
    interpret(gdn_delta_kernel)[tuple(dl["grid"])](
        tok["qkv"], tok["b"], tok["a"], layer["conv_state"], layer["conv_w"], layer["a_log"], layer["dt_bias"],
        layer["rec_state"], o_raw, L2_EPS, scale, **dl["constexprs"])
    interpret(gdn_norm_kernel)[tuple(nl["grid"])](
        o_raw, tok["z"], tok["qkv"], layer["norm_w"], layer["conv_state"], out, EPS, **nl["constexprs"])
    return o_raw, out


@pytest.mark.parametrize("hk,hv,dk,dv,kc", GDN_SHAPES)
def test_gdn_delta_then_norm_match_gdn_step_ref_over_steps(hk, hv, dk, dv, kc):
    gen = torch.Generator().manual_seed(1000 * hk + 100 * hv + dk + dv + kc + 7)
    layer = make_layer(hk, hv, dk, dv, kc, gen)
    ref_state = {k: layer[k].clone() for k in ("conv_state", "rec_state")}
    scale = dk ** -0.5
    for step in range(3):
        tok = make_token(hk, hv, dk, dv, gen)
        ref = gdn_step_ref(tok["qkv"], tok["z"], tok["b"], tok["a"], ref_state["conv_state"], layer["conv_w"],
                           layer["a_log"], layer["dt_bias"], layer["norm_w"], ref_state["rec_state"], EPS, L2_EPS,
                           scale)
        _, out = run_split_step(tok, layer, hk, hv, dk, dv, kc, scale)
        what = f"step {step} hk={hk} hv={hv} dk={dk} dv={dv}"
        assert_close(out, ref, 1e-5, 0.0, f"{what}: out")
        assert torch.equal(layer["conv_state"], ref_state["conv_state"]), f"{what}: conv_state"
        assert_close(layer["rec_state"], ref_state["rec_state"], 1e-5, 0.0, f"{what}: rec_state")


@pytest.mark.parametrize("hk,hv,dk,dv,kc", GDN_SHAPES[::2])
def test_gdn_delta_and_norm_match_their_references(hk, hv, dk, dv, kc):
    """Each op against its own reference, from the same inputs; the split refs equal the unfused
    single-op references in sequence bit for bit (so the fused program's CPU path is the model's)."""
    gen = torch.Generator().manual_seed(31 * hk + 7 * hv + dk + dv + kc)
    layer = make_layer(hk, hv, dk, dv, kc, gen)
    tok = make_token(hk, hv, dk, dv, gen)
    scale = dk ** -0.5
    ref = {k: layer[k].clone() for k in ("conv_state", "rec_state")}
    o_ref = gdn_delta_ref(tok["qkv"], tok["b"], tok["a"], ref["conv_state"], layer["conv_w"], layer["a_log"],
                          layer["dt_bias"], ref["rec_state"], L2_EPS, scale)
    assert torch.equal(ref["conv_state"], layer["conv_state"])  # gdn_delta only reads the conv state
    out_ref = gdn_norm_ref(o_ref, tok["z"], tok["qkv"], layer["norm_w"], ref["conv_state"], EPS)
    step = {k: layer[k].clone() for k in ("conv_state", "rec_state")}
    mixed = conv1d_step_ref(tok["qkv"], step["conv_state"], layer["conv_w"], "silu")
    q = l2norm_ref(mixed[: hk * dk].reshape(hk, dk), L2_EPS)
    k = l2norm_ref(mixed[hk * dk: 2 * hk * dk].reshape(hk, dk), L2_EPS)
    g, beta = gdn_gates_ref(tok["a"], tok["b"], layer["a_log"], layer["dt_bias"])
    o = gated_delta_step_ref(q, k, mixed[2 * hk * dk:].reshape(hv, dv), g, beta, step["rec_state"], scale)
    whole = gated_rmsnorm_ref(o, tok["z"].reshape(hv, dv), layer["norm_w"], EPS).reshape(hv * dv)
    assert torch.equal(out_ref, whole) and all(torch.equal(ref[k], step[k]) for k in ref)
    o_raw, out = run_split_step(tok, layer, hk, hv, dk, dv, kc, scale)
    what = f"hk={hk} hv={hv} dk={dk} dv={dv}"
    assert_close(o_raw, o_ref, 1e-5, 0.0, f"{what}: o_raw")
    assert_close(out, out_ref, 1e-5, 0.0, f"{what}: out")
    assert torch.equal(layer["conv_state"], ref["conv_state"]), f"{what}: conv_state"
    assert_close(layer["rec_state"], ref["rec_state"], 1e-5, 0.0, f"{what}: rec_state")


def test_launch_grids_at_27b():
    t = TARGETS["sm_90"]
    assert gdn_delta_launch(16, 48, 128, 128, 4, t)["grid"] == [48, 16, 1]  # 768 programs of one warp
    assert gdn_norm_launch(48, 128, 2 * 16 * 128 + 48 * 128, 4, t)["grid"] == [48, 1, 1]


SHAPES = {"tiny": (2, 4, 16, 16, 4), "qwen3.5-27b": (16, 48, 128, 128, 4)}
KERNELS = ("gdn_delta", "gdn_norm")
NOFUSE = dataclasses.replace(TARGETS["sm_90"], rules={**TARGETS["sm_90"].rules, "gdn_delta": dataclasses.replace(
    TARGETS["sm_90"].rules["gdn_delta"], fp_fusion=False)})


def launch_of(kernel, dims, t):
    hk, hv, dk, dv, kc = dims
    if kernel == "gdn_norm":
        return gdn_norm_launch(hv, dv, 2 * hk * dk + hv * dv, kc, t)
    return gdn_delta_launch(*dims, t)


# runtime parameters: (pointers, scalars) in ABI order
PARAMS = {"gdn_delta": (9, 2), "gdn_norm": (6, 1)}

_COMPILE_ALL = """
import json, sys
from kestrel.compiler.codegen import compile_kernel
res = {}
import hashlib
for key, kernel, (n_ptr, n_scalar), consts, num_warps, cc, fusion in json.loads(sys.stdin.read()):
    try:
        ck = compile_kernel(kernel, "kestrel.kernels.gated_delta:" + kernel + "_kernel", ["*fp32"] * n_ptr + ["fp32"] * n_scalar, consts, num_warps, cc,
                            [True] * n_ptr + [False] * n_scalar, fusion)
        res[key] = [len(ck.cubin), ck.num_warps, ck.arch, hashlib.sha256(ck.cubin).hexdigest()]
    except Exception as e:  # reported per (kernel, shape, target) by the test
        res[key] = repr(e)[-2000:]
print(json.dumps(res))
"""


def aot_jobs():
    jobs = []
    for kernel in KERNELS:
        for shape, dims in SHAPES.items():
            for name, t in TARGETS.items():
                launch = launch_of(kernel, dims, t)
                jobs.append([f"{kernel}/{shape}/{name}", kernel, PARAMS[kernel], launch["constexprs"],
                             launch["num_warps"], t.cc, True])
        launch = launch_of(kernel, SHAPES["qwen3.5-27b"], NOFUSE)  # the rule gdn_delta.fp_fusion=False
        jobs.append([f"{kernel}/qwen3.5-27b/sm_90/nofuse", kernel, PARAMS[kernel], launch["constexprs"],
                     launch["num_warps"], NOFUSE.cc, launch["fp_fusion"]])
    return jobs


# every job split between clean processes started with the module, beside its interpreter tests
_aot = split_compile_fixture(_COMPILE_ALL, aot_jobs, "test_gdn_kernels_aot_compile")


@pytest.fixture(scope="module")
def compiled(_aot):
    """All (kernel, shape, target) AOT compiles, in a few clean subprocesses (no interpreter): a process
    per compile would spend most of the time importing torch and triton."""
    return _aot.compiled()


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kernel", KERNELS)
def test_gdn_kernels_aot_compile(compiled, kernel, shape, target):
    res = compiled[f"{kernel}/{shape}/{target}"]
    assert isinstance(res, list), f"{kernel} {shape} for {target}: {res}"
    size, num_warps, arch, _ = res
    assert size > 0 and num_warps == launch_of(kernel, SHAPES[shape], TARGETS[target])["num_warps"]
    assert arch.startswith(f"sm_{TARGETS[target].cc}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_gdn_kernels_compile_without_fp_fusion_when_the_rule_says(compiled, kernel):
    """gdn_delta.fp_fusion=False: the one-token GDN kernels (and their twins at a verify's rows, in
    test_kernels_speculative) carry fp_fusion=False, and the compiler is told: another cubin than the fused one."""
    assert "fp_fusion" not in launch_of(kernel, SHAPES["qwen3.5-27b"], TARGETS["sm_90"])
    off = compiled[f"{kernel}/qwen3.5-27b/sm_90/nofuse"]
    assert isinstance(off, list), off
    assert off[0] > 0 and off[3] != compiled[f"{kernel}/qwen3.5-27b/sm_90"][3]
