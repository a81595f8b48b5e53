"""Matrix-vector kernels (matvec, matvec_swiglu): Triton's interpreter against the torch references for
f32, bf16 and q4 weights (groups 32, 64, 128), with shapes that are not multiples of the blocks; the
launch rule at the real Qwen3.5-27B shapes; AOT compilation for every target (one subprocess, since the
suite runs with TRITON_INTERPRET=1), and a PTX check that aligned weights are read with 16-byte loads."""
import dataclasses
import json
import math
import os

import pytest
import torch

from kernel_harness import assert_close, interpret, run_aot_main
from kestrel.kernels.matvec import (matvec_kernel, matvec_launch, matvec_ref, matvec_swiglu_kernel,
                                    matvec_swiglu_ref, q4_pack, q4_unpack)
from kestrel.kernels.targets import TARGETS

RTOL = 1e-5  # of max |ref|: fp32 accumulation of the same (dequantised) fp32 values in another order


def make_weight(kind: str, n: int, k: int, g: torch.Generator):
    """(the kernel's weight argument, its fp32 values for the reference, GROUP)."""
    w = torch.randn(n, k, generator=g)
    if kind == "f32":
        return w, w, 0
    if kind == "bf16":
        wb = w.to(torch.bfloat16)
        return wb, wb.float(), 0
    group = int(kind[3:])  # "q4g64"
    buf = q4_pack(w, group)
    return buf, q4_unpack(buf, n, k, group), group


def with_tiles(c: dict, override: dict | None) -> dict:
    """Launch constexprs ``c`` with ``override``; TOGETHER (q4 in one tile) follows an overridden BLOCK_K unless the
    override sets it too."""
    c = dict(c) | (override or {})
    if "TOGETHER" not in (override or {}):
        c["TOGETHER"] = c["TOGETHER"] and c["K"] == c["BLOCK_K"]
    return c


def consts_for(n: int, k: int, group: int, override: dict | None) -> dict:
    """The sm_90 launch rule's constexprs with ``override`` (``with_tiles``)."""
    return with_tiles(matvec_launch(n, k, group, TARGETS["sm_90"])["constexprs"], override)


# (weight kind, N, K, constexpr overrides): the launch rule's blocks, and smaller blocks so that the
# interpreter covers several K tiles, a masked K tail and clamped rows past N in one program.
MATVEC_CASES = [
    ("f32", 40, 300, None),                                 # rule: 1 row per CTA, one masked 512 tile
    ("f32", 37, 1000, {"BLOCK_N": 8, "BLOCK_K": 128}),      # 7 tiles + masked tail, rows 37..39 clamped
    ("bf16", 30, 300, None),
    ("bf16", 100, 300, {"BLOCK_N": 16, "BLOCK_K": 128}),
    ("bf16", 24, 1024, {"BLOCK_N": 16}),                    # two full 512 tiles
    ("bf16", 5, 4, None),                                   # K below one 16-byte chunk
    ("f32", 3, 2, None),                                    # K = 2
    ("q4g32", 24, 256, None),
    ("q4g32", 21, 96, {"BLOCK_N": 8, "BLOCK_K": 32}),       # three one-group tiles
    ("q4g64", 37, 192, None),                               # rule: one masked 256 tile
    ("q4g64", 37, 192, {"BLOCK_N": 8, "BLOCK_K": 64}),
    ("q4g64", 37, 192, {"BLOCK_N": 16, "BLOCK_K": 128}),    # one tile + masked half tile
    ("q4g128", 19, 640, {"BLOCK_N": 4, "BLOCK_K": 256}),    # two tiles + masked half tile
    ("q4g128", 20, 1024, {"BLOCK_N": 16}),                  # rule's 1024 block, one full tile
    ("q4g128", 6, 384, None),                               # rule: one masked 512 tile, 1 row per CTA
    ("q4g128", 10, 1152, {"BLOCK_N": 8, "BLOCK_K": 512}),   # two tiles + a masked quarter tile
]


@pytest.mark.parametrize("kind,n,k,override", MATVEC_CASES)
def test_matvec_interpreter(kind, n, k, override):
    g = torch.Generator().manual_seed(n * 7919 + k)
    warg, wref, group = make_weight(kind, n, k, g)
    x = torch.randn(k, generator=g)
    c = consts_for(n, k, group, override)
    y = torch.full((n + 16,), float("nan"))  # 16 sentinels: rows past N must not be stored
    interpret(matvec_kernel)[(math.ceil(n / c["BLOCK_N"]),)](x, warg, y, **c)
    assert torch.isnan(y[n:]).all(), "stored past N"
    assert_close(y[:n], matvec_ref(x, wref), RTOL, 0.0, f"matvec {kind} {n}x{k} {c}")


SWIGLU_CASES = [
    ("f32", 45, 320, {"BLOCK_N": 8, "BLOCK_K": 128}),
    ("bf16", 100, 300, {"BLOCK_N": 16, "BLOCK_K": 128}),
    ("bf16", 30, 512, None),
    ("q4g32", 12, 96, None),
    ("q4g64", 37, 192, {"BLOCK_N": 8, "BLOCK_K": 128}),
    ("q4g128", 37, 384, {"BLOCK_N": 8, "BLOCK_K": 256}),
    ("q4g128", 10, 1152, {"BLOCK_N": 8, "BLOCK_K": 512}),  # the pair's one loop, then its masked tile
]


@pytest.mark.parametrize("kind,n,k,override", SWIGLU_CASES)
def test_matvec_swiglu_interpreter(kind, n, k, override):
    g = torch.Generator().manual_seed(n * 104729 + k)
    wg, wg_ref, group = make_weight(kind, n, k, g)
    wu, wu_ref, _ = make_weight(kind, n, k, g)
    x = torch.randn(k, generator=g)
    c = consts_for(n, k, group, override)
    y = torch.full((n + 16,), float("nan"))
    interpret(matvec_swiglu_kernel)[(math.ceil(n / c["BLOCK_N"]),)](x, wg, wu, y, **c)
    assert torch.isnan(y[n:]).all(), "stored past N"
    ref = matvec_swiglu_ref(x, wg_ref, wu_ref)
    # |silu(g) * u| <= |g| |u|: bound the error by the products' magnitudes, not by max |y| alone
    scale = (matvec_ref(x, wg_ref).abs() * matvec_ref(x, wu_ref).abs()).max().item()
    assert_close(y[:n], ref, 0.0, RTOL * scale, f"swiglu {kind} {n}x{k} {c}")


# --- launch rule at the real shapes --------------------------------------------------------------

# Qwen3.5-27B: lm_head, down_proj, gate/up (each), fused GDN input projection
REAL_SHAPES = {"lm_head": (248320, 5120), "down_proj": (5120, 17408), "gate_up": (17408, 5120),
               "gdn_in_proj": (16640, 5120)}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("group", [0, 128])
def test_launch_rule_real_shapes(target, group):
    t = TARGETS[target]
    for name, (n, k) in REAL_SHAPES.items():
        c = matvec_launch(n, k, group, t)
        e = c["constexprs"]
        assert set(e) == {"N", "K", "GROUP", "BLOCK_N", "BLOCK_K", "PDL_LATE", "PRELOAD", "L2_PREFETCH", "PAIR_FMA",
                          "TOGETHER"}
        assert not e["L2_PREFETCH"]  # (27B matrices: larger than the rule's l2_prefetch_bytes)
        assert (e["N"], e["K"], e["GROUP"]) == (n, k, group)
        assert c["grid"] == [math.ceil(n / e["BLOCK_N"]), 1, 1]
        assert c["grid"][0] >= 2 * t.sms, f"{name}: {c['grid'][0]} CTAs for {t.sms} SMs"
        if group:  # many rows: 16 x 512 tiles dividing K, one warp; down_proj: 8 x 2048 (a masked tail), 4 warps
            if name == "down_proj":
                assert (e["BLOCK_N"], e["BLOCK_K"], c["num_warps"]) == (8, 2048, 4)
            else:
                assert (e["BLOCK_N"], e["BLOCK_K"], c["num_warps"]) == (16, 512, 1) and k % 512 == 0
        else:
            assert e["BLOCK_K"] == 512 and k % e["BLOCK_K"] == 0  # no masked tail
            assert c["num_warps"] == max(1, e["BLOCK_N"] // 4)


def test_launch_rule_small_and_odd_shapes():
    t = TARGETS["sm_90"]
    for n, k, group in [(37, 192, 64), (100, 300, 0), (1024, 3584, 128), (20, 96, 32), (8, 32, 32), (3, 5, 0)]:
        e = matvec_launch(n, k, group, t)["constexprs"]
        bk = e["BLOCK_K"]
        assert bk & (bk - 1) == 0 and e["BLOCK_N"] & (e["BLOCK_N"] - 1) == 0
        if group:
            assert bk >= group and bk % group == 0
    assert matvec_launch(1024, 3584, 0, t)["constexprs"]["BLOCK_K"] == 2048  # small bf16: a full tile + masked tail
    assert matvec_launch(5120, 17408, 0, t)["constexprs"]["BLOCK_K"] == 512  # large bf16: divides K, no tail
    assert matvec_launch(5120, 17408, 128, t)["constexprs"]["BLOCK_K"] == 2048  # q4, few rows: 8 tiles + masked tail
    assert matvec_launch(1024, 3584, 128, t)["constexprs"]["BLOCK_K"] == 1024  # (3 tiles + masked tail)
    assert matvec_launch(248320, 4480, 128, t)["constexprs"]["BLOCK_K"] == 128  # q4, many rows: divides K
    assert matvec_launch(17408, 5120, 128, t, pair=True)["num_warps"] == 2  # the swiglu pair: 2 warps


def test_l2_prefetch_rule():
    """L2_PREFETCH: q4 matrices up to matvec.l2_prefetch_bytes (4.5 MiB: every 0.8B matrix, the 2B / 80B-A3B
    output projections) on sm_90 and later; never bf16, never before sm_90, none with the field at 0."""
    t = TARGETS["sm_90"]

    def pf(n, k, group, target=t):
        return matvec_launch(n, k, group, target)["constexprs"]["L2_PREFETCH"]
    assert pf(8224, 1024, 128) and pf(1024, 3584, 128) and pf(2048, 4096, 128)  # 4 MiB
    assert not pf(6144, 2048, 128) and not pf(5120, 6144, 128)  # 6 MiB; the 27B output projection
    assert not pf(1024, 2048, 0)
    assert not pf(1024, 2048, 128, TARGETS["sm_80"]) and pf(1024, 2048, 128, TARGETS["sm_120"])
    rules = dict(t.rules)
    rules["matvec"] = dataclasses.replace(rules["matvec"], l2_prefetch_bytes=0)
    assert not pf(1024, 2048, 128, dataclasses.replace(t, rules=rules))


# --- AOT compilation -----------------------------------------------------------------------------

def _kernel_id(fused: bool, group: int, wt: str = "*bf16") -> str:
    dtype = f"q4g{group}" if group else {"*bf16": "bf16", "*fp32": "f32"}[wt]
    return ("matvec_swiglu_" if fused else "matvec_") + dtype


# small shapes whose launch leaves a masked K tile: (weight type, N, K, GROUP)
ODD_SHAPES = {"q4g64_tail": ("*u8", 37, 192, 64), "bf16_tail": ("*bf16", 100, 300, 0),
              "f32_loop_tail": ("*fp32", 37, 1000, 0), "bf16_tiny": ("*bf16", 5, 4, 0)}


def _aot_jobs():
    """One compile per (target, kernel, real shape), with that target's launch rule (as select_kernels
    does; sm_120's 170 SMs give down_proj 4 rows per CTA, the others 8). matvec_swiglu only at the
    gate/up shape, the only one where the fuse pass creates it. Real shapes have no masked K tail, so
    the odd shapes (masked tile alone, after the loop, tiny K) go to sm_90."""
    jobs = []
    for target in TARGETS:
        for group in (0, 128):
            jobs += [(target, False, group, shape) for shape in REAL_SHAPES]
            jobs.append((target, True, group, "gate_up"))
    for shape, (_, _, _, group) in ODD_SHAPES.items():
        jobs += [("sm_90", False, group, shape), ("sm_90", True, group, shape)]
    return jobs


def _compile_job(job):
    from kestrel.compiler.codegen import compile_kernel

    target, fused, group, shape = job
    wt, n, k, _ = ODD_SHAPES.get(shape, ("*u8" if group else "*bf16",) + REAL_SHAPES.get(shape, ()) + (group,))
    c = matvec_launch(n, k, group, TARGETS[target])
    types = ["*fp32"] + [wt] * (2 if fused else 1) + ["*fp32"]
    ck = compile_kernel(_kernel_id(fused, group, wt), matvec_swiglu_kernel if fused else matvec_kernel, types, c["constexprs"], c["num_warps"], TARGETS[target].cc,
                        aligned=[True] * len(types))
    return {"job": list(job), "name": ck.name, "cubin": len(ck.cubin), "shared": ck.shared, "wt": wt,
            "num_warps": ck.num_warps, "arch": ck.arch, "params": [t for _, t in ck.params]}


def _ptx_job(job):
    """PTX of matvec at the lm_head shape for sm_90, compiled as compile_kernel does."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    group, aligned, *shape = job
    n, k = SMALL_Q4 if shape else REAL_SHAPES["lm_head"]
    c = matvec_launch(n, k, group, TARGETS["sm_90"])
    c["constexprs"]["PDL"] = True  # as codegen compiles it for sm_90
    names = ["x_ptr", "w_ptr", "y_ptr"]
    types = ["*fp32", "*u8" if group else "*bf16", "*fp32"]
    attrs = {(matvec_kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in names} if aligned else {}
    src = ASTSource(fn=matvec_kernel, signature=dict(zip(names, types)) | {a: "constexpr" for a in c["constexprs"]},
                    constexprs=dict(c["constexprs"]), attrs=attrs)
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": c["num_warps"]})
    return {"job": list(job), "ptx": ck.asm["ptx"]}


def _aot_main():
    """Subprocess entry (TRITON_INTERPRET unset): run every job on a small process pool, print JSON."""
    import multiprocessing

    compiles, ptx = _aot_jobs(), [(0, True), (128, True), (0, False), (128, True, "small")]
    with multiprocessing.get_context("fork").Pool(max(1, min(4, len(os.sched_getaffinity(0))))) as pool:
        a = pool.map_async(_compile_job, compiles, chunksize=1)
        b = pool.map_async(_ptx_job, ptx, chunksize=1)
        out = {"compiled": a.get(), "ptx": b.get()}
    print(json.dumps(out))


@pytest.fixture(scope="module")
def aot():
    out = run_aot_main("test_kernels_matvec")
    return {tuple(d["job"]): d for d in out["compiled"]}, {tuple(d["job"]): d["ptx"] for d in out["ptx"]}


def _job_id(job) -> str:
    target, fused, group, shape = job
    dtype = "" if shape in ODD_SHAPES else ("-q4g%d" % group if group else "-bf16")
    return f"{target}-{'matvec_swiglu' if fused else 'matvec'}{dtype}-{shape}"


@pytest.mark.parametrize("job", _aot_jobs(), ids=_job_id)
def test_aot_compile(aot, job):
    d = aot[0][job]
    target, fused, group, _ = job
    assert d["cubin"] > 0 and d["name"].startswith("matvec_swiglu_kernel" if fused else "matvec_kernel")
    assert d["params"] == ["*fp32"] + [d["wt"]] * (2 if fused else 1) + ["*fp32"]
    assert d["arch"] == f"sm_{TARGETS[target].cc}" + ("a" if TARGETS[target].cc >= 90 else "")
    assert d["shared"] <= 99 * 1024, "pipeline buffers must fit the 99 KB of sm_86/89/120 CTAs"


def _wide_loads(ptx: str) -> int:
    """16-byte global reads: ld.global ... .v4 (32-bit lanes) or cp.async of 16 bytes (the software
    pipeline's global -> shared copies)."""
    lines = ptx.splitlines()
    return sum(1 for ln in lines if ("ld.global" in ln and ".v4" in ln and (".b32" in ln or ".f32" in ln))
               or ("cp.async" in ln and ".global" in ln and ", 0x10," in ln))


@pytest.mark.parametrize("group", [0, 128])
def test_aligned_pointers_give_16_byte_loads(aot, group):
    ptx = aot[1][(group, True)]
    assert _wide_loads(ptx) > 0, "no 16-byte global loads in the sm_90 PTX"
    assert "cp.async.ca.shared.global" not in ptx  # no 4/8-byte copies for the weight or x


def test_unaligned_pointers_give_narrow_loads(aot):
    """The check above is not vacuous: without the 16-byte alignment hint Triton cannot vectorise."""
    assert _wide_loads(aot[1][(0, False)]) == 0


SMALL_Q4 = (1024, 2048)  # the 0.8B output projection: under matvec.l2_prefetch_bytes


def test_small_q4_matrix_asks_the_l2_for_its_rows_before_its_wait(aot):
    """L2_PREFETCH in the sm_90 PTX: two bulk L2 prefetches (the program's codes, then its scales) before the PDL
    wait; none at the lm_head shape (above the rule's bytes)."""
    lines = aot[1][(128, True, "small")].splitlines()
    pf = [i for i, ln in enumerate(lines) if "cp.async.bulk.prefetch.L2.global" in ln]
    wait = next(i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln)
    assert len(pf) == 2 and max(pf) < wait
    assert "cp.async.bulk.prefetch" not in aot[1][(128, True)]


def test_q4_product_range():
    """The q4 product's documented range (kernels/matvec.py): x / 64 in fp16 lanes keeps every lane finite
    for |x| < 2^17 (the reference emulates the lanes: finite there, within the fp16 lanes' error of the fp32
    product), and overflows past it (inf / NaN), the known limit the README names."""
    g = torch.Generator().manual_seed(5)
    n, k, group = 24, 256, 64
    buf = q4_pack(torch.randn(n, k, generator=g), group)
    w = q4_unpack(buf, n, k, group)
    x = torch.rand(k, generator=g) * 2 - 1
    x = x / x.abs().max() * (2 ** 17 / 8.5)  # a lane's four products stay below 2^16
    ref = matvec_ref(x, w)
    exact = torch.mv(w.double(), x.double()).float()
    assert torch.isfinite(ref).all() and (ref - exact).abs().max() <= 2e-3 * exact.abs().max()
    assert not torch.isfinite(matvec_ref(x * 64, w)).all()


@pytest.mark.parametrize("threads", [1, 2, 6])
def test_q4_reference_row_blocks_are_the_rows_products(threads):
    """q4_matvec_ref works in blocks of rows (q4_ref_rows: Q4_REF_ROWS for every two of torch's threads, so its
    float64 temporaries stay in cache): each row's result is that row's product alone, across block boundaries
    and in a last partial block, at any thread count."""
    from kestrel.kernels.matvec import Q4_REF_ROWS, q4_codes, q4_matvec_ref, q4_ref_rows

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = q4_ref_rows()
        assert block == Q4_REF_ROWS * max(1, threads // 2)
        g = torch.Generator().manual_seed(11)
        n, k, group = 2 * block + 5, 256, 32
        q, scales = q4_codes(q4_pack(torch.randn(n, k, generator=g), group), n, k, group)
        x = torch.randn(k, generator=g) * 3
        y = q4_matvec_ref(x, q, scales, group)
        rows = [0, block - 1, block, 2 * block - 1, 2 * block, n - 1]
        one = torch.cat([q4_matvec_ref(x, q[r:r + 1], scales[r:r + 1], group) for r in rows])
    finally:
        torch.set_num_threads(before)
    assert y.shape == (n,) and y.dtype == torch.float32 and torch.equal(y[rows], one)


@pytest.mark.parametrize("band_rows", [1, 5, 1000])
def test_q4_codes_are_the_quantised_codes(monkeypatch, band_rows):
    """q4_codes (bytes, a band of rows at a time) gives back q4_quantize's codes - 8 and scales from the packed
    layout: each nibble found through Q4_NIBBLE, whatever the band."""
    from kestrel.kernels import matvec
    from kestrel.kernels.matvec import q4_codes, q4_quantize

    n, k, group = 13, 256, 64
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(9))
    q, scales = q4_quantize(w, group)
    monkeypatch.setattr(matvec, "Q4_CODES_BAND", band_rows * k)
    got_q, got_s = q4_codes(q4_pack(w, group), n, k, group)
    assert got_q.dtype == torch.int8 and torch.equal(got_q, (q.to(torch.int16) - 8).to(torch.int8))
    assert torch.equal(got_s, scales.float())


def _q4_quantize_spec(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantisation rule as kernels/matvec.py states it, every candidate's codes kept: for each group, of the
    scales m / c the first with the least squared error, its codes q = clamp(round(w / d) + 8, 0, 15), then d
    refitted by least squares for them."""
    from kestrel.kernels.matvec import Q4_SCALE_CANDIDATES

    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    m = torch.gather(g, -1, g.abs().argmax(dim=-1, keepdim=True))
    best_q, best_err = None, None
    for c in Q4_SCALE_CANDIDATES:
        d = m / c
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = torch.clamp(torch.round(g * inv) + 8, 0, 15)
        err = ((q - 8) * d - g).pow(2).sum(-1, keepdim=True)
        if best_q is None:
            best_q, best_err = q, err
        else:
            better = err < best_err
            best_q, best_err = torch.where(better, q, best_q), torch.minimum(err, best_err)
    qs = best_q - 8
    den = qs.pow(2).sum(-1, keepdim=True)
    d = torch.where(den > 0, (g * qs).sum(-1, keepdim=True) / den.clamp_min(1), torch.zeros_like(den))
    return best_q.to(torch.uint8).reshape(n, k), d.to(torch.float16).reshape(n, k // group)


@pytest.mark.parametrize("n, k, group", [(40, 256, 128), (33, 96, 32), (9, 192, 64)])
def test_q4_quantize_is_the_stated_rule(n, k, group):
    """q4_quantize (errors in one reused buffer, the best candidate's codes made once at the end) gives the bytes
    of the rule kept candidate by candidate, on gaussian rows and on the groups where the choice is delicate: all
    zero, subnormal, integer-valued (ties between candidates), an infinity, values near fp32's range."""
    from kestrel.kernels.matvec import q4_quantize

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    w[0, :group] = 0
    w[1, :group] = 1e-44
    w[2, :group] = torch.round(torch.randn(group, generator=torch.Generator().manual_seed(1)) * 4)
    w[3, 5] = float("inf")
    w[4] *= 1e30
    w[5] = torch.randint(-3, 4, (k,), generator=torch.Generator().manual_seed(2)).float() * 0.5
    q, scales = q4_quantize(w, group)
    want_q, want_s = _q4_quantize_spec(w, group)
    assert torch.equal(q, want_q) and torch.equal(scales.view(torch.int16), want_s.view(torch.int16))


def test_q4_bands_are_the_whole_matrix(monkeypatch):
    """The build quantises a matrix a band of rows at a time (compiler/weights.py): the same bytes as whole."""
    from kestrel.compiler import weights

    w = torch.randn(37, 256, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(weights, "Q4_BAND_ELEMENTS", 5 * 256)
    assert torch.equal(weights._q4_pack_bands(w, 64), q4_pack(w, 64))
