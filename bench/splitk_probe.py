"""Probe: does splitting K over more programs lift the q4 matvec at the 27B shapes? (issue 13 part 3)

The q4 matvecs of the 27B step run at 47-62% of the read bandwidth (bench/results/stop20, profile):
one wave of a few hundred programs, each a serial K loop; ncu found them latency-bound (1.9-4.5
warps per scheduler). A split-K grid [row blocks, SPLIT] keeps 16 rows per program (the x tile's
f16x2 conversion shared by 16 rows) but shortens each program's K range; the SPLIT partial sums are
merged deterministically by the last program of each row block to take a ticket (the attention
step's scheme, kernels/attention.py), so no floating-point atomics.

Here (no GPU):   python bench/splitk_probe.py compile DIR
On the device:   python3 bench/splitk_probe.py time DIR $OUT/splitk.json
Each variant is checked against matvec_ref / matvec_swiglu_ref and timed like bench/matvec_sweep.py
(a CUDA graph of launches rotating over copies larger than L2); the current launch rule's kernel
(matvec_kernel / matvec_swiglu_kernel) is timed beside it in the same run.
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import triton
import triton.language as tl

from kestrel.kernels.matvec import NORM_NONE, _matvec_tile

GROUP = 128
SHAPES = {  # the 27B q4 decode step's matrices (fused widths), 9B down_proj
    "27b-in_proj": ("matvec", 16480, 5120), "27b-qkv": ("matvec", 14336, 5120),
    "27b-o_proj": ("matvec", 5120, 6144), "27b-down": ("matvec", 5120, 17408),
    "27b-swiglu": ("swiglu", 17408, 5120), "9b-down": ("matvec", 4096, 12288),
}


@triton.jit
def _rows_range(x_ptr, w_ptr, rows, t0, t1, N: tl.constexpr, K: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros([BLOCK_N, BLOCK_K // 32], tl.float32)
    for t in tl.range(t0, t1, num_stages=3):
        part, _ = _matvec_tile(x_ptr, w_ptr, rows, t * BLOCK_K, x_ptr, 1.0, 0.0, N, K, GROUP, BLOCK_N, BLOCK_K, 32,
                               False, NORM_NONE)
        acc += part
    return tl.sum(acc, axis=1) * 64.0


@triton.jit
def matvec_splitk_kernel(x_ptr, wg_ptr, wu_ptr, y_ptr, part_ptr, ticket_ptr, N: tl.constexpr, K: tl.constexpr,
                         GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                         PAIR: tl.constexpr):
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    T: tl.constexpr = K // BLOCK_K
    t0 = sp * T // SPLIT
    t1 = (sp + 1) * T // SPLIT
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in = tl.minimum(rows, N - 1)
    g = _rows_range(x_ptr, wg_ptr, rows_in, t0, t1, N, K, GROUP, BLOCK_N, BLOCK_K)
    if PAIR:
        u = _rows_range(x_ptr, wu_ptr, rows_in, t0, t1, N, K, GROUP, BLOCK_N, BLOCK_K)
    if SPLIT == 1:
        if PAIR:
            g = g / (1.0 + tl.exp(-g)) * u
        tl.store(y_ptr + rows, g, mask=rows < N)
    else:
        W: tl.constexpr = 2 if PAIR else 1
        base = part_ptr + (sp * W) * N
        tl.store(base + rows_in, g)
        if PAIR:
            tl.store(base + N + rows_in, u)
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            gs = tl.zeros([BLOCK_N], tl.float32)
            us = tl.zeros([BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT):
                gs += tl.load(part_ptr + (s * W) * N + rows_in, cache_modifier=".cg")
                if PAIR:
                    us += tl.load(part_ptr + (s * W + 1) * N + rows_in, cache_modifier=".cg")
            if PAIR:
                gs = gs / (1.0 + tl.exp(-gs)) * us
            tl.store(y_ptr + rows, gs, mask=rows < N)
            tl.atomic_xchg(ticket_ptr + pid, 0, sem="relaxed", scope="gpu")


def variants(n, k):
    for bn in (8, 16):
        for bk in (256, 512, 1024):
            for nw in (1, 2, 4):
                if k % bk or nw * 32 > bn * bk // 32:
                    continue
                for split in (1, 2, 3, 4, 6, 8):
                    if split <= k // bk:
                        yield bn, bk, nw, split


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels.matvec import matvec_kernel, matvec_swiglu_kernel

    name, kind, n, k, bn, bk, nw, split = job
    try:
        if split == 0:  # the launch rule's kernel
            types = ["*fp32", "*u8", "*fp32"] if kind == "matvec" else ["*fp32", "*u8", "*u8", "*fp32"]
            c = compile_kernel("rule", matvec_kernel if kind == "matvec" else matvec_swiglu_kernel, types,
                               {"N": n, "K": k, "GROUP": GROUP, "BLOCK_N": bn, "BLOCK_K": bk, "PDL_LATE": False}, nw, 90, [True] * len(types))
        else:
            types = ["*fp32", "*u8", "*u8", "*fp32", "*fp32", "*i32"]
            c = compile_kernel("splitk", matvec_splitk_kernel, types,
                               {"N": n, "K": k, "GROUP": GROUP, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split,
                                "PAIR": kind == "swiglu"}, nw, 90, [True] * len(types))
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is skipped
        return None, f"{job}: {type(e).__name__}: {str(e)[:200]}"
    return (job, c.name, c.cubin, c.shared), None


def compile_all(folder):
    from kestrel.kernels.matvec import matvec_launch
    from kestrel.kernels.targets import TARGETS

    os.makedirs(folder, exist_ok=True)
    jobs = []
    for name, (kind, n, k) in SHAPES.items():
        r = matvec_launch(n, k, GROUP, TARGETS["sm_90"], pair=kind == "swiglu")
        jobs.append((name, kind, n, k, r["constexprs"]["BLOCK_N"], r["constexprs"]["BLOCK_K"], r["num_warps"], 0))
        jobs += [(name, kind, n, k, *v) for v in variants(n, k)]
    index = []
    with ProcessPoolExecutor(2) as ex:
        for res, err in ex.map(_compile, jobs):
            if err:
                print("skip", err)
                continue
            (name, kind, n, k, bn, bk, nw, split), fn, cubin, shared = res
            f = f"{name}-{bn}-{bk}-{nw}-{split}.cubin"
            open(os.path.join(folder, f), "wb").write(cubin)
            index.append(dict(shape=name, kind=kind, N=n, K=k, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, SPLIT=split,
                              name=fn, cubin=f, shared=shared))
    json.dump(index, open(os.path.join(folder, "index.json"), "w"), indent=1)
    print(len(index), "variants")


def time_all(folder, out):
    import math
    import statistics

    import torch

    from graph_timing import launch_times_us, rotating_copies
    from kestrel.kernels.matvec import matvec_ref, q4_pack, q4_unpack
    from kestrel.runtime import cuda as kc

    torch.zeros(1, device="cuda")
    kc.init(0)
    index = json.load(open(os.path.join(folder, "index.json")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    data, rows = {}, []
    part = torch.zeros(8 * 2 * 20000, device="cuda")
    tickets = torch.zeros(4096, dtype=torch.int32, device="cuda")
    for e in index:
        key, n, k = e["shape"], e["N"], e["K"]
        pair = e["kind"] == "swiglu"
        if key not in data:
            ws = [torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k) for _ in range(2 if pair else 1)]
            bufs = [q4_pack(w, GROUP) for w in ws]
            deq = [q4_unpack(b, n, k, GROUP) for b in bufs]
            x = torch.randn(k, generator=gen, device="cuda")
            ref = (matvec_ref(x, deq[0]) if not pair else
                   torch.nn.functional.silu(matvec_ref(x, deq[0])) * matvec_ref(x, deq[1]))
            nbytes = sum(b.numel() for b in bufs)
            copies = rotating_copies(nbytes)
            sets = [[b if i == 0 else b.clone() for b in bufs] for i in range(copies)]
            data[key] = (x, sets, ref, nbytes)
        x, sets, ref, nbytes = data[key]
        kern = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["name"], e["num_warps"], e["shared"])
        y = torch.empty(n, device="cuda")
        if e["SPLIT"] == 0:
            grid = [(n + e["BLOCK_N"] - 1) // e["BLOCK_N"], 1, 1]
            types = ["*fp32"] + ["*u8"] * len(sets[0]) + ["*fp32"]
            packed = [kc.PackedArgs(types, [x.data_ptr()] + [b.data_ptr() for b in s] + [y.data_ptr()]) for s in sets]
        else:
            grid = [(n + e["BLOCK_N"] - 1) // e["BLOCK_N"], e["SPLIT"], 1]
            types = ["*fp32", "*u8", "*u8", "*fp32", "*fp32", "*i32"]
            packed = [kc.PackedArgs(types, [x.data_ptr(), s[0].data_ptr(), s[-1].data_ptr(), y.data_ptr(),
                                            part.data_ptr(), tickets.data_ptr()]) for s in sets]
        y.zero_()
        kc.launch(kern, grid, packed[0], 0)
        torch.cuda.synchronize()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        times = launch_times_us(kern, grid, packed, replays=8)
        y2 = y.clone()
        kc.launch(kern, grid, packed[0], 0)
        torch.cuda.synchronize()
        repeat = bool(torch.equal(y, y2)) and int(tickets.abs().sum()) == 0
        us = statistics.median(times)
        r = dict(e, us=us, GBps=nbytes / us / 1e3, err=err, repeat=repeat)
        rows.append(r)
        print(f"{key:12} BN={e['BLOCK_N']:2} BK={e['BLOCK_K']:4} nw={e['num_warps']} S={e['SPLIT']} {us:8.2f} us "
              f"{r['GBps']:6.0f} GB/s err {err:.1e}{'' if repeat else ' NOT REPEATABLE'}", flush=True)
    json.dump(rows, open(out, "w"), indent=1)
    print("\nper shape: the rule's kernel, then the best three split-K variants")
    for key in dict.fromkeys(r["shape"] for r in rows):
        rs = [r for r in rows if r["shape"] == key]
        rule = [r for r in rs if r["SPLIT"] == 0]
        best = sorted((r for r in rs if r["SPLIT"] and r["err"] < 1e-3 and r["repeat"]), key=lambda r: r["us"])[:3]
        for r in rule + best:
            print(f"{key:12} BN={r['BLOCK_N']:2} BK={r['BLOCK_K']:4} nw={r['num_warps']} S={r['SPLIT']} "
                  f"{r['us']:8.2f} us {r['GBps']:6.0f} GB/s{' (rule)' if not r['SPLIT'] else ''}")


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
