"""The fused gated-attention decode step (attn_step_kernel): Triton's interpreter against attn_step_ref on
copies of the caches (fresh random inputs, bf16 and fp32 caches; GQA groups of 1, 2, 3, 4 and 6 query
heads per kv head), and AOT compilation for every target at tiny shapes and at the real 27B shape with
the launch rule's constexprs. The interpreter runs the bf16 path with DOT_FP32 (its bf16 dots are
wrong): the same exact bf16 parts of q and of the weights, through fp32 dots."""
import json
import subprocess
import sys

import pytest
import torch

import triton
import triton.language as tl

from kernel_harness import assert_close, interpret
from kestrel.compiler.frontend import _parse_yarn
from kestrel.kernels.attention import (SMEM_OPTIN, _rope_cos_sin, _rope_inv_freq, attn_splits, attn_step_kernel,
                                       attn_step_launch, attn_step_ref, rope_inv_freq)
from kestrel.kernels.targets import TARGETS

EPS, THETA = 1e-6, 1e7


def yarn(rotary_dim: int, theta: float = THETA, **rope) -> list[float]:
    """YaRN's kernel parameters (ModelConfig.rope_yarn) for ``rope`` (default: factor 4 over 4096 positions, the
    ramp untruncated, so that some frequency indices blend)."""
    rope = {"factor": 4.0, "original_max_position_embeddings": 4096, "truncate": False} | rope
    return list(_parse_yarn(rope, {}, theta, rotary_dim, 16384, "test")["rope_yarn"])
SHAPES = [(4, 2, 32, 64), (2, 2, 16, 40), (8, 2, 64, 130)]  # (NH, NKV, D, S)
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-3}
CACHE = {torch.float32: "f32", torch.bfloat16: "bf16"}


def bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits (so NaN fillers compare equal to themselves)."""
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


def make_inputs(nh, nkv, d, s, pos, dtype, seed):
    """Random q|gate, k, v, norm weights; caches random in rows < pos, NaN from row pos on (the kernel
    must neither read rows past pos nor read row pos back from memory)."""
    g = torch.Generator().manual_seed(seed)
    qg = torch.randn(nh * 2 * d, generator=g)
    k, v = torch.randn(nkv * d, generator=g), torch.randn(nkv * d, generator=g)
    qn, kn = 0.1 * torch.randn(d, generator=g), 0.1 * torch.randn(d, generator=g)
    kc, vc = (torch.full((s, nkv, d), float("nan")).to(dtype) for _ in range(2))
    kc[:pos] = torch.randn(pos, nkv, d, generator=g).to(dtype)
    vc[:pos] = torch.randn(pos, nkv, d, generator=g).to(dtype)
    return qg, k, v, qn, kn, kc, vc


def run_kernel(qg, k, v, qn, kn, kc, vc, pos, rotary_dim, consts, grid):  # (YaRN: consts["YARN"])
    """One launch; the scratch (partials NaN-filled: every one read must have been written this launch,
    tickets zero) must come back with every ticket reset to zero."""
    out = torch.full((qg.numel() // 2,), float("nan"))
    d = kc.shape[2]
    nh, splits = consts["NH"], consts["SPLITS"]
    part = torch.full((nh, splits, d + 2), float("nan"))
    ticket = torch.zeros(nh, dtype=torch.int32)
    interpret(attn_step_kernel)[tuple(grid)](qg, k, v, qn, kn, kc, vc, torch.tensor([pos], dtype=torch.int32), part,
                                            ticket, out, EPS, THETA, rotary_dim, d ** -0.5, **consts)
    assert (ticket == 0).all(), "tickets not reset"
    return out


def check_step(nh, nkv, d, s, pos, rotary_dim, dtype, seed, block_s=None, splits=None, extra=None, yarn=None):
    inputs = make_inputs(nh, nkv, d, s, pos, dtype, seed)
    qg, k, v, qn, kn, kc, vc = inputs
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = attn_step_ref(qg, k, v, qn, kn, kc_ref, vc_ref, pos, EPS, THETA, rotary_dim, d ** -0.5, yarn)
    extra = {**(extra or {}), **({"YARN": yarn} if yarn else {})}
    c = attn_step_launch(nh, nkv, d, s, splits or attn_splits(nkv, s, TARGETS["sm_90"]), CACHE[dtype],
                         TARGETS["sm_90"])
    consts = dict(c["constexprs"], DOT_FP32=True, **({"BLOCK_S": block_s, "SPLIT_ROWS": block_s} if block_s else {}),
                  **(extra or {}))
    before_k, before_v = kc.clone(), vc.clone()
    out = run_kernel(*inputs, pos, rotary_dim, consts, c["grid"])
    what = f"attn_step {dtype} NH={nh} NKV={nkv} D={d} S={s} pos={pos} rotary_dim={rotary_dim}"
    assert_close(out, ref, TOL[dtype], 0.0, what)
    # row pos: v is stored exactly as the reference rounds it; roped k within an ulp of the cache dtype
    assert torch.equal(vc[pos], vc_ref[pos]), f"{what}: v row"
    assert_close(kc[pos], kc_ref[pos], 1e-5 if dtype == torch.float32 else 1e-2, 0.0, f"{what}: k row")
    others = torch.arange(s) != pos
    assert torch.equal(bits(kc[others]), bits(before_k[others])), f"{what}: k rows other than pos changed"
    assert torch.equal(bits(vc[others]), bits(before_v[others])), f"{what}: v rows other than pos changed"
    return (out - ref).abs().max().item() / ref.abs().max().item(), out


@triton.jit
def _rope_probe(pos_ptr, inv_ptr, cos_ptr, sin_ptr, theta, rotary_dim, BLOCK_D: tl.constexpr,
                YARN: tl.constexpr = None):
    """Program p: the RoPE helpers' lanes at position pos_ptr[p] (the inverse frequencies once, from program 0)."""
    p = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    if p == 0:
        tl.store(inv_ptr + d, _rope_inv_freq(d, theta, rotary_dim, BLOCK_D, YARN))
    cos, sin = _rope_cos_sin(tl.load(pos_ptr + p), d, theta, rotary_dim, BLOCK_D, YARN)
    tl.store(cos_ptr + p * BLOCK_D + d, cos)
    tl.store(sin_ptr + p * BLOCK_D + d, sin)


@pytest.mark.parametrize("rope", [None, {}, {"truncate": True}, {"factor": 8.0, "attention_factor": 1.25}],
                         ids=["default", "yarn", "yarn-truncated", "yarn-factor8"])
@pytest.mark.parametrize("theta,rotary_dim", [(THETA, 64), (1e4, 16), (1e6, 128)])
def test_rope_frequencies_are_the_references(rope, theta, rotary_dim):
    """The kernels' RoPE helpers in the interpreter: the inverse frequencies rope_inv_freq's within an ulp (YaRN's
    blended lanes included: the ramp holds at least one fractional index in every YaRN case here), cos and sin at
    positions up to a million (YaRN's reach at 262K x 4) those of the angles they give times the attention factor."""
    y = None if rope is None else yarn(rotary_dim, theta, **rope)
    ref = rope_inv_freq(theta, rotary_dim, y)
    if y:
        ramp = (torch.arange(rotary_dim // 2) - y[1]) / y[2]
        assert ((ramp > 0) & (ramp < 1)).any() or rope.get("truncate"), "no blended frequency: a weak case"
        assert not torch.equal(ref, rope_inv_freq(theta, rotary_dim)), "YaRN changed nothing"
    pos = torch.tensor([0, 1, 7, 4095, 4096, 262143, 1048575], dtype=torch.int32)
    block = triton.next_power_of_2(rotary_dim)
    inv, cos, sin = torch.zeros(block), torch.zeros(len(pos), block), torch.zeros(len(pos), block)
    interpret(_rope_probe)[(len(pos),)](pos, inv, cos, sin, theta, rotary_dim, BLOCK_D=block,
                                        **({"YARN": y} if y else {}))
    ulps = ((inv[:rotary_dim // 2] - ref).abs() / torch.finfo(torch.float32).eps / ref).max().item()
    assert ulps <= 1.0, f"{ulps} ulps"  # (the kernel's fp64 power and torch's fp32 one round apart in a few lanes)
    own = inv[:rotary_dim // 2]  # (the kernel's own frequencies: at a million positions an ulp of one shows)
    angle = pos.float()[:, None] * torch.cat([own, own])[None, :]
    scale = y[3] if y else 1.0
    assert_close(cos[:, :rotary_dim], angle.cos() * scale, 1e-6, 1e-6, "cos")
    assert_close(sin[:, :rotary_dim], angle.sin() * scale, 1e-6, 1e-6, "sin")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_attn_step_with_yarn(dtype):
    """attn_step_kernel with the YARN constexpr against attn_step_ref with the same YaRN parameters (and unlike the
    plain-RoPE reference: the constexpr is not ignored)."""
    y = yarn(16)
    for pos in (0, 33, 63):
        _, out = check_step(4, 2, 32, 64, pos, 16, dtype, seed=pos, yarn=y)
        if pos == 0:  # (one row: the output is its value, whatever the rotation)
            continue
        plain = attn_step_ref(*make_inputs(4, 2, 32, 64, pos, dtype, pos), pos, EPS, THETA, 16, 32 ** -0.5)
        assert (out - plain).abs().max() > 1e-2 * plain.abs().max(), f"pos {pos}: YaRN made no difference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attn_step_matches_reference(shape, dtype):
    nh, nkv, d, s = shape
    for rotary_dim in (d // 4, d // 2):
        for pos in (0, s // 2 + 1, s - 1):
            check_step(nh, nkv, d, s, pos, rotary_dim, dtype, seed=1000 * s + 10 * rotary_dim + pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_attn_step_many_tiles(dtype):
    """Small tiles: many loop iterations, a partial last tile, tile row slots that stay empty; with
    splits: several tiles per split, splits that stay empty at small pos, a single split."""
    for pos in (129, 100, 7):
        for splits in (1, 4):
            check_step(8, 2, 64, 130, pos, 32, dtype, seed=pos, block_s=16, splits=splits)
    # 8 splits of 2 tiles at pos 520: the last split has no rows left (its partial is empty)
    check_step(2, 1, 16, 600, 520, 8, dtype, seed=3, splits=8)
    # the combine at 7, 19 and 32 active splits of 32, three heads a group: the rule's one chunk a head (MERGE_CH =
    # SPLITS, no small path), and chunks of 16 with the small path at up to 8 (7: the small path; 19: a chunk of 3
    # after a full one; 32: two full chunks, rescaled to the running max)
    for pos in (100, 300, 520):
        for extra in (None, {"MERGE_CH": 16, "MERGE_SMALL": 8}):
            check_step(6, 2, 16, 600, pos, 8, dtype, seed=pos + 1, block_s=16, splits=32, extra=extra)


def split_rows(pos, block_s, splits):
    """The rows [lo, hi) of each active split, as attn_step_kernel derives them from pos."""
    active = max(min(-(-pos // block_s), splits), 1)
    chunk = -(-(-(-pos // active)) // block_s) * block_s
    return [(j * chunk, min((j + 1) * chunk, pos)) for j in range(active)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("nh,nkv", [(24, 4), (6, 2)], ids=["rep6", "rep3"])
def test_attn_step_gqa_groups(nh, nkv, dtype):
    """One program takes all the query heads of a kv head: REP = 6 (27B's 24 / 4; the bf16 path's
    16-row tile has 10 padded rows) and REP = 3 (odd: padded with bf16 and with fp32 caches alike), 16-row
    tiles and 8 splits, at positions from row p alone (0) through one partial tile, a full one, splits
    left without rows (129, 130, and S - 1: chunks of 32 rows leave the last active splits empty), to
    the cache's last row. Every head of every group must match the reference, row p be stored once."""
    d, s, block_s, splits = 32, 200, 16, 8
    positions = (0, 1, 16, 17, 129, 130, s - 1)
    assert sum(lo >= hi for p in positions for lo, hi in split_rows(p, block_s, splits)) >= 6  # empty splits
    for pos in positions:
        check_step(nh, nkv, d, s, pos, d // 4 if pos % 2 else d // 2, dtype, seed=100 * nh + pos, block_s=block_s,
                   splits=splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_attn_step_query_rows(dtype):
    """The queries normed and roped as BLOCK_Q = REP rounded up rows (the rule, ``attention.narrow_queries``) and
    repeated to the tile's BLOCK_H, or as all BLOCK_H rows: both match the reference, with one split (the narrow
    epilogue) and with several (the merge), at REP = 3 (a padded group) and 6."""
    for nh, nkv in ((6, 2), (24, 4)):
        block_h = attn_step_launch(nh, nkv, 32, 200, 8, CACHE[dtype], TARGETS["sm_90"])["constexprs"]["BLOCK_H"]
        for pos in (0, 17, 130):
            for block_q in sorted({block_h, 1 << (nh // nkv - 1).bit_length()}):
                check_step(nh, nkv, 32, 200, pos, 8, dtype, seed=pos + nh, block_s=16, splits=8,
                           extra={"BLOCK_Q": block_q})


def test_attn_step_clamps_pos():
    """pos past the cache end behaves as S - 1: nothing outside the cache is read or written."""
    nh, nkv, d, s = 4, 2, 32, 40
    qg, k, v, qn, kn, kc, vc = make_inputs(nh, nkv, d, s, s - 1, torch.float32, seed=5)
    guard = 3  # rows after the cache inside the same allocation, which must stay untouched
    kbuf, vbuf = torch.full((s + guard, nkv, d), 7.0), torch.full((s + guard, nkv, d), 7.0)
    kbuf[:s], vbuf[:s] = kc, vc
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = attn_step_ref(qg, k, v, qn, kn, kc_ref, vc_ref, s - 1, EPS, THETA, d // 2, d ** -0.5)
    c = attn_step_launch(nh, nkv, d, s, 2, "f32", TARGETS["sm_90"])
    out = run_kernel(qg, k, v, qn, kn, kbuf[:s], vbuf[:s], s + 5, d // 2, dict(c["constexprs"], DOT_FP32=True),
                     c["grid"])
    assert_close(out, ref, 1e-4, 0.0, "attn_step pos > S - 1")
    assert torch.equal(kbuf[:s - 1], kc_ref[:s - 1]) and torch.equal(vbuf[:s], vc_ref)
    assert_close(kbuf[s - 1], kc_ref[s - 1], 1e-5, 0.0, "attn_step pos > S - 1: k row S - 1")
    assert (kbuf[s:] == 7.0).all() and (vbuf[s:] == 7.0).all()


def test_launch_rule():
    for t in TARGETS.values():
        c = attn_step_launch(24, 4, 256, 4096, attn_splits(4, 4096, t), "bf16", t)
        assert c["grid"] == [4, 32, 1]  # 128 programs at 27B
        assert {"NH", "NKV", "D", "S", "SPLITS", "BLOCK_D", "BLOCK_S"} <= set(c["constexprs"])
        assert c["constexprs"]["PIPE_BYTES"] + 16 * 1024 <= SMEM_OPTIN[t.cc]


# --- AOT compilation: one clean subprocess per cache dtype compiles every (shape, target) job (the test
# suite runs Triton in interpreter mode; one process instead of one per job keeps this fast).
_COMPILE_ALL = r"""
import json, sys
from kestrel.compiler.codegen import compile_kernel
res = []
for kid, types, consts, nw, cc in json.loads(sys.stdin.read()):
    k = compile_kernel(kid, "kestrel.kernels.attention:attn_step_kernel", types, consts, nw, cc, aligned=[t.startswith("*") for t in types])
    res.append({"elf": k.cubin[:4] == b"\x7fELF", "name": k.name, "arch": k.arch, "shared": k.shared,
                "num_warps": k.num_warps})
print(json.dumps(res))
"""
AOT_SHAPES = [(24, 4, 256, 4096)]  # 27B's (REP 6), on every target: its splits and pipeline bytes are the target's
# REP 2, 1, 3 at other head widths and contexts (bf16 caches, the plans' own), and 27B's shape with YaRN, on the two
# families of tensor-core code (Ampere's mma, Hopper's): attn_step compiles take ~5 s each
AOT_SMALL_SHAPES = [(4, 2, 32, 64), (2, 2, 16, 40), (6, 2, 64, 256)]
AOT_SMALL_TARGETS = ("sm_80", "sm_90")
PTR = {"bf16": "*bf16", "f32": "*fp32"}


def aot_jobs(dt):
    types = ["*fp32"] * 5 + [PTR[dt]] * 2 + ["*i32", "*fp32", "*i32", "*fp32"] + ["fp32", "fp32", "i32", "fp32"]
    pairs = [(shape, t) for shape in AOT_SHAPES for t in TARGETS.values()]
    if dt == "bf16":
        pairs += [(shape, TARGETS[name]) for shape in AOT_SMALL_SHAPES for name in AOT_SMALL_TARGETS]
    launches = [attn_step_launch(*shape, attn_splits(shape[1], shape[3], t), dt, t) for shape, t in pairs]
    ccs = [t.cc for _, t in pairs]
    for t in (TARGETS[name] for name in AOT_SMALL_TARGETS):  # 27B's shape with YaRN (Qwen's settings on its
        # quarter-rotated head)
        c = attn_step_launch(24, 4, 256, 4096, attn_splits(4, 4096, t), dt, t)
        launches.append(c | {"constexprs": c["constexprs"] | {"YARN": yarn(64, 1e7, factor=4.0, truncate=True,
                                                                             original_max_position_embeddings=262144)}})
        ccs.append(t.cc)
    return [(f"attn_step_{dt}", types, c["constexprs"], c["num_warps"], cc) for c, cc in zip(launches, ccs)]


@pytest.fixture(scope="module")
def aot_results():
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {dt: subprocess.Popen([sys.executable, "-c", _COMPILE_ALL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for dt in PTR}
    results = {}
    for dt, p in procs.items():
        out, err = p.communicate(json.dumps(aot_jobs(dt)), timeout=600)
        results[dt] = (p.returncode, out, err)
    return results


@pytest.mark.parametrize("dt", list(PTR))
def test_aot_compiles_for_every_target(aot_results, dt):
    rc, out, err = aot_results[dt]
    assert rc == 0, f"AOT compile of attn_step_{dt} failed:\n{err[-3000:]}"
    res = json.loads(out.strip().splitlines()[-1])
    for (kid, types, consts, nw, cc), r in zip(aot_jobs(dt), res):
        assert r["elf"] and r["name"] and r["num_warps"] == nw, (kid, cc)
        assert r["arch"] == f"sm_{cc}{'a' if cc >= 90 else ''}"
        assert r["shared"] <= SMEM_OPTIN[cc], f"{kid} D={consts['D']} sm_{cc}: {r['shared']} B of shared memory"
