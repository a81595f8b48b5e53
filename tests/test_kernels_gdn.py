"""Fused Gated DeltaNet decode step (gdn_step_kernel): interpreter runs against gdn_step_ref over
several consecutive steps (state carried in place), and AOT compilation for every GPU target."""
import pytest
import torch

from kernel_harness import assert_close, interpret
from kestrel.kernels.gated_delta import gdn_step_kernel, gdn_step_launch, gdn_step_ref
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


@pytest.mark.parametrize("hk,hv,dk,dv,kc", [(2, 4, 16, 16, 4), (2, 2, 8, 16, 4), (1, 3, 32, 32, 4), (1, 2, 12, 24, 3)])
def test_gdn_step_matches_reference_over_steps(hk, hv, dk, dv, kc):
    gen = torch.Generator().manual_seed(1000 * hk + 100 * hv + dk + dv + kc)
    layer = make_layer(hk, hv, dk, dv, kc, gen)
    ref_state = {k: layer[k].clone() for k in ("conv_state", "rec_state")}
    launch = gdn_step_launch(hk, hv, dk, dv, kc, TARGETS["sm_90"])
    assert launch["grid"] == [hk, 1, 1]
    scale = dk ** -0.5
    for step in range(3):
        tok = make_token(hk, hv, dk, dv, gen)
        ref = gdn_step_ref(tok["qkv"], tok["z"], tok["b"], tok["a"], ref_state["conv_state"], layer["conv_w"],
                           layer["a_log"], layer["dt_bias"], layer["norm_w"], ref_state["rec_state"], EPS, L2_EPS,
                           scale)
        out = torch.full((hv * dv,), float("nan"))
        interpret(gdn_step_kernel)[tuple(launch["grid"])](
            tok["qkv"], tok["z"], tok["b"], tok["a"], layer["conv_state"], layer["conv_w"], layer["a_log"],
            layer["dt_bias"], layer["norm_w"], layer["rec_state"], out, EPS, L2_EPS, scale, **launch["constexprs"])
        what = f"step {step} hk={hk} hv={hv} dk={dk} dv={dv}"
        assert_close(out, ref, 1e-5, 0.0, f"{what}: out")
        assert torch.equal(layer["conv_state"], ref_state["conv_state"]), f"{what}: conv_state"
        assert_close(layer["rec_state"], ref_state["rec_state"], 1e-5, 0.0, f"{what}: rec_state")


SHAPES = {"tiny": (2, 4, 16, 16, 4), "qwen3.5-27b": (16, 48, 128, 128, 4)}
TYPES = ["*fp32"] * 11 + ["fp32"] * 3

_COMPILE_ALL = """
import json, sys
from kestrel.kernels.aot import compile_kernel
res = {}
for key, consts, num_warps, cc in json.loads(sys.stdin.read()):
    try:
        ck = compile_kernel("gdn_step", %r, consts, num_warps, cc, [True] * 11 + [False] * 3)
        res[key] = [len(ck.cubin), ck.num_warps, ck.arch]
    except Exception as e:  # reported per (shape, target) by the test
        res[key] = repr(e)[-2000:]
print(json.dumps(res))
""" % (TYPES,)


@pytest.fixture(scope="module")
def compiled():
    """All (shape, target) AOT compiles in ONE clean subprocess (no interpreter): a process per
    compile would spend most of the time importing torch and triton."""
    import json
    import os
    import subprocess
    import sys

    jobs = []
    for shape, dims in SHAPES.items():
        for name, t in TARGETS.items():
            launch = gdn_step_launch(*dims, t)
            jobs.append([f"{shape}/{name}", launch["constexprs"], launch["num_warps"], t.cc])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_ALL], input=json.dumps(jobs), capture_output=True, text=True,
                       env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_gdn_step_aot_compiles(compiled, shape, target):
    res = compiled[f"{shape}/{target}"]
    assert isinstance(res, list), f"{shape} for {target}: {res}"
    size, num_warps, arch = res
    assert size > 0 and num_warps == gdn_step_launch(*SHAPES[shape], TARGETS[target])["num_warps"]
    assert arch.startswith(f"sm_{TARGETS[target].cc}")
