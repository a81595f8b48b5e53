"""The M-row (prefill) gated attention kernels, attn_rows_kv_kernel then attn_rows_q_kernel: Triton's
interpreter against attn_rows_kv_ref / attn_rows_q_ref (and the two chained against attn_rows_ref) at
small shapes, AOT compilation for every GPU target at the 27B head shape, and the launch rules.

Numerics. The kv kernel rounds as the reference does (v exact, roped k within an ulp of the cache
dtype). The q kernel feeds the tensor cores bf16 operands: q * scale * log2(e) and the softmax weights
p rounded to bf16 (unit roundoff u = 2^-9), and K, V too where the caches are fp32 (bf16 caches hold
them exactly). The interpreter computes bf16 dots wrongly, so the tests run it with DOT_FP32, which
feeds the dots the same bf16-rounded values as fp32: only those roundings (and fp32 summation order)
separate kernel and reference. Per output element the test checks the bound they imply
(``rounding_bound``): with Δ = n_qk * u * scale * max_j sum_i |q_i k_ji| (n_qk = 1 rounded operand in
q . k, 2 with fp32 caches) every score moves by at most Δ, so every softmax weight by at most a factor
e^{±2Δ}; the bf16 weights in P V (and, with fp32 caches, bf16 V) add u * sum_j w_j |v_j| each:
  |o - o_ref| <= ((e^{2Δ} - 1) max_j |v_j| + n_pv * u * sum_j w_j |v_j|) * sigmoid(gate) + 1e-5.
That worst case is ~3-7 % of max|out| on these inputs (D = 16..32). Roundings of random sign mostly
cancel: over 60 cases the errors stay below a fifth of the bound and at most ~2u (bf16 caches) / ~3u
(fp32 caches) of max|out|, which RTOL (4u / 8u) checks as well.
"""
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from kernel_harness import assert_close, interpret
from kestrel.kernels.attention import (attn_rows_kv_kernel, attn_rows_kv_launch, attn_rows_kv_ref, attn_rows_q_kernel,
                                       attn_rows_q_launch, attn_rows_q_ref, attn_rows_ref, attn_rows_scratch,
                                       attn_rows_step_kernel, attn_rows_step_launch, attn_splits, attn_step_kernel,
                                       attn_step_launch, rope_ref)
from kestrel.kernels.rmsnorm import rmsnorm_ref
from kestrel.kernels.targets import GPU_TARGETS, TARGETS
from test_kernels_attention import yarn

EPS, THETA, U = 1e-6, 1e7, 2.0 ** -9
SM90 = TARGETS["sm_90"]
RTOL = {torch.bfloat16: 4 * U, torch.float32: 8 * U}  # max error / max |out| (module docstring)
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])


def bits(x):
    """The raw bits (so NaN fillers compare equal to themselves)."""
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


def layout(nh, nkv, d):
    """Column offsets q, k, v of the q|gate, key and value blocks in a projection row, and its width
    (gaps around the blocks, so a wrong offset reads the wrong numbers)."""
    q = 3
    k = q + nh * 2 * d + 2
    v = k + nkv * d + 1
    return q, k, v, v + nkv * d + 4


def make_inputs(nh, nkv, d, m, s, pos, dtype, seed):
    """x [M, W] random; norm weights; caches random in rows < pos, NaN from row pos on (the kernels
    must read no cache row past the chunk's valid ones)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, layout(nh, nkv, d)[3], generator=g)
    qn, kn = 0.1 * torch.randn(d, generator=g), 0.1 * torch.randn(d, generator=g)
    kc, vc = (torch.full((s, nkv, d), float("nan")).to(dtype) for _ in range(2))
    kc[:pos] = torch.randn(pos, nkv, d, generator=g).to(dtype)
    vc[:pos] = torch.randn(pos, nkv, d, generator=g).to(dtype)
    return x, qn, kn, kc, vc


def dyn(n):
    return torch.tensor([n], dtype=torch.int32)


def run_kv(x, kn, kc, vc, pos, n_prompt, nh, rd, yarn=None):
    m, w = x.shape
    s, nkv, d = kc.shape
    _, ko, vo, _ = layout(nh, nkv, d)
    c = attn_rows_kv_launch(m, w, nkv, d, s, "bf16" if kc.dtype == torch.bfloat16 else "f32", SM90)
    interpret(attn_rows_kv_kernel)[tuple(c["grid"])](x, kn, kc, vc, dyn(pos), dyn(n_prompt), ko, vo, EPS, THETA, rd,
                                                     **c["constexprs"], **({"YARN": yarn} if yarn else {}))


def run_q(x, qn, kc, vc, pos, n_prompt, nh, rd, block_r=None, block_n=None, splits=None, split_rows=None,
          scratch=None, yarn=None):
    """The q kernel with the sm_90 rule's constants (BLOCK_R / BLOCK_N overridable: small tiles give
    many blocks and tiles; the interpreter accepts dots the compiler would not; SPLITS / SPLIT_ROWS too: the
    sequence split and its merge) and DOT_FP32. Checks the tickets are left zero."""
    m, w = x.shape
    s, nkv, d = kc.shape
    c = attn_rows_q_launch(m, w, nh, nkv, d, s, SM90)
    consts = dict(c["constexprs"], DOT_FP32=True, **({"YARN": yarn} if yarn else {}))
    grid = list(c["grid"])
    if block_r:
        consts["BLOCK_R"], grid[1] = block_r, -(-m * (nh // nkv) // block_r)
    if block_n:
        consts["BLOCK_N"] = block_n
    if splits:
        consts["SPLITS"], grid[2] = splits, splits
    if split_rows:
        consts["SPLIT_ROWS"] = split_rows
    part_shape, ticket_shape = attn_rows_scratch({"grid": grid, "constexprs": consts}, d)
    part, tickets = torch.full(part_shape, float("nan")), torch.zeros(ticket_shape, dtype=torch.int32)
    out = torch.full((m, nh * d), float("nan"))
    interpret(attn_rows_q_kernel)[tuple(grid)](x, qn, kc, vc, dyn(pos), dyn(n_prompt), part, tickets, out,
                                               layout(nh, nkv, d)[0], nh, EPS, THETA, rd, d ** -0.5, **consts)
    assert (tickets == 0).all(), "a ticket left non-zero"
    if scratch is not None:
        scratch["part"] = part
    return out


def rounding_bound(x, qn, kc, vc, pos, n_valid, nh, rd):
    """Per output element, the bound of the module docstring on |kernel - attn_rows_q_ref| (kernel with
    DOT_FP32), for caches holding the chunk's rows."""
    m = x.shape[0]
    s, nkv, d = kc.shape
    rep, scale = nh // nkv, d ** -0.5
    n_qk, n_pv = (1, 1) if kc.dtype == torch.bfloat16 else (2, 2)
    qo = layout(nh, nkv, d)[0]
    bound = torch.zeros(m, nh, d)
    for r in range(n_valid):
        qg = x[r, qo:qo + 2 * nh * d].reshape(nh, 2 * d)
        q = rope_ref(rmsnorm_ref(qg[:, :d], qn, EPS), pos + r, THETA, rd)
        for h in range(nh):
            k, v = kc[:pos + r + 1, h // rep].float(), vc[:pos + r + 1, h // rep].float()
            delta = n_qk * U * scale * (q[h].abs() * k.abs()).sum(-1).max()
            w = torch.softmax(k @ q[h] * scale, 0)
            e = torch.expm1(2 * delta) * v.abs().max(0).values + n_pv * U * (w @ v.abs())
            bound[r, h] = e * torch.sigmoid(qg[h, d:])
    return bound.reshape(m, nh * d) + 1e-5


# (heads, kv heads, D, rotary_dim, M, max_seq, pos, n_prompt): a prefix and a whole chunk; a partial last
# chunk; the first chunk of a short prompt; a chunk ending at max_seq; 3 query heads a group (tile rows
# straddle chunk rows); D = 24 (BLOCK_D = 32, masked lanes).
CASES = [(4, 2, 32, 8, 5, 32, 7, 30), (4, 2, 32, 8, 8, 32, 20, 25), (4, 2, 16, 8, 8, 32, 0, 6),
         (4, 2, 16, 8, 8, 32, 24, 40), (6, 2, 16, 8, 5, 32, 13, 30), (4, 2, 24, 8, 5, 32, 9, 12)]
# the rule's BLOCK_R / BLOCK_N (one block, one tile), small ones, and small ones split over the sequence
# (SPLITS, SPLIT_ROWS: several splits with work, the last ones short or idle)
TILES = [(None, None, None, None), (4, 8, None, None), (4, 8, 4, 8)]


@DTYPES
@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}kv{}d{}r{}m{}s{}p{}n{}".format(*c))
def test_attn_rows_match_references(case, dtype):
    nh, nkv, d, rd, m, s, pos, n_prompt = case
    n_valid = max(0, min(m, n_prompt - pos, s - pos))
    x, qn, kn, kc, vc = make_inputs(nh, nkv, d, m, s, pos, dtype, seed=CASES.index(case))
    what = f"attn_rows {dtype} {case}"
    _, ko, vo, _ = layout(nh, nkv, d)

    # kv kernel: rows pos .. pos + n_valid - 1 as the reference writes them, every other row untouched
    kc_ref, vc_ref = kc.clone(), vc.clone()
    attn_rows_kv_ref(x, kn, kc_ref, vc_ref, pos, n_prompt, ko, vo, EPS, THETA, rd)
    kc_k, vc_k = kc.clone(), vc.clone()
    run_kv(x, kn, kc_k, vc_k, pos, n_prompt, nh, rd)
    new = slice(pos, pos + n_valid)
    assert torch.equal(bits(vc_k), bits(vc_ref)), f"{what}: v cache"
    assert_close(kc_k[new], kc_ref[new], 1e-5 if dtype == torch.float32 else 1e-2, 0.0, f"{what}: k rows")
    others = torch.ones(s, dtype=torch.bool)
    others[new] = False
    assert torch.equal(bits(kc_k[others]), bits(kc[others])), f"{what}: k rows outside the chunk changed"

    # q kernel on the reference's caches: within the bf16 rounding bound, invalid rows exactly 0
    ref = attn_rows_q_ref(x, qn, kc_ref, vc_ref, pos, n_prompt, layout(nh, nkv, d)[0], nh, EPS, THETA, rd, d ** -0.5)
    bound = rounding_bound(x, qn, kc_ref, vc_ref, pos, n_valid, nh, rd)
    for block_r, block_n, splits, split_rows in TILES:
        out = run_q(x, qn, kc_ref.clone(), vc_ref.clone(), pos, n_prompt, nh, rd, block_r, block_n, splits,
                    split_rows)
        tiles = f"{what} BLOCK_R/N {block_r}/{block_n} SPLITS {splits}"
        assert torch.isfinite(out).all(), f"{tiles}: an output element not written"
        assert (out[n_valid:] == 0).all(), f"{tiles}: rows past the valid ones not zero"
        assert_close(out[:n_valid], ref[:n_valid], RTOL[dtype], 0.0, tiles)
        excess = ((out - ref).abs() - bound).max().item()
        assert excess <= 0, f"{tiles}: error above the bf16 rounding bound by {excess:.3g}"

    # chained, on the kv kernel's caches, against the composed spec (attn_step per row)
    k0, v0 = x[:, ko:ko + nkv * d], x[:, vo:vo + nkv * d]
    qo = layout(nh, nkv, d)[0]
    qg = x[:, qo:qo + 2 * nh * d]
    spec = attn_rows_ref(qg, k0, v0, qn, kn, kc.clone(), vc.clone(), pos, n_prompt, EPS, THETA, rd, d ** -0.5)
    out = run_q(x, qn, kc_k, vc_k, pos, n_prompt, nh, rd)
    assert_close(out, spec, RTOL[dtype], 0.0, f"{what}: chained vs attn_rows_ref")


@DTYPES
def test_attn_rows_with_yarn(dtype):
    """The kv and q kernels with the YARN constexpr (test_kernels_attention's YaRN parameters: one blended
    frequency of the four) against the references with the same parameters: k rows, the q kernel on the
    reference's caches, the two chained against attn_rows_ref."""
    nh, nkv, d, rd, m, s, pos, n_prompt = 4, 2, 32, 8, 5, 32, 7, 30
    y = yarn(rd)
    x, qn, kn, kc, vc = make_inputs(nh, nkv, d, m, s, pos, dtype, seed=5)
    qo, ko, vo, _ = layout(nh, nkv, d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    attn_rows_kv_ref(x, kn, kc_ref, vc_ref, pos, n_prompt, ko, vo, EPS, THETA, rd, y)
    kc_k, vc_k = kc.clone(), vc.clone()
    run_kv(x, kn, kc_k, vc_k, pos, n_prompt, nh, rd, yarn=y)
    new = slice(pos, pos + m)
    assert_close(kc_k[new], kc_ref[new], 1e-5 if dtype == torch.float32 else 1e-2, 0.0, "k rows")
    plain = kc.clone()
    attn_rows_kv_ref(x, kn, plain, vc.clone(), pos, n_prompt, ko, vo, EPS, THETA, rd)
    assert (plain[new].float() - kc_k[new].float()).abs().max() > 0.1, "YaRN made no difference to the keys"
    ref = attn_rows_q_ref(x, qn, kc_ref, vc_ref, pos, n_prompt, qo, nh, EPS, THETA, rd, d ** -0.5, y)
    out = run_q(x, qn, kc_ref.clone(), vc_ref.clone(), pos, n_prompt, nh, rd, yarn=y)
    assert_close(out, ref, RTOL[dtype], 0.0, "q kernel")
    spec = attn_rows_ref(x[:, qo:qo + 2 * nh * d], x[:, ko:ko + nkv * d], x[:, vo:vo + nkv * d], qn, kn, kc.clone(),
                         vc.clone(), pos, n_prompt, EPS, THETA, rd, d ** -0.5, y)
    assert_close(run_q(x, qn, kc_k, vc_k, pos, n_prompt, nh, rd, yarn=y), spec, RTOL[dtype], 0.0, "chained")


@DTYPES
def test_no_valid_rows(dtype):
    """n_prompt <= pos (a chunk past the prompt's end) and pos >= max_seq: nothing written to the caches,
    every output row 0."""
    nh, nkv, d, rd, m, s = 4, 2, 16, 8, 5, 32
    for pos, n_prompt in ((12, 12), (12, 3), (32, 40), (40, 50)):
        x, qn, kn, kc, vc = make_inputs(nh, nkv, d, m, s, min(pos, s), dtype, seed=pos + n_prompt)
        kc_k, vc_k = kc.clone(), vc.clone()
        run_kv(x, kn, kc_k, vc_k, pos, n_prompt, nh, rd)
        assert torch.equal(bits(kc_k), bits(kc)) and torch.equal(bits(vc_k), bits(vc)), (pos, n_prompt)
        out = run_q(x, qn, kc_k, vc_k, pos, n_prompt, nh, rd)
        assert (out == 0).all(), (pos, n_prompt)


@pytest.mark.parametrize("pos", [0, 7, 8, 23, 40])
def test_split_over_the_sequence(pos):
    """A verify's few rows split over the sequence (SPLITS 8, one 8-row tile each at least: 1 to 6 splits with
    work, idle ones past them): within the rounding bound of the reference, invalid rows 0, the tickets left
    zero, and bit-equal whichever way the splits fall (SPLITS 8 against 16, the same active splits)."""
    nh, nkv, d, rd, m, s, n_prompt = 6, 2, 16, 8, 4, 64, pos + 3
    x, qn, kn, kc, vc = make_inputs(nh, nkv, d, m, s, pos, torch.bfloat16, seed=100 + pos)
    _, ko, vo, _ = layout(nh, nkv, d)
    attn_rows_kv_ref(x, kn, kc, vc, pos, n_prompt, ko, vo, EPS, THETA, rd)
    ref = attn_rows_q_ref(x, qn, kc, vc, pos, n_prompt, layout(nh, nkv, d)[0], nh, EPS, THETA, rd, d ** -0.5)
    bound = rounding_bound(x, qn, kc, vc, pos, 3, nh, rd)
    out = run_q(x, qn, kc, vc, pos, n_prompt, nh, rd, 16, 8, 8, 8)
    assert (out[3:] == 0).all()
    assert ((out - ref).abs() - bound).max().item() <= 0, pos
    assert torch.equal(out, run_q(x, qn, kc, vc, pos, n_prompt, nh, rd, 16, 8, 16, 8))
    scratch = {}
    run_q(x, qn, kc, vc, pos, n_prompt, nh, rd, 16, 8, 8, 8, scratch=scratch)
    merged = torch.isfinite(scratch["part"]).any().item()
    assert merged == (pos + 3 > 8), f"pos {pos}: partials written {merged}"  # more than one split has work
    one = run_q(x, qn, kc, vc, pos, n_prompt, nh, rd, 16, 8, 1, 8)
    assert_close(out, one, RTOL[torch.bfloat16], 0.0, f"split vs whole at pos {pos}")


def test_rows_past_the_cache_are_invalid():
    """A chunk running past max_seq: its rows at positions >= max_seq write nothing (rows after the cache
    in the same allocation stay untouched) and give 0; the others match the reference."""
    nh, nkv, d, rd, m, s, pos, n_prompt = 4, 2, 16, 8, 8, 32, 28, 40
    x, qn, kn, kc, vc = make_inputs(nh, nkv, d, m, s, pos, torch.float32, seed=7)
    guard = 6
    kbuf, vbuf = torch.full((s + guard, nkv, d), 7.0), torch.full((s + guard, nkv, d), 7.0)
    kbuf[:s], vbuf[:s] = kc, vc
    run_kv(x, kn, kbuf[:s], vbuf[:s], pos, n_prompt, nh, rd)
    assert (kbuf[s:] == 7.0).all() and (vbuf[s:] == 7.0).all()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    _, ko, vo, _ = layout(nh, nkv, d)
    attn_rows_kv_ref(x, kn, kc_ref, vc_ref, pos, s, ko, vo, EPS, THETA, rd)  # the valid rows: n_prompt = max_seq
    assert_close(kbuf[:pos + 4], kc_ref[:pos + 4], 1e-5, 0.0, "k cache")
    assert torch.equal(bits(vbuf[:s]), bits(vc_ref)) and torch.equal(bits(kbuf[pos + 4:s]), bits(kc_ref[pos + 4:]))
    out = run_q(x, qn, kbuf[:s], vbuf[:s], pos, n_prompt, nh, rd, 4, 8)
    ref = attn_rows_q_ref(x, qn, kc_ref, vc_ref, pos, s, layout(nh, nkv, d)[0], nh, EPS, THETA, rd, d ** -0.5)
    assert (out[s - pos:] == 0).all()
    assert_close(out, ref, RTOL[torch.float32], 0.0, "rows past max_seq")


# --- launch rules


@pytest.mark.parametrize("target", GPU_TARGETS)
def test_launch_rules_give_sane_grids(target):
    t = TARGETS[target]
    for nh, nkv in ((24, 4), (8, 2)):  # 27B, 0.8B (D = 256)
        w = nh * 512 + 2 * nkv * 256
        for m in (64, 128, 256, 512):
            kv = attn_rows_kv_launch(m, w, nkv, 256, 32768, "bf16", t)
            assert kv["grid"] == [m, nkv, 1] and kv["constexprs"]["BLOCK_D"] == 256
            c = attn_rows_q_launch(m, w, nh, nkv, 256, 32768, t)
            k = c["constexprs"]
            br, bn = k["BLOCK_R"], k["BLOCK_N"]
            tile_rows = m * nh // nkv
            assert c["grid"][0] == nkv and c["grid"][2] == k["SPLITS"] and k["SPLIT_ROWS"] == 4 * bn
            assert (c["grid"][1] - 1) * br < tile_rows <= c["grid"][1] * br  # every tile row once, no empty block
            assert 16 <= br <= 64 and 16 <= bn <= 64 and br & (br - 1) == 0 and bn & (bn - 1) == 0  # tl.dot shapes
            assert k["BLOCK_D"] == 256 and k["DOT_FP32"] is False and c["num_warps"] in (4, 8)
            assert k["PIPE_BYTES"] >= 2 * bn * 256 * 2  # at least one bf16 K/V tile pair in flight
            assert k["PIPE_BYTES"] + 2 * br * 256 <= t.smem_optin
            assert {"M": m, "W": w, "NKV": nkv, "D": 256, "S": 32768}.items() <= k.items()
            if c["grid"][0] * c["grid"][1] < t.sms:  # a small grid only at the smallest tile
                assert br == 16
    # the H200: 27B at M = 128 in 4 x 48 programs of 16 tile rows, at M = 512 in 4 x 96 of 32
    # the verify at 4 rows: 4 x 2 tile groups split 16 ways over the sequence (128 programs); 16 rows: 4 x 6 x 4
    assert attn_rows_q_launch(4, 14336, 24, 4, 256, 4096, SM90)["grid"] == [4, 2, 16]
    assert attn_rows_q_launch(16, 14336, 24, 4, 256, 4096, SM90)["grid"] == [4, 6, 4]
    assert attn_rows_q_launch(128, 14336, 24, 4, 256, 4096, SM90)["grid"] == [4, 48, 1]
    assert attn_rows_q_launch(512, 14336, 24, 4, 256, 4096, SM90)["grid"] == [4, 96, 1]
    assert attn_rows_q_launch(128, 5120, 8, 2, 256, 4096, SM90)["grid"] == [2, 32, 2]  # 64 groups: 2 splits


def test_launch_rules_read_the_table():
    rules = dict(SM90.rules)
    rules["attn_rows"] = dataclasses.replace(rules["attn_rows"], max_block_r=64, kv_num_warps=4)
    t = dataclasses.replace(SM90, rules=rules)
    assert attn_rows_q_launch(512, 14336, 24, 4, 256, 4096, t)["constexprs"]["BLOCK_R"] == 64
    assert attn_rows_kv_launch(512, 13312, 4, 256, 4096, "bf16", t)["num_warps"] == 4
    # a verify's rows (step_order_rows): the keys computed with attn_step's warps and FMA contraction
    rules["attn_rows"] = dataclasses.replace(rules["attn_rows"], kv_num_warps=2, step_order_rows=4)
    rules["attention"] = dataclasses.replace(rules["attention"], num_warps=8, fma_num_warps=16, fp_fusion=False)
    t = dataclasses.replace(SM90, rules=rules)
    assert {k: v for k, v in attn_rows_kv_launch(4, 13312, 4, 256, 4096, "bf16", t).items()
            if k in ("num_warps", "fp_fusion")} == {"num_warps": 8, "fp_fusion": False}
    assert attn_rows_kv_launch(4, 13312, 4, 256, 4096, "f32", t)["num_warps"] == 16
    assert attn_rows_kv_launch(5, 13312, 4, 256, 4096, "bf16", t)["num_warps"] == 2
    assert attn_step_launch(24, 4, 256, 4096, 32, "bf16", t)["fp_fusion"] is False
    assert attn_rows_step_launch(4, 14336, 24, 4, 256, 4096, "bf16", t)["fp_fusion"] is False
    assert "fp_fusion" not in attn_step_launch(24, 4, 256, 4096, 32, "bf16", SM90)


# --- AOT compilation at the 27B head shape, M = 128, max_seq 4096, for every GPU target: one clean
# subprocess per cache dtype compiles its (kernel, target) jobs (the suite runs Triton interpreted).
_COMPILE_ALL = r"""
import json, sys
from kestrel.compiler.codegen import compile_kernel
res = []
for kid, jit, types, consts, nw, cc in json.loads(sys.stdin.read()):
    k = compile_kernel(kid, jit, types, consts, nw, cc, aligned=[t.startswith("*") for t in types])
    res.append({"elf": k.cubin[:4] == b"\x7fELF", "name": k.name, "arch": k.arch, "shared": k.shared,
                "num_warps": k.num_warps})
print(json.dumps(res))
"""
PTR = {"bf16": "*bf16", "f32": "*fp32"}
NH, NKV, D, M, S = 24, 4, 256, 128, 4096
W = NH * 2 * D + 2 * NKV * D


# Every target: the kv and q kernels at the prefill's 128 rows and the step-order rows kernel at a verify's 4; the
# other forms (the q kernel split over the sequence at 4 rows, and YaRN in all three) on the two families of
# tensor-core code (Ampere's mma, Hopper's), as test_kernels_attention.py's AOT jobs
AOT_VARIANT_TARGETS = ("sm_80", "sm_90")


def aot_jobs(dt):
    p = PTR[dt]
    kv_types = ["*fp32", "*fp32", p, p, "*i32", "*i32"] + ["i32", "i32", "fp32", "fp32", "i32"]
    q_types = ["*fp32", "*fp32", p, p, "*i32", "*i32", "*fp32", "*i32", "*fp32"] + ["i32", "i32", "fp32", "fp32",
                                                                                   "i32", "fp32"]
    jobs = []
    for name in GPU_TARGETS:
        t = TARGETS[name]
        kv = attn_rows_kv_launch(M, W, NKV, D, S, dt, t)
        q = attn_rows_q_launch(M, W, NH, NKV, D, S, t)
        st = attn_rows_step_launch(4, W, NH, NKV, D, S, dt, t)  # the step-order form at a verify's 4 rows
        jobs.append((f"attn_rows_kv_{dt}", "kestrel.kernels.attention:attn_rows_kv_kernel", kv_types,
                     kv["constexprs"], kv["num_warps"], t.cc))
        jobs.append((f"attn_rows_q_{dt}", "kestrel.kernels.attention:attn_rows_q_kernel", q_types, q["constexprs"],
                     q["num_warps"], t.cc))
        jobs.append((f"attn_rows_step_{dt}", "kestrel.kernels.attention:attn_rows_step_kernel", q_types,
                     st["constexprs"], st["num_warps"], t.cc))
        if name not in AOT_VARIANT_TARGETS:
            continue
        y = {"YARN": yarn(D // 4)}  # (the YaRN forms: the kv kernel, the split q kernel and the step-order rows)
        jobs.append((f"attn_rows_kv_{dt}_yarn", "kestrel.kernels.attention:attn_rows_kv_kernel", kv_types,
                     kv["constexprs"] | y, kv["num_warps"], t.cc))
        v = attn_rows_q_launch(4, W, NH, NKV, D, S, t)  # a verify's 4 rows: split over the sequence
        assert v["constexprs"]["SPLITS"] > 1
        jobs.append((f"attn_rows_q_{dt}_split", "kestrel.kernels.attention:attn_rows_q_kernel", q_types,
                     v["constexprs"] | y, v["num_warps"], t.cc))
        jobs.append((f"attn_rows_step_{dt}_yarn", "kestrel.kernels.attention:attn_rows_step_kernel", q_types,
                     st["constexprs"] | y, st["num_warps"], t.cc))
    return jobs


@pytest.fixture(scope="module", autouse=True)
def aot_procs(request):
    """The compile subprocesses, started when the module starts (if its AOT tests are selected), so they
    run alongside the interpreter tests."""
    procs = {}
    if any(item.module is request.module and item.name.startswith("test_aot") for item in request.session.items):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        for dt in PTR:
            job, out, err = (tempfile.TemporaryFile("w+") for _ in range(3))
            job.write(json.dumps(aot_jobs(dt)))
            job.seek(0)
            procs[dt] = (subprocess.Popen([sys.executable, "-c", _COMPILE_ALL], stdin=job, stdout=out, stderr=err,
                                          env=env), out, err)
    yield procs
    for p, _, _ in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def aot_results(aot_procs):
    results = {}
    for dt, (p, out, err) in aot_procs.items():
        rc = p.wait(timeout=600)
        out.seek(0)
        err.seek(0)
        results[dt] = (rc, out.read(), err.read())
    return results


@pytest.mark.parametrize("dt", list(PTR))
def test_aot_compiles_for_every_target(aot_results, dt):
    rc, out, err = aot_results[dt]
    assert rc == 0, f"AOT compile of attn_rows_*_{dt} failed:\n{err[-3000:]}"
    res = json.loads(out.strip().splitlines()[-1])
    jobs = aot_jobs(dt)
    assert len(res) == len(jobs) == 3 * len(GPU_TARGETS) + 3 * len(AOT_VARIANT_TARGETS)
    for (kid, _, _, consts, nw, cc), r in zip(jobs, res):
        assert r["elf"] and r["name"] and r["num_warps"] == nw, (kid, cc)
        assert r["arch"] == f"sm_{cc}{'a' if cc >= 90 else ''}"
        smem = next(t.smem_optin for t in TARGETS.values() if t.cc == cc)
        assert r["shared"] <= smem, f"{kid} sm_{cc}: {r['shared']} B of shared memory > {smem}"


@DTYPES
@pytest.mark.parametrize("nh,nkv,d,s,pos,split_rows,rope", [
    (4, 2, 32, 64, 9, None, None), (6, 2, 16, 64, 40, 16, None), (6, 2, 16, 64, 40, 16, "yarn")])
def test_step_order_rows_are_the_one_token_steps_bit_for_bit(nh, nkv, d, s, pos, split_rows, rope, dtype):
    """attn_rows_step_kernel (``attn_rows.step_order_rows``): after attn_rows_kv_kernel wrote the chunk's rows, each
    valid row equals attn_step_kernel run at that position, one step after another, bit for bit (the same splits,
    tiles, seeding and merge; split_rows 16: several splits merge; ``rope`` yarn: all three kernels with the YARN
    constexpr); the invalid rows are zero; tickets reset."""
    m, n_valid, rd = 4, 3, d // 2
    y = {"YARN": yarn(rd)} if rope else {}
    x, qn, kn, kc, vc = make_inputs(nh, nkv, d, m, s, pos, dtype, seed=nh + pos)
    qo, ko, vo, w = layout(nh, nkv, d)
    kc1, vc1 = kc.clone(), vc.clone()
    run_kv(x, kn, kc, vc, pos, pos + n_valid, nh, rd, yarn=y.get("YARN"))
    c = attn_rows_step_launch(m, w, nh, nkv, d, s, "bf16" if dtype == torch.bfloat16 else "f32", SM90)
    consts = dict(c["constexprs"], DOT_FP32=True, **({"SPLIT_ROWS": split_rows} if split_rows else {}), **y)
    part_shape, ticket_shape = attn_rows_scratch({"grid": c["grid"], "constexprs": consts}, d)
    part, tickets = torch.full(part_shape, float("nan")), torch.zeros(ticket_shape, dtype=torch.int32)
    out = torch.full((m, nh * d), float("nan"))
    interpret(attn_rows_step_kernel)[tuple(c["grid"])](x, qn, kc, vc, dyn(pos), dyn(pos + n_valid), part, tickets,
                                                       out, qo, nh, EPS, THETA, rd, d ** -0.5, **consts)
    assert (tickets == 0).all() and torch.equal(out[n_valid:], torch.zeros_like(out[n_valid:]))
    sl = attn_step_launch(nh, nkv, d, s, attn_splits(nkv, s, SM90), "bf16" if dtype == torch.bfloat16 else "f32",
                          SM90)
    sc = dict(sl["constexprs"], DOT_FP32=True, **({"SPLIT_ROWS": split_rows} if split_rows else {}), **y)
    for r in range(n_valid):
        one = torch.full((nh * d,), float("nan"))
        interpret(attn_step_kernel)[tuple(sl["grid"])](
            x[r, qo:qo + nh * 2 * d].clone(), x[r, ko:ko + nkv * d].clone(), x[r, vo:vo + nkv * d].clone(), qn, kn,
            kc1, vc1, dyn(pos + r), torch.full((nh, sc["SPLITS"], d + 2), float("nan")),
            torch.zeros(nh, dtype=torch.int32), one, EPS, THETA, rd, d ** -0.5, **sc)
        assert torch.equal(bits(kc1[pos + r]), bits(kc[pos + r])), f"row {r}: the cached key differs"
        assert torch.equal(out[r], one), f"row {r}: differs from the one-token step ({(out[r] - one).abs().max()})"

