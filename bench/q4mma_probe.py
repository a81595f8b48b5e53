"""Probe: q4 products on the tensor cores with a two-instruction-per-pair dequantisation (issue 13 part 3,
issue 12's verify step).

The q4 matvec spends ~3 instructions per weight (bench/results/stop21: 16 per 8-weight word in its
f16x2 dot, plus the x tile's conversion), and the M-row GEMM's q4 path (``_q4_unpack_words``: shifts,
joins, an int -> float conversion, a scale multiply per weight) reads 4-row weights at 9-18% of the
bandwidth. Here the word becomes four f16x2 of (q - 8) in 9 instructions (kernels/matvec.py's
LOP3 / HSUB2 / HFMA2, as an 8-output inline-assembly block over the word broadcast 8 times), the
tile goes to the tensor cores as f16 against x / 64 in f16, and each group's product is scaled
once on the fp32 accumulator (BLOCK_K <= GROUP: one group per tile). M rows of x (1 to 16) share
one 16-row MMA tile.

Here (no GPU):   python bench/q4mma_probe.py compile DIR
On the device:   cd bench && python3 q4mma_probe.py time DIR $OUT/q4mma.json
"""
from __future__ import annotations

import itertools
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import triton
import triton.language as tl

GROUP = 128
SHAPES = {"27b-in_proj": (16480, 5120), "27b-qkv": (14336, 5120), "27b-o_proj": (5120, 6144),
          "27b-down": (5120, 17408), "27b-gate": (17408, 5120)}
ROWS = (1, 4)

_DEQ8 = tl.constexpr("""{
 .reg .b32 t, m, s16, bias;
 mov.b32 m, 0x64086408;
 mov.b32 s16, 0x2c002c00;
 mov.b32 bias, 0xd480d480;
 lop3.b32 $0, $4, 0x000f000f, 0x64006400, 0xea;
 lop3.b32 $1, $4, 0x00f000f0, 0x64006400, 0xea;
 shr.u32 t, $4, 8;
 lop3.b32 $2, t, 0x000f000f, 0x64006400, 0xea;
 lop3.b32 $3, t, 0x00f000f0, 0x64006400, 0xea;
 sub.f16x2 $0, $0, m;
 fma.rn.f16x2 $1, $1, s16, bias;
 sub.f16x2 $2, $2, m;
 fma.rn.f16x2 $3, $3, s16, bias;
}""")


@triton.jit
def _q4_f16(words, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """words [BLOCK_N, BLOCK_K / 8] -> (q - 8) as f16 [BLOCK_N, BLOCK_K], inputs in order (the word's
    inputs 2p, 2p + 1 sit at nibbles p, p + 4: one LOP3 makes their f16x2 of 1024 + q)."""
    w8 = tl.broadcast_to(words[:, :, None], [BLOCK_N, BLOCK_K // 8, 8])
    h = tl.inline_asm_elementwise(_DEQ8, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [w8], dtype=tl.float16, is_pure=True,
                                  pack=8)
    return tl.reshape(h, [BLOCK_N, BLOCK_K])


@triton.jit
def q4mma_kernel(x_ptr, w_ptr, y_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr):
    """Y [M, N] = X [M, K] @ W^T for q4 W (kernels/matvec.py's layout), M <= 16: program p computes
    columns [p * BLOCK_N, (p + 1) * BLOCK_N) for all M rows."""
    BLOCK_M: tl.constexpr = 16
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_in = tl.minimum(cols, N - 1)
    rows = tl.arange(0, BLOCK_M)
    rows_in = tl.minimum(rows, M - 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    wp = w_ptr.to(tl.pointer_type(tl.int32)) + cols_in.to(tl.int64)[:, None] * (K // 8)
    sp = (w_ptr + N * K // 2).to(tl.pointer_type(tl.float16)) + cols_in.to(tl.int64) * (K // GROUP)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows_in[:, None] * K + ks[None, :])
        xh = (x * (1.0 / 64.0)).to(tl.float16)
        words = tl.load(wp + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :])
        w = _q4_f16(words, BLOCK_N, BLOCK_K)
        s = tl.load(sp + k0 // GROUP).to(tl.float32)
        acc += tl.dot(xh, tl.trans(w)) * s[None, :]
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc * 64.0, mask=(rows < M)[:, None] & (cols < N)[None, :])


def variants():
    for bn, bk, nw, st in itertools.product((32, 64, 128, 256), (64, 128), (1, 2, 4, 8), (3, 4)):
        if nw * 32 <= bn * bk // 8 and not (bn >= 128 and nw == 1):
            yield bn, bk, nw, st


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel

    name, n, k, m, bn, bk, nw, st = job
    try:
        c = compile_kernel("q4mma", q4mma_kernel, ["*fp32", "*u8", "*fp32"],
                           {"M": m, "N": n, "K": k, "GROUP": GROUP, "BLOCK_N": bn, "BLOCK_K": bk, "STAGES": st}, nw, 90,
                           [True] * 3)
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is skipped
        return None, f"{job}: {type(e).__name__}: {str(e)[:300]}"
    return (job, c.name, c.cubin, c.shared), None


def compile_all(folder):
    os.makedirs(folder, exist_ok=True)
    jobs = [(name, n, k, m, *v) for name, (n, k) in SHAPES.items() for m in ROWS for v in variants()]
    index = []
    with ProcessPoolExecutor(2) as ex:
        for res, err in ex.map(_compile, jobs):
            if err:
                print("skip", err)
                continue
            (name, n, k, m, bn, bk, nw, st), fn, cubin, shared = res
            f = f"{name}-m{m}-{bn}-{bk}-{nw}-{st}.cubin"
            open(os.path.join(folder, f), "wb").write(cubin)
            index.append(dict(shape=name, N=n, K=k, M=m, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, STAGES=st, name=fn,
                              cubin=f, shared=shared))
    json.dump(index, open(os.path.join(folder, "index.json"), "w"), indent=1)
    print(len(index), "variants")


def time_all(folder, out):
    import math
    import statistics

    import torch

    from graph_timing import launch_times_us, rotating_copies
    from kestrel.artifacts.errors import DeviceError
    from kestrel.kernels.matvec import q4_codes, q4_pack
    from kestrel.runtime import cuda as kc

    torch.zeros(1, device="cuda")
    kc.init(0)
    index = json.load(open(os.path.join(folder, "index.json")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    data, rows = {}, []
    for e in index:
        n, k, m = e["N"], e["K"], e["M"]
        key = (e["shape"], m)
        if key not in data:
            data.clear()
            torch.cuda.empty_cache()
            w = torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)
            buf = q4_pack(w, GROUP)
            q, sc = q4_codes(buf, n, k, GROUP)
            x = torch.randn(m, k, generator=gen, device="cuda")
            xh = (x / 64).half().double()
            deq = (q.double().reshape(n, k // GROUP, GROUP) * sc.double()[:, :, None]).reshape(n, k)
            ref = (xh @ deq.T * 64).float()
            copies = rotating_copies(buf.numel())
            sets = [buf if i == 0 else buf.clone() for i in range(copies)]
            data[key] = (x, sets, ref, buf.numel())
        x, sets, ref, nbytes = data[key]
        try:
            kern = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["name"], e["num_warps"], e["shared"])
        except DeviceError:
            continue
        y = torch.full((m, n), float("nan"), device="cuda")
        grid = [(n + e["BLOCK_N"] - 1) // e["BLOCK_N"], 1, 1]
        packed = [kc.PackedArgs(["*fp32", "*u8", "*fp32"], [x.data_ptr(), b.data_ptr(), y.data_ptr()]) for b in sets]
        kc.launch(kern, grid, packed[0], 0)
        torch.cuda.synchronize()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        us = statistics.median(launch_times_us(kern, grid, packed, replays=8))
        r = dict(e, us=us, GBps=nbytes / us / 1e3, err=err)
        rows.append(r)
    json.dump(rows, open(out, "w"), indent=1)
    print("best per shape and M (error < 1e-5):")
    for key in dict.fromkeys((r["shape"], r["M"]) for r in rows):
        rs = sorted((r for r in rows if (r["shape"], r["M"]) == key and r["err"] < 1e-5), key=lambda r: r["us"])
        bad = sum(1 for r in rows if (r["shape"], r["M"]) == key and not r["err"] < 1e-5)
        for r in rs[:3]:
            print(f"{key[0]:12} M={key[1]} BN={r['BLOCK_N']:3} BK={r['BLOCK_K']:3} nw={r['num_warps']} st={r['STAGES']} "
                  f"{r['us']:8.2f} us {r['GBps']:6.0f} GB/s err {r['err']:.1e}" + (f"  ({bad} variants wrong)" if bad else ""))


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
