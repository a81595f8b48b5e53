"""The matvec at a few rows (matvec_rows_kernel, matvec_rows_swiglu_kernel: a verify step's k + 1 rows):
Triton's interpreter against ``matvec_ref`` row by row (the one-token step's product) for f32, bf16 and q4
weights, R = 1..4 rows per program and M spread over several programs (rows clamped, not stored); the
launch rule; AOT compilation for every target."""
import math

import pytest
import torch

from kernel_harness import assert_close, interpret
from kestrel.compiler.codegen import compile_kernel
from kestrel.kernels.matvec import (FEW_ROWS, _q4_word_dot_rows, few_rows_per_program, matvec_launch,
                                    matvec_ref, matvec_rows_kernel, matvec_rows_launch, matvec_rows_swiglu_kernel,
                                    matvec_swiglu_ref)
from kestrel.kernels.targets import TARGETS
from test_kernels_matvec import RTOL, make_weight

# (weight kind, M, N, K, constexpr overrides): several K tiles, a masked K tail, rows past N clamped,
# every R (M = 5: two programs of 3 rows, the last row clamped and not stored)
CASES = [
    ("f32", 2, 37, 1000, {"BLOCK_N": 8, "BLOCK_K": 128}),
    ("bf16", 4, 100, 300, {"BLOCK_N": 16, "BLOCK_K": 128}),
    ("bf16", 5, 30, 512, None),
    ("bf16", 1, 5, 4, None),                                  # K below one 16-byte chunk
    ("q4g32", 3, 21, 96, {"BLOCK_N": 8, "BLOCK_K": 32}),
    ("q4g64", 4, 37, 192, {"BLOCK_N": 16, "BLOCK_K": 128}),   # one tile + a masked half tile
    ("q4g128", 5, 10, 1152, {"BLOCK_N": 8, "BLOCK_K": 512}),  # two tiles + a masked quarter tile
    ("q4g128", 7, 19, 640, {"BLOCK_N": 4, "BLOCK_K": 256}),   # R = 4: programs of 4 and 3 (clamped)
]


def _launch(m, n, k, group, override, pair=False):
    c = matvec_rows_launch(m, n, k, group, TARGETS["sm_90"], pair=pair)
    consts = {**c["constexprs"], **(override or {})}
    grid = (math.ceil(n / consts["BLOCK_N"]), c["grid"][1])
    return grid, consts


@pytest.mark.parametrize("kind,m,n,k,override", CASES)
def test_matvec_rows_interpreter(kind, m, n, k, override):
    g = torch.Generator().manual_seed(m * 31 + n * 7919 + k)
    warg, wref, group = make_weight(kind, n, k, g)
    x = torch.randn(m, k, generator=g)
    grid, c = _launch(m, n, k, group, override)
    y = torch.full((m + 1, n), float("nan"))  # a sentinel row: rows past M must not be stored
    interpret(matvec_rows_kernel)[grid](x, warg, y, **c)
    assert torch.isnan(y[m:]).all(), "stored past M"
    assert_close(y[:m], matvec_ref(x, wref), RTOL, 0.0, f"matvec_rows {kind} {m}x{n}x{k} {c}")


@pytest.mark.parametrize("kind,m,n,k,override", [CASES[1], CASES[4], CASES[6]])
def test_matvec_rows_swiglu_interpreter(kind, m, n, k, override):
    g = torch.Generator().manual_seed(m * 131 + n * 104729 + k)
    wg, wg_ref, group = make_weight(kind, n, k, g)
    wu, wu_ref, _ = make_weight(kind, n, k, g)
    x = torch.randn(m, k, generator=g)
    grid, c = _launch(m, n, k, group, override, pair=True)
    y = torch.full((m + 1, n), float("nan"))
    interpret(matvec_rows_swiglu_kernel)[grid](x, wg, wu, y, **c)
    assert torch.isnan(y[m:]).all(), "stored past M"
    scale = (matvec_ref(x, wg_ref).abs() * matvec_ref(x, wu_ref).abs()).max().item()
    assert_close(y[:m], matvec_swiglu_ref(x, wg_ref, wu_ref), 0.0, RTOL * scale, f"swiglu rows {kind} {m}x{n}x{k}")


def test_launch_rule():
    """R spreads M evenly over ceil(M / FEW_ROWS) programs; the weight's split is the one-row kernel's for
    the 27B bf16 matrices (a row's result is then the one-row kernel's), the swept few-rows ones elsewhere."""
    assert [few_rows_per_program(m) for m in range(1, 10)] == [1, 2, 3, 4, 3, 3, 4, 4, 3]
    t = TARGETS["sm_90"]
    picks = {}
    for n, k, group, pair in [(5120, 17408, 0, False), (16480, 5120, 0, False), (17408, 5120, 0, True),
                              (5120, 6144, 128, False), (5120, 17408, 128, False), (17408, 5120, 128, True),
                              (16480, 5120, 128, False), (6144, 1024, 0, False), (1024, 3584, 0, False)]:
        one = matvec_launch(n, k, group, t, pair=pair)
        for m in (2, 4, 5):
            c = matvec_rows_launch(m, n, k, group, t, pair=pair)
            e = c["constexprs"]
            r = e["R"]
            assert c["grid"] == [math.ceil(n / e["BLOCK_N"]), math.ceil(m / r), 1] and r <= FEW_ROWS
            assert (e["M"], e["N"], e["K"], e["GROUP"]) == (m, n, k, group) and e["BLOCK_K"] % max(group, 1) == 0
            picks[n, k, group, pair] = (e["BLOCK_N"], e["BLOCK_K"], c["num_warps"])
        if not group and n * k * 2 >= t.rules["matvec"].small_matrix_bytes:
            assert picks[n, k, group, pair] == (one["constexprs"]["BLOCK_N"], one["constexprs"]["BLOCK_K"],
                                                one["num_warps"])
    # the sweep's picks (bench/results/tuning/rows-sweep-h200.json)
    assert picks[5120, 6144, 128, False] == picks[5120, 17408, 128, False] == (16, 1024, 4)
    assert picks[17408, 5120, 128, True] == (16, 512, 4) and picks[16480, 5120, 128, False] == (16, 512, 1)
    assert picks[6144, 1024, 0, False] == (8, 256, 2) and picks[1024, 3584, 0, False] == (4, 1024, 2)


def test_one_row_split_takes_the_one_row_kernels_split_everywhere():
    """``matvec_rows.one_row_split`` (an experiment, KESTREL_RULES): every shape, q4 and small bf16 included, runs
    the one-row kernel's BLOCK_N, BLOCK_K and warps, where the default rule picks others for speed."""
    import dataclasses

    t = TARGETS["sm_90"]
    exact = dataclasses.replace(t, rules={**t.rules,
                                          "matvec_rows": dataclasses.replace(t.rules["matvec_rows"], one_row_split=True)})
    differs = 0
    for n, k, group, pair in [(5120, 6144, 128, False), (17408, 5120, 128, True), (16480, 5120, 128, False),
                              (6144, 1024, 0, False), (1024, 3584, 0, False), (248320, 5120, 128, False)]:
        one = matvec_launch(n, k, group, t, pair=pair)
        split = (one["constexprs"]["BLOCK_N"], one["constexprs"]["BLOCK_K"], one["num_warps"])
        c = matvec_rows_launch(4, n, k, group, exact, pair=pair)
        assert (c["constexprs"]["BLOCK_N"], c["constexprs"]["BLOCK_K"], c["num_warps"]) == split, (n, k, group)
        d = matvec_rows_launch(4, n, k, group, t, pair=pair)
        differs += (d["constexprs"]["BLOCK_N"], d["constexprs"]["BLOCK_K"], d["num_warps"]) != split
    assert differs >= 4  # the default rule's speed picks, which the experiment gives up


def test_matmul_rows_pick_the_few_rows_matvec_up_to_the_rule():
    """compiler/ops.py: a matmul at M rows runs the few-rows matvec up to the gemm rule's few_rows_matvec
    rows (bf16 with the tensor-core bf16 kernel off; with it, and q4, the tensor-core products take those rows:
    tests/test_kernels_bf16_mma.py, tests/test_kernels_q4_mma.py), the GEMM past it; one row the matvec."""
    import dataclasses

    from kestrel.compiler.ir import Op, TensorType, Value, Weight
    from kestrel.compiler.ops import OPS
    from kestrel.kernels.gemm import gemm_kernel

    t = TARGETS["sm_90"]
    t = dataclasses.replace(t, rules={**t.rules, "bf16_mma": dataclasses.replace(t.rules["bf16_mma"], max_rows=0)})
    few = t.rules["gemm"].few_rows_matvec
    assert few >= 4  # a verify step's k + 1 = 4 rows
    w = Weight("w", TensorType("bf16", (5120, 6144)), ["ckpt", "w"])
    for shape, kernel, jit in [((few, 6144), "matvec_rows_bf16", matvec_rows_kernel),
                               ((few + 1, 6144), "gemm_bf16", gemm_kernel)]:
        op = OPS["matmul"]
        o = Op("matmul", [Value(TensorType("f32", (shape[0], 5120)))], [Value(TensorType("f32", shape)), w])
        o.launch = op.kernel.launch(o, t)
        assert o.launch["kernel"] == kernel and op.kernel.jit_for(o) is jit


def test_q4_word_dot_rows_converts_once():
    """The R-row assembly block converts the word once (four LOP3s) and multiplies it by R rows' pairs."""
    for r in range(1, 5):
        asm = _q4_word_dot_rows(r)
        assert asm.count("lop3.b32") == 4 and asm.count("mul.rn.f16x2") == r and asm.count("add.f32") == r
        assert f"${r + 4 * r}" in asm and f"${r + 4 * r + 1}" not in asm


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_matvec_rows_compiles_for_every_target(target):
    """The 27B projections at 4 rows: bf16 and q4 (many-rows and fewer-rows q4 splits), the MLP pair."""
    t = TARGETS[target]
    for jit, (m, n, k, group), pair in [(matvec_rows_kernel, (4, 5120, 17408, 0), False),
                                        (matvec_rows_kernel, (4, 16480, 5120, 128), False),
                                        (matvec_rows_kernel, (3, 5120, 6144, 128), False),
                                        (matvec_rows_swiglu_kernel, (4, 17408, 5120, 128), True)]:
        c = matvec_rows_launch(m, n, k, group, t, pair=pair)
        w = "*u8" if group else "*bf16"
        types = ["*fp32", w] + ([w] if pair else []) + ["*fp32"]
        ck = compile_kernel("matvec_rows", jit, types, c["constexprs"], c["num_warps"], t.cc, [True] * len(types))
        assert ck.cubin[:4] == b"\x7fELF" and ck.num_warps == c["num_warps"]
        assert ck.shared <= 99 * 1024


@pytest.mark.parametrize("kind,m,n,k,override", [CASES[0], CASES[1], CASES[2]])
def test_pair_fma_rows_equal_the_one_row_kernel(kind, m, n, k, override):
    """``matvec_rows.pair_fma`` (speculative plans): the floating-point products as explicit FMA pairs in both the
    one-row and the few-rows kernel: each row of the few-rows kernel equals the one-row kernel's bit for bit at the
    same split (interpreter), and the product stays within the tolerance of ``matvec_ref``."""
    from kestrel.kernels.matvec import matvec_kernel

    g = torch.Generator().manual_seed(m * 17 + n + k)
    warg, wref, group = make_weight(kind, n, k, g)
    x = torch.randn(m, k, generator=g)
    grid, c = _launch(m, n, k, group, override)
    c["PAIR_FMA"] = True
    y = torch.full((m, n), float("nan"))
    interpret(matvec_rows_kernel)[grid](x, warg, y, **c)
    assert_close(y, matvec_ref(x, wref), RTOL, 0.0, f"pair-FMA rows {kind} {m}x{n}x{k}")
    one = {key: c[key] for key in ("N", "K", "GROUP", "BLOCK_N", "BLOCK_K")}
    for r in range(m):
        y1 = torch.full((n,), float("nan"))
        interpret(matvec_kernel)[(grid[0],)](x[r].clone(), warg, y1, **one, PAIR_FMA=True)
        assert torch.equal(y1, y[r]), f"row {r}"


_PAIR_FMA_PTX = """
import dataclasses, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from kestrel.kernels.matvec import matvec_kernel, matvec_launch, matvec_rows_kernel, matvec_rows_launch
from kestrel.kernels.targets import TARGETS

t = TARGETS["sm_90"]
exact = dataclasses.replace(t, rules={**t.rules, "matvec_rows": dataclasses.replace(
    t.rules["matvec_rows"], pair_fma=True, one_row_split=True)})


def counts(fn, launch):
    consts = dict(launch["constexprs"], PDL=True)
    names = [a for a in fn.arg_names if a not in consts]
    sig = dict(zip(names, ["*fp32", "*bf16", "*fp32"])) | {key: "constexpr" for key in consts}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=dict(consts),
                                    attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})  # as compile_kernel
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": launch["num_warps"], "enable_fp_fusion": True}).asm["ptx"]
    return len(re.findall(r"\\bfma\\.rn\\.f32", ptx)), len(re.findall(r"\\bmul(?:\\.rn)?\\.f32", ptx))


out = {}
for n, k in [(512, 2048), (5120, 6144)]:
    one, rows = matvec_launch(n, k, 0, exact), matvec_rows_launch(4, n, k, 0, exact)
    assert one["constexprs"]["PAIR_FMA"] and rows["constexprs"]["PAIR_FMA"] and "fp_fusion" not in rows
    out[f"{n}x{k}"] = {"one": counts(matvec_kernel, one), "rows": counts(matvec_rows_kernel, rows),
                       "plain": counts(matvec_kernel, matvec_launch(n, k, 0, t))}
print(json.dumps(out))
"""


def test_pair_fma_leaves_no_product_to_contract():
    """Compiled for sm_90 with FMA contraction on (a clean process: the suite runs Triton interpreted), the one-row
    and few-rows bf16 kernels under PAIR_FMA make every pair of products as one mul and one fma (as many of each:
    no product left for the compiler to fuse, so the two kernels sum a chunk alike), at Qwen3-Next's router [512,
    2048] (where contraction made the two differ, stop 36) and a 27B projection; without it the compiler contracts
    most products."""
    import json
    import os
    import subprocess
    import sys

    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _PAIR_FMA_PTX], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    for shape, c in json.loads(res.stdout.strip().splitlines()[-1]).items():
        for kernel in ("one", "rows"):
            fma, mul = c[kernel]
            assert fma == mul > 0, (shape, kernel, fma, mul)
        fma, mul = c["plain"]
        assert fma > 2 * mul, (shape, fma, mul)  # the plain rule: contracted
