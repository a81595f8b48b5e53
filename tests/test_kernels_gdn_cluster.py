"""kernels/gdn_cluster.py, a Gated DeltaNet mixer at one row as one cluster launch (CUDA C through NVRTC). Without a
GPU: its reference against the unfused ops' references composed as the program runs them, its CPU emulation (what
the launch-plan tests run), the launch rule (shapes and targets it takes, where it refuses), and its AOT compile for
every target with clusters and bulk copies. Its CUDA C runs on the device only (bench/device_stop49.sh gclus:
bench/device_kernels.py against ``rmsnorm_gdn_ref`` at the 80B-A3B and 0.8B shapes, whole plans against the CPU
path)."""
import dataclasses

import pytest
import torch

from kestrel.compiler.codegen import compile_kernel
from kestrel.kernels import gdn_cluster
from kestrel.kernels.gated_delta import gdn_delta_ref, gdn_norm_ref
from kestrel.kernels.matvec import q4_pack, q4_unpack, rmsnorm_matvec_ref
from kestrel.kernels.targets import GPU_TARGETS, TARGETS


def _on(name: str = "sm_90", **fields):
    t = TARGETS[name]
    return dataclasses.replace(t, rules={**t.rules, "gdn_cluster": dataclasses.replace(
        t.rules["gdn_cluster"], on=True, **fields)})


def _layer(k, hk, hv, dk, dv, kc, group, seed):
    """A layer's operands (the projection q4), as the program holds them."""
    g = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    n = c + hv * dv + 2 * hv
    w = q4_pack(torch.randn(n, k, generator=g) / k ** 0.5, group)
    s = torch.randn(k, generator=g)
    ss = (s ** 2).reshape(16, -1).sum(-1)
    return dict(s=s, ss=ss, nw=0.1 * torch.randn(k, generator=g), w=w, wd=q4_unpack(w, n, k, group),
                conv_state=0.5 * torch.randn(c, kc - 1, generator=g), conv_w=0.5 * torch.randn(c, kc, generator=g),
                a_log=torch.rand(hv, generator=g).mul(15).add(1).log(), dt_bias=0.5 * torch.randn(hv, generator=g),
                norm_w=0.1 * torch.randn(dv, generator=g), rec=0.1 * torch.randn(hv, dk, dv, generator=g))


ATTRS = dict(eps=1e-6, l2_eps=1e-6, scale=128 ** -0.5, norm_eps=1e-6)


def test_reference_is_the_unfused_ops_in_program_order():
    """rmsnorm_matmul, the slices qkv | z | b | a of its rows (fuse's concatenation order), gdn_delta, gdn_norm:
    the same output and states bit for bit."""
    hk, hv, dk, dv, kc = 2, 4, 32, 32, 4
    L = _layer(128, hk, hv, dk, dv, kc, 32, 1)
    c = 2 * hk * dk + hv * dv
    cs, rec = L["conv_state"].clone(), L["rec"].clone()
    y = rmsnorm_matvec_ref(L["s"], L["ss"], L["nw"], L["wd"], 1e-6)
    qkv, z, b, a = y[:c], y[c:c + hv * dv], y[c + hv * dv:c + hv * dv + hv], y[c + hv * dv + hv:]
    want = gdn_norm_ref(gdn_delta_ref(qkv, b, a, cs, L["conv_w"], L["a_log"], L["dt_bias"], rec, 1e-6, 128 ** -0.5),
                        z, qkv, L["norm_w"], cs, 1e-6)
    cs2, rec2 = L["conv_state"].clone(), L["rec"].clone()
    got = gdn_cluster.rmsnorm_gdn_ref(L["s"], L["ss"], L["nw"], L["wd"], cs2, L["conv_w"], L["a_log"],
                                      L["dt_bias"], L["norm_w"], rec2, **ATTRS)
    assert torch.equal(got, want) and torch.equal(cs2, cs) and torch.equal(rec2, rec)
    assert not torch.equal(cs, L["conv_state"]) and not torch.equal(rec, L["rec"])  # (both states moved)


@pytest.mark.parametrize("shape", [(2048, 16, 32, 128, 128), (1024, 16, 16, 128, 128), (128, 2, 4, 32, 32)])
def test_emulated_launch_writes_the_reference(shape):
    """The CPU emulation over flat arena views (q4 bytes, f32 states) gives the reference's output and states; the
    launch is one cluster of CS CTAs a key head."""
    k, hk, hv, dk, dv = shape
    kc, group = 4, 128
    L = _layer(k, hk, hv, dk, dv, kc, group, 2)
    launch = gdn_cluster.gdn_cluster_launch(k, group, hk, hv, dk, dv, kc, 16, _on())
    assert launch["grid"] == [hk * 8, 1, 1] and launch["num_warps"] == 8
    cs, rec = L["conv_state"].clone(), L["rec"].clone()
    want = gdn_cluster.rmsnorm_gdn_ref(L["s"], L["ss"], L["nw"], L["wd"], cs, L["conv_w"], L["a_log"], L["dt_bias"],
                                       L["norm_w"], rec, **ATTRS)
    flat_cs, flat_rec = L["conv_state"].clone().reshape(-1), L["rec"].clone().reshape(-1)
    out = torch.full((hv * dv + 3,), float("nan"))
    gdn_cluster.gdn_cluster[launch["grid"]](L["s"], L["ss"], L["nw"], L["w"], flat_cs, L["conv_w"].reshape(-1),
                                            L["a_log"], L["dt_bias"], L["norm_w"], flat_rec, out, *ATTRS.values(),
                                            **launch["constexprs"], PDL=True)
    # (the emulation's rstd comes from the partials in float64, the reference's from s: the same to an ulp or so)
    torch.testing.assert_close(out[:hv * dv], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat_cs.view_as(cs), cs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat_rec.view_as(rec), rec, rtol=1e-5, atol=1e-6)
    assert out[hv * dv:].isnan().all()


def test_rule_takes_the_shapes_whose_rows_fit_and_refuses_the_rest():
    on = _on()
    # 80B-A3B / 35B-A3B (Hk 16, Hv 32 at hidden 2048): 98 rows a CTA, 110 KB of shared memory; 0.8B and 2B (Hv 16)
    for k, hv in ((2048, 32), (1024, 16), (2048, 16)):
        launch = gdn_cluster.gdn_cluster_launch(k, 128, 16, hv, 128, 128, 4, 128, on)
        assert launch is not None and gdn_cluster.shared_bytes(launch["constexprs"]) <= on.smem_optin, (k, hv)
    assert gdn_cluster.shared_bytes(gdn_cluster.gdn_cluster_launch(2048, 128, 16, 32, 128, 128, 4, 128, on)
                                    ["constexprs"]) == 110336  # (SMEM_BYTES of the source at 80B-A3B, worked by hand)
    assert gdn_cluster.gdn_cluster_launch(5120, 128, 16, 48, 128, 128, 4, 640, on) is None  # 27B: 48 columns a CTA
    assert gdn_cluster.gdn_cluster_launch(4096, 128, 16, 32, 128, 128, 4, 128, on) is not None  # 9B: 207 KB fits
    assert gdn_cluster.gdn_cluster_launch(8192, 128, 16, 32, 128, 128, 4, 128, on) is None  # rows past shared memory
    assert gdn_cluster.gdn_cluster_launch(2048, 128, 16, 32, 128, 128, 4, 128, TARGETS["sm_90"]) is None  # off
    assert gdn_cluster.gdn_cluster_launch(1024, 128, 16, 16, 128, 128, 4, 128, _on("sm_80")) is None  # no clusters
    assert gdn_cluster.gdn_cluster_launch(1024, 0, 16, 16, 128, 128, 4, 128, on) is None  # bf16: q4 only
    assert gdn_cluster.gdn_cluster_launch(1024, 128, 16, 16, 128, 128, 4, 128, _on(cs=3)) is None  # no split
    assert gdn_cluster.gdn_cluster_launch(2048, 128, 16, 32, 128, 128, 4, 128, _on("sm_120")) is None  # 99 KB


@pytest.mark.parametrize("target", [t for t in GPU_TARGETS if TARGETS[t].cc >= 90])
def test_compiles_for_every_target_with_clusters(target):
    pytest.importorskip("cuda.bindings.nvrtc")
    t = _on(target)
    launch = gdn_cluster.gdn_cluster_launch(1024, 128, 16, 16, 128, 128, 4, 256, t)  # the 0.8B shape
    types = ["*fp32", "*fp32", "*fp32", "*u8"] + ["*fp32"] * 7 + ["fp32"] * 4
    ck = compile_kernel("gdn_cluster_q4g128", gdn_cluster.gdn_cluster, types, launch["constexprs"],
                        launch["num_warps"], t.cc)
    assert ck.cubin[:4] == b"\x7fELF" and ck.arch == f"sm_{t.cc}" and ck.compiler.startswith("nvrtc")
    assert ck.shared == gdn_cluster.shared_bytes(launch["constexprs"]) <= t.smem_optin


def test_no_fence_at_gpu_scope_in_the_compiled_kernel():
    """Stop 49 call 1: each ``barrier.cluster.arrive.release`` compiled to ``MEMBAR.ALL.GPU``, which drained the
    state stores before it (28.5 us a launch against 13.3 for the three launches it replaces). The exchanges now
    complete on mbarriers (``st.async``): the SASS holds no MEMBAR, and one cluster barrier (before the PDL wait)."""
    import os
    import subprocess

    import triton

    pytest.importorskip("cuda.bindings.nvrtc")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip("no cuobjdump in this Triton")
    t = _on()
    launch = gdn_cluster.gdn_cluster_launch(2048, 128, 16, 32, 128, 128, 4, 128, t)  # the 80B-A3B shape
    types = ["*fp32", "*fp32", "*fp32", "*u8"] + ["*fp32"] * 7 + ["fp32"] * 4
    ck = compile_kernel("gdn_cluster_q4g128", gdn_cluster.gdn_cluster, types, launch["constexprs"],
                        launch["num_warps"], t.cc)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gdn_cluster_{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(ck.cubin)
    try:
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)
    assert "UBLKCP" in sass and "STAS" in sass  # (the bulk copies and the st.async exchanges are there)
    assert "MEMBAR" not in sass and sass.count("UCGABAR_ARV") == 1
