"""Launch-configuration sweep for the matvec kernels at real shapes (a tuning experiment).

Here (no GPU):   python bench/matvec_sweep.py compile DIR [SET]     # cubins + index.json
On the device:   python3 bench/matvec_sweep.py time DIR $OUT/sweep.json
SET: q4-27b (the first sweep: bench/results/tuning/q4-sweep-h200.json), small (0.8B and 4B shapes,
bf16 and q4), next (Qwen3-Next-80B-A3B's q4 matrices at hidden 2048), or q4-decode (every q4 matvec shape of the 0.8B, 9B and 27B decode steps: the f16x2
kernel of stop 18, whose rule was read off 5-12 configurations at 27B and 0.8B). Each variant (BLOCK_N, BLOCK_K, num_warps) is checked against the reference and timed
as in bench/device_kernels.py (a CUDA graph of launches rotating over copies larger than L2); the
report also names the variant the current launch rule picks.
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

SETS = {
    "q4-27b": {"in_proj": ("matvec", 16480, 5120, "q4"), "down": ("matvec", 5120, 17408, "q4"),
               "swiglu": ("matvec_swiglu", 17408, 5120, "q4"), "lm_head": ("matvec", 248320, 5120, "q4"),
               "attn_q": ("matvec", 12288, 5120, "q4"), "o_proj": ("matvec", 5120, 6144, "q4")},
    "small": {f"{m}-{name}-{dt}": (kind, n, k, dt) for dt in ("bf16", "q4")
              for m, shapes in (("0.8b", {"in_proj": ("matvec", 8224, 1024), "out": ("matvec", 1024, 2048),
                                          "swiglu": ("matvec_swiglu", 3584, 1024), "down": ("matvec", 1024, 3584),
                                          "lm_head": ("matvec", 248320, 1024)}),
                                ("4b", {"in_proj": ("matvec", 16448, 2560), "down": ("matvec", 2560, 9216)}))
              for name, (kind, n, k) in shapes.items()},
    # Qwen3-Next-80B-A3B's dense q4 matrices (hidden 2048): GDN in_proj, attention q|gate|k|v, out_proj / o_proj
    "next": {"in_proj": ("matvec", 12352, 2048, "q4"), "attn_qkv": ("matvec", 9216, 2048, "q4"),
             "out_proj": ("matvec", 2048, 4096, "q4"), "lm_head": ("matvec", 151936, 2048, "q4")},
}
GROUP = 128


def decode_q4_shapes(presets=("qwen3.5-0.8b", "qwen3.5-9b", "qwen3.5-27b")) -> dict:
    """Every distinct q4 matvec / matvec_swiglu (N, K) of these presets' decode steps, read off the
    planned sm_90 programs (so the fused projections' real widths)."""
    from kestrel.compiler.frontend import parse_config
    from kestrel.compiler.presets import QWEN35_SHAPES
    from kestrel.compiler.qwen3_5 import lower
    from kestrel.passes.pipeline import PassOptions, run_passes

    out = {}
    for preset in presets:
        p = run_passes(lower(parse_config(QWEN35_SHAPES[preset], preset), 64), PassOptions("sm_90", "q4"),
                       until="select_kernels")
        for op in p.ops:
            if op.kind in ("matmul", "matmul_swiglu") and op.launch["GROUP"]:
                kind = "matvec" if op.kind == "matmul" else "matvec_swiglu"
                n, k = op.ins[1].type.shape
                out.setdefault(f"{preset[8:]}-{kind}-{n}x{k}", (kind, n, k, "q4"))
    return out


def variants(dt):
    for bn in (1, 2, 4, 8, 16):
        for bk in (128, 256, 512, 1024, 2048, 4096):
            for nw in (1, 2, 4):
                per_chunk = 32 if dt == "q4" else 8  # inputs per thread per 16-byte load
                tile = bn * bk // 2 if dt == "q4" else bn * bk * 2
                if nw * 32 <= bn * bk // per_chunk and 1024 <= tile <= 32768 and (dt != "q4" or bk >= GROUP):
                    yield bn, bk, nw


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels.matvec import matvec_kernel, matvec_swiglu_kernel

    name, kind, n, k, dt, bn, bk, nw = job
    wt = "*u8" if dt == "q4" else "*bf16"
    types = ["*fp32", wt, "*fp32"] if kind == "matvec" else ["*fp32", wt, wt, "*fp32"]
    group = GROUP if dt == "q4" else 0
    consts = {"N": n, "K": k, "GROUP": group, "BLOCK_N": bn, "BLOCK_K": bk, "PDL_LATE": False}
    kid = f"{kind}_q4g{GROUP}" if dt == "q4" else f"{kind}_bf16"
    try:
        c = compile_kernel(kid, matvec_kernel if kind == "matvec" else matvec_swiglu_kernel, types, consts, nw, 90, [True] * len(types))
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is just skipped
        return None, f"{job}: {type(e).__name__}"
    return (name, kind, n, k, dt, bn, bk, nw, c.name, c.cubin, c.shared, c.global_scratch_size), None


def compile_all(folder, which="q4-27b"):
    from kestrel.kernels.matvec import matvec_launch
    from kestrel.kernels.targets import TARGETS

    os.makedirs(folder, exist_ok=True)
    shapes = decode_q4_shapes() if which == "q4-decode" else SETS[which]
    jobs = [(name, kind, n, k, dt, bn, bk, nw) for name, (kind, n, k, dt) in shapes.items()
            for bn, bk, nw in variants(dt)]
    index = []
    with ProcessPoolExecutor(2) as ex:
        for res, err in ex.map(_compile, jobs):
            if err:
                print("skip", err)
                continue
            name, kind, n, k, dt, bn, bk, nw, fn, cubin, shared, scratch = res
            f = f"{name}-{bn}-{bk}-{nw}.cubin"
            open(os.path.join(folder, f), "wb").write(cubin)
            rule = matvec_launch(n, k, GROUP if dt == "q4" else 0, TARGETS["sm_90"], pair=kind == "matvec_swiglu")
            is_rule = (rule["constexprs"]["BLOCK_N"], rule["constexprs"]["BLOCK_K"], rule["num_warps"]) == (bn, bk, nw)
            index.append(dict(shape=name, kind=kind, dtype=dt, N=n, K=k, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw,
                              name=fn, cubin=f, shared=shared, scratch=scratch, rule=is_rule))
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
    data = {}
    rows = []
    for e in index:
        key = e["shape"]
        if key not in data:
            n, k = e["N"], e["K"]
            ws = [torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k) for _ in range(2 if e["kind"] != "matvec" else 1)]
            if e["dtype"] == "q4":
                bufs = [q4_pack(w, GROUP) for w in ws]
                deq = [q4_unpack(b, n, k, GROUP) for b in bufs]
            else:
                bufs = [w.to(torch.bfloat16).contiguous() for w in ws]
                deq = [b.float() for b in bufs]
            x = torch.randn(k, generator=gen, device="cuda")
            # (matvec_ref: a q4 weight's product as the kernel defines it, fp16 lanes and all)
            ref = (matvec_ref(x, deq[0]) if len(deq) == 1 else
                   torch.nn.functional.silu(matvec_ref(x, deq[0])) * matvec_ref(x, deq[1]))
            nbytes = sum(b.numel() * b.element_size() for b in bufs)
            copies = rotating_copies(nbytes)
            sets = [[b if i == 0 else b.clone() for b in bufs] for i in range(copies)]
            data[key] = (x, sets, ref, nbytes)
        x, sets, ref, nbytes = data[key]
        kern = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["name"], e["num_warps"], e["shared"])
        y = torch.empty(e["N"], device="cuda")
        grid = [(e["N"] + e["BLOCK_N"] - 1) // e["BLOCK_N"], 1, 1]
        types = ["*fp32"] + ["*u8" if e["dtype"] == "q4" else "*bf16"] * len(sets[0]) + ["*fp32"]
        packed = [kc.PackedArgs(types, [x.data_ptr()] + [b.data_ptr() for b in s] + [y.data_ptr()]) for s in sets]
        kc.launch(kern, grid, packed[0], 0)
        torch.cuda.synchronize()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        times = launch_times_us(kern, grid, packed, replays=8)
        us = statistics.median(times)
        r = dict(e, us=us, GBps=nbytes / us / 1e3, err=err)
        rows.append(r)
        print(f"{key:22} BN={e['BLOCK_N']:2} BK={e['BLOCK_K']:4} nw={e['num_warps']} {us:9.2f} us {r['GBps']:7.0f} GB/s "
              f"err {err:.1e}{' (rule)' if e.get('rule') else ''}", flush=True)
    json.dump(rows, open(out, "w"), indent=1)
    print("\nbest per shape, and the launch rule's pick:")
    for key in dict.fromkeys(r["shape"] for r in rows):
        rs = sorted((r for r in rows if r["shape"] == key and r["err"] < 1e-4), key=lambda r: r["us"])
        for r in rs[:3] + [r for r in rs if r.get("rule")]:
            print(f"{key:22} BN={r['BLOCK_N']:2} BK={r['BLOCK_K']:4} nw={r['num_warps']} {r['us']:9.2f} us "
                  f"{r['GBps']:7.0f} GB/s{' (rule)' if r.get('rule') else ''}")


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2], *sys.argv[3:])
    else:
        time_all(sys.argv[2], sys.argv[3])
