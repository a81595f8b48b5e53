"""The M-row (prefill) Gated DeltaNet kernels: gdn_rows_delta_kernel then gdn_rows_norm_kernel in the
interpreter against gdn_rows_delta_ref / gdn_rows_norm_ref (all rows valid, a partial last chunk, no
valid row, two chunks back to back against the reference over the whole prompt), in both forms of the
delta kernel: row by row (fp32, tight bounds) and chunk-parallel (TF32 products, which the kernel
rounds explicitly so that the interpreter sees the GPU's operands: a 1e-3-level bound); the launch
rules at the 27B shape, and AOT compilation of the kernels for every GPU target at the 0.8B shape."""
import pytest
import torch

from kernel_harness import assert_close, interpret, split_compile_fixture
from kestrel.kernels.gated_delta import (gdn_rows_delta_kernel, gdn_rows_delta_launch, gdn_rows_delta_ref,
                                         gdn_rows_norm_kernel, gdn_rows_norm_launch, gdn_rows_norm_ref, gdn_rows_ref)
from kestrel.kernels.rmsnorm import gated_rmsnorm_ref
from kestrel.kernels.targets import ALL_TARGETS, TARGETS

EPS, L2_EPS = 1e-6, 1e-6
SM90 = TARGETS["sm_90"]


def columns(hk, hv, dk, dv):
    """Projection row layout [z | qkv | b | a | pad] (non-zero offsets on purpose): (width, z, qkv, b, a)."""
    c = 2 * hk * dk + hv * dv
    z, qkv = 0, hv * dv
    b = qkv + c
    a = b + hv
    return a + hv + 3, z, qkv, b, a


def make_layer(hk, hv, dk, dv, kc, gen):
    c = 2 * hk * dk + hv * dv
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return {"conv_state": r(c, kc - 1), "conv_w": r(c, kc) * 0.5, "a_log": r(hv) * 0.5,
            "dt_bias": r(hv) * 0.5, "norm_w": 1.0 + 0.1 * r(dv), "rec_state": r(hv, dk, dv) * 0.3}


def slot(v):
    return torch.tensor([v], dtype=torch.int32)


def run_rows(x, layer, dims, pos, n_prompt, scale, chunk=0):
    """gdn_rows_delta (row by row, or in chunks of ``chunk`` rows) then gdn_rows_norm in the
    interpreter (as a plan launches them), states updated in place; returns (o_raw, out)."""
    hk, hv, dk, dv, kc = dims
    rows = x.shape[0]
    width, z, qkv, b, a = columns(hk, hv, dk, dv)
    c = 2 * hk * dk + hv * dv
    dl = gdn_rows_delta_launch(rows, width, hk, hv, dk, dv, kc, SM90, chunk=chunk)
    assert dl["constexprs"]["CHUNK"] == chunk
    nl = gdn_rows_norm_launch(rows, width, hv, dv, c, kc, SM90)
    o_raw, out = torch.full((rows, hv * dv), float("nan")), torch.full((rows, hv * dv), float("nan"))
    interpret(gdn_rows_delta_kernel)[tuple(dl["grid"])](
        x, layer["conv_state"], layer["conv_w"], layer["a_log"], layer["dt_bias"], layer["rec_state"], slot(pos),
        slot(n_prompt), o_raw, qkv, b, a, L2_EPS, scale, **dl["constexprs"])
    interpret(gdn_rows_norm_kernel)[tuple(nl["grid"])](
        o_raw, x, layer["norm_w"], layer["conv_state"], slot(pos), slot(n_prompt), out, z, qkv, EPS,
        **nl["constexprs"])
    return o_raw, out


def ref_rows(x, layer, ref, dims, pos, n_prompt, scale):
    """The references on the states in ``ref`` (updated in place): (o_raw, out)."""
    hk, hv, dk, dv, kc = dims
    _, z, qkv, b, a = columns(hk, hv, dk, dv)
    o_raw = gdn_rows_delta_ref(x, ref["conv_state"], layer["conv_w"], layer["a_log"], layer["dt_bias"],
                               ref["rec_state"], pos, n_prompt, qkv, b, a, L2_EPS, scale)
    out = gdn_rows_norm_ref(o_raw, x, layer["norm_w"], ref["conv_state"], pos, n_prompt, z, qkv, EPS)
    return o_raw, out


# (hk, hv, dk, dv, kc), rows: grouped heads with several column blocks; one key head of non-power-of-two
# sizes (masked lanes) and a conv of 3 taps
SHAPES = [((2, 4, 16, 16, 4), 8), ((1, 2, 32, 32, 4), 5), ((1, 2, 12, 24, 3), 5)]
# (pos, n_prompt): every row valid, a partial last chunk (fewer valid rows than conv taps too), none
CASES = {"all": (0, 100), "partial": (16, 19), "short": (30, 32), "none": (40, 40)}


# the chunked form: dv >= 16 (tensor-core tiles of 16 columns), chunks of 16 rows, and M = 40 rows =
# two whole chunks and a partial one; (pos, n_prompt) as above but in a 40-row chunk ("partial": 21
# valid rows, a partial second chunk and none in the third)
CHUNK_SHAPES = [((2, 4, 16, 32, 4), 40, 16), ((1, 2, 12, 24, 3), 40, 32)]
CHUNK_CASES = {"all": (0, 100), "partial": (16, 37), "none": (40, 40)}
# bounds (relative to the reference's largest value): fp32 row by row, TF32 products in chunks
RTOL = {0: 1e-5, 16: 4e-3, 32: 4e-3, 64: 4e-3}


def check_rows(dims, rows, pos, n_prompt, chunk, seed):
    hk, hv, dk, dv, kc = dims
    gen = torch.Generator().manual_seed(seed)
    layer = make_layer(hk, hv, dk, dv, kc, gen)
    x = torch.randn(rows, columns(hk, hv, dk, dv)[0], generator=gen)
    scale = dk ** -0.5
    ref = {k: layer[k].clone() for k in ("conv_state", "rec_state")}
    start = {k: layer[k].clone() for k in ("conv_state", "rec_state")}
    o_ref, out_ref = ref_rows(x, layer, ref, dims, pos, n_prompt, scale)
    o_raw, out = run_rows(x, layer, dims, pos, n_prompt, scale, chunk)
    what = f"{dims} M={rows} pos={pos} n_prompt={n_prompt} chunk={chunk}"
    valid = max(0, min(rows, n_prompt - pos))
    rtol = RTOL[chunk]
    assert torch.equal(o_raw[valid:], torch.zeros_like(o_raw[valid:])), f"{what}: invalid rows of o_raw"
    assert torch.equal(out[valid:], torch.zeros_like(out[valid:])), f"{what}: invalid rows of out"
    assert torch.equal(layer["conv_state"], ref["conv_state"]), f"{what}: conv_state"
    if valid == 0:
        assert all(torch.equal(layer[k], start[k]) for k in start), f"{what}: states touched"
        return
    assert not torch.equal(layer["conv_state"], start["conv_state"])
    assert_close(o_raw, o_ref, rtol, 0.0, f"{what}: o_raw")
    assert_close(out, out_ref, rtol, 0.0, f"{what}: out")
    assert_close(layer["rec_state"], ref["rec_state"], rtol, 0.0, f"{what}: rec_state")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dims,rows", SHAPES)
def test_rows_kernels_match_references(dims, rows, case):
    pos, n_prompt = CASES[case]
    check_rows(dims, rows, pos, n_prompt, 0, 100 * dims[0] + 10 * dims[1] + sum(dims[2:]) + rows + pos)


@pytest.mark.parametrize("case", sorted(CHUNK_CASES))
@pytest.mark.parametrize("dims,rows,chunk", CHUNK_SHAPES)
def test_chunked_rows_kernel_matches_references(dims, rows, chunk, case):
    pos, n_prompt = CHUNK_CASES[case]
    check_rows(dims, rows, pos, n_prompt, chunk, 31 * dims[1] + sum(dims[2:]) + rows + pos + chunk)


@pytest.mark.parametrize("dims,rows,chunk", [(SHAPES[0][0], 8, 0), (SHAPES[1][0], 5, 0), (CHUNK_SHAPES[0][0], 24, 16)])
def test_two_chunks_carry_the_states(dims, rows, chunk):
    """A prompt of 2 * rows - 2 tokens run as two chunks of ``rows`` (the second partial): the same
    o_raw, norm outputs and states as the reference over the whole prompt in one go."""
    hk, hv, dk, dv, kc = dims
    n_prompt = 2 * rows - 2
    gen = torch.Generator().manual_seed(7 * rows + dk)
    layer = make_layer(hk, hv, dk, dv, kc, gen)
    width, z, qkv, b, a = columns(hk, hv, dk, dv)
    c = 2 * hk * dk + hv * dv
    x = torch.randn(2 * rows, width, generator=gen)
    scale = dk ** -0.5
    ref = {k: layer[k].clone() for k in ("conv_state", "rec_state")}
    o_ref = gdn_rows_ref(x[:, qkv:qkv + c], x[:, b:b + hv], x[:, a:a + hv], ref["conv_state"], layer["conv_w"],
                         layer["a_log"], layer["dt_bias"], ref["rec_state"], 0, n_prompt, L2_EPS, scale)
    out_ref = gated_rmsnorm_ref(o_ref.reshape(2 * rows, hv, dv), x[:, z:z + hv * dv].reshape(2 * rows, hv, dv),
                                layer["norm_w"], EPS).reshape(2 * rows, hv * dv)
    got = [run_rows(x[i * rows:(i + 1) * rows].contiguous(), layer, dims, i * rows, n_prompt, scale, chunk)
           for i in (0, 1)]
    o_raw, out = torch.cat([g[0] for g in got]), torch.cat([g[1] for g in got])
    what = f"{dims} two chunks of {rows}, chunk={chunk}"
    assert torch.equal(o_raw[n_prompt:], torch.zeros_like(o_raw[n_prompt:])), what
    assert_close(o_raw, o_ref, RTOL[chunk], 0.0, f"{what}: o_raw")
    assert_close(out, out_ref, RTOL[chunk], 0.0, f"{what}: out")
    assert torch.equal(layer["conv_state"], ref["conv_state"]), f"{what}: conv_state"
    assert_close(layer["rec_state"], ref["rec_state"], RTOL[chunk], 0.0, f"{what}: rec_state")


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_form_on_hard_inputs(chunk):
    """Nearly equal keys, beta ~ 1 and almost no decay: A[t, s] ~ 1 below the diagonal, the case where
    a power series for (I + A)^-1 would cancel huge terms; the blocked inverse stays within the bound."""
    dims = (2, 4, 16, 32, 4)
    hk, hv, dk, dv, kc = dims
    rows = 64
    gen = torch.Generator().manual_seed(chunk)
    layer = make_layer(hk, hv, dk, dv, kc, gen)
    layer["a_log"][:] = -8.0
    width, z, qkv, b, a = columns(hk, hv, dk, dv)
    x = torch.randn(rows, width, generator=gen)
    k0 = qkv + hk * dk
    x[:, k0:k0 + hk * dk] = x[:1, k0:k0 + hk * dk] + 0.01 * x[:, k0:k0 + hk * dk]
    x[:, b:b + hv] = 6.0
    scale = dk ** -0.5
    ref = {k: layer[k].clone() for k in ("conv_state", "rec_state")}
    o_ref, _ = ref_rows(x, layer, ref, dims, 0, rows, scale)
    o_raw, _ = run_rows(x, layer, dims, 0, rows, scale, chunk)
    assert_close(o_raw, o_ref, RTOL[chunk], 0.0, f"hard inputs, chunk={chunk}: o_raw")
    assert_close(layer["rec_state"], ref["rec_state"], RTOL[chunk], 0.0, f"hard inputs, chunk={chunk}: rec_state")


QWEN_27B = (16, 48, 128, 128, 4)
QWEN_08B = (16, 16, 128, 128, 4)


def width_of(dims):
    hk, hv, dk, dv, _ = dims
    return 2 * hk * dk + hv * dv + hv * dv + 2 * hv


def test_launch_rules_at_27b():
    hk, hv, dk, dv, kc = QWEN_27B
    c = 2 * hk * dk + hv * dv
    assert width_of(QWEN_27B) == 16480 and c == 10240
    for rows in (64, 512):
        for chunk in (None, 0, 16, 64):
            dl = gdn_rows_delta_launch(rows, 16480, hk, hv, dk, dv, kc, SM90, chunk=chunk)
            gx, gy, gz = dl["grid"]
            k = dl["constexprs"]
            assert gx == hv and gy * k["BLOCK_V"] >= dv > (gy - 1) * k["BLOCK_V"] and gz == 1
            assert 128 <= gx * gy <= 1024, dl["grid"]  # enough programs for 132 SMs, each a serial loop
            assert k["BLOCK_DK"] == 128 and k["M"] == rows and k["W"] == 16480 and dl["num_warps"] in (1, 2, 4, 8)
            # by default row by row at 27B: its grid has 768 programs, above the rule's row_min_programs
            assert k["CHUNK"] == (0 if chunk is None else chunk)
            assert k["CHUNK"] == 0 or k["BLOCK_V"] >= 16
        nl = gdn_rows_norm_launch(rows, 16480, hv, dv, c, kc, SM90)
        gx, gy, gz = nl["grid"]
        k = nl["constexprs"]
        assert gx == hv and gy * k["BLOCK_M"] >= rows > (gy - 1) * k["BLOCK_M"] and gz == 1
        assert gx * gy * k["CH_PER_PROG"] >= c  # every conv-state channel has an owner
        assert k["BLOCK_CH"] >= k["CH_PER_PROG"] and k["BLOCK_DV"] == 128
    assert gdn_rows_delta_launch(512, 16480, hk, hv, dk, dv, kc, SM90, chunk=0)["grid"] == [48, 16, 1]  # 768
    assert gdn_rows_delta_launch(512, 16480, hk, hv, dk, dv, kc, SM90, chunk=16)["grid"] == [48, 8, 1]
    assert gdn_rows_norm_launch(512, 16480, hv, dv, c, kc, SM90)["grid"] == [48, 32, 1]
    # 0.8B (16 value heads): 256 row-by-row programs, row_min_programs: row by row (stop 24: 2.96 ms a
    # 256-row run against 3.12 in chunks of 16); 8 value heads would have 128: chunks of 16 rows
    assert gdn_rows_delta_launch(256, 8224, 16, 16, 128, 128, 4, SM90)["constexprs"]["CHUNK"] == 0
    assert gdn_rows_delta_launch(256, 8224, 16, 8, 128, 128, 4, SM90)["constexprs"]["CHUNK"] == 16
    with pytest.raises(ValueError):
        gdn_rows_delta_launch(512, 16480, hk, hv, dk, dv, kc, SM90, chunk=48)
    with pytest.raises(ValueError):
        gdn_rows_delta_launch(512, 16480, hk, hv, dk, dv, 5, SM90, chunk=0)


# kernel variant -> (kernel function, param types, launch); the chunked variant is the same kernel
DELTA_TYPES = ["*fp32"] * 6 + ["*i32"] * 2 + ["*fp32"] + ["i32"] * 3 + ["fp32"] * 2
NORM_TYPES = ["*fp32"] * 4 + ["*i32"] * 2 + ["*fp32"] + ["i32"] * 2 + ["fp32"]
VARIANTS = {"gdn_rows_delta": ("gdn_rows_delta", DELTA_TYPES),
            "gdn_rows_delta_chunked": ("gdn_rows_delta", DELTA_TYPES),
            "gdn_rows_norm": ("gdn_rows_norm", NORM_TYPES)}
AOT_ROWS = 128


def launch_of(variant, dims, t, rows=AOT_ROWS):
    hk, hv, dk, dv, kc = dims
    if variant == "gdn_rows_norm":
        return gdn_rows_norm_launch(rows, width_of(dims), hv, dv, 2 * hk * dk + hv * dv, kc, t)
    return gdn_rows_delta_launch(rows, width_of(dims), hk, hv, dk, dv, kc, t,
                                 chunk=16 if variant.endswith("_chunked") else 0)


_COMPILE_ALL = """
import json, sys
from kestrel.compiler.codegen import compile_kernel
res = {}
for key, kernel, types, consts, num_warps, cc in json.loads(sys.stdin.read()):
    try:
        ck = compile_kernel(kernel, "kestrel.kernels.gated_delta:" + kernel + "_kernel", types, consts, num_warps, cc,
                            [t.startswith("*") for t in types])
        res[key] = [len(ck.cubin), ck.num_warps, ck.arch, ck.shared]
    except Exception as e:  # reported per (kernel, target) by the test
        res[key] = repr(e)[-2000:]
print(json.dumps(res))
"""


def aot_jobs():
    jobs = []
    for variant, (kernel, types) in VARIANTS.items():
        for name in ALL_TARGETS:
            if name == "cpu":
                continue
            t = TARGETS[name]
            launch = launch_of(variant, QWEN_08B, t)
            jobs.append([f"{variant}/{name}", kernel, types, launch["constexprs"], launch["num_warps"], t.cc])
    return jobs


# every job split between clean processes started with the module, beside its interpreter tests
_aot = split_compile_fixture(_COMPILE_ALL, aot_jobs, "test_rows_kernels_aot_compile")


@pytest.fixture(scope="module")
def compiled(_aot):
    """Every (kernel, target) AOT compile, in a few clean subprocesses (no interpreter)."""
    return _aot.compiled()


@pytest.mark.parametrize("target", [n for n in ALL_TARGETS if n != "cpu"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rows_kernels_aot_compile_at_0_8b(compiled, variant, target):
    res = compiled[f"{variant}/{target}"]
    assert isinstance(res, list), f"{variant} for {target}: {res}"
    size, num_warps, arch, shared = res
    t = TARGETS[target]
    assert size > 0 and num_warps == launch_of(variant, QWEN_08B, t)["num_warps"]
    assert arch.startswith(f"sm_{t.cc}") and shared <= t.smem_optin
