"""The one-token attention kernel (kernels/attention.py attn_step_kernel) at the decode head shapes, where the
step's profile puts it at 14-16 us a layer at a short context (bench/results/stop34/call8: 0.8B 14.1, 27B 16.2,
80B-A3B 14.9 us in the graph, against 1-5 us for the GDN kernels next to it): the launch rule's configuration
and variants of its split, warps and pipeline, each checked against attn_step_ref on the device and timed
chained with programmatic edges as the step's graph chains it (caches rotated over copies larger than L2).

Here:            python bench/attn_step_probe.py compile bench/attn-step-probe
On the device:   cd bench && python3 attn_step_probe.py time attn-step-probe $OUT/attn-step.json
(KESTREL_ATTN_POS="44 1000": the positions; KESTREL_SWEEP_QUICK=1: one launch each, for ncu;
KESTREL_ATTN_ONLY="0.8b:rule": one configuration)
Under ncu's source counters: python3 attn_step_probe.py ncu-summary source.csv (``ncu -i REP --page source --csv
--print-source sass``): the sampled stalls and executed instructions per 128-instruction stretch of the SASS, and
the 30 most sampled instructions.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

SHAPES = {"0.8b": (8, 2), "27b": (24, 4), "80b-a3b": (16, 2)}  # query / kv heads, head_dim 256
D, S = 256, int(os.environ.get("KESTREL_ATTN_S", "8192"))
POSITIONS = tuple(int(p) for p in os.environ.get("KESTREL_ATTN_POS", "44 100 1000 4000").split())
EPS, THETA, ROTARY = 1e-6, 1e7, 64
# the rule's launch with these changed: (name, constexprs, warps); "BLOCK_H" as a value: the launch's BLOCK_H
VARIANTS = [("rule", {}, None)]
# (stop 43's short16 / short32 / short64: one program a query head at short contexts, against the rule's grouped
# form; lost in stops 45-46 and removed, in this probe at commit 2e5c32b)
# (stop 37 call 1 timed EARLY, pos and its RoPE angles before the PDL wait; call 2 PREFETCH_ROWS, the split's first
# K / V rows asked of the L2: both gone, see bench/results/stop37/README.md)
TYPES = ["*fp32"] * 5 + ["*bf16"] * 2 + ["*i32", "*fp32", "*i32", "*fp32"] + ["fp32", "fp32", "i32", "fp32"]


def _jobs():
    from kestrel.kernels.attention import attn_splits, attn_step_launch
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    for model, (nh, nkv) in SHAPES.items():
        for name, consts, warps in VARIANTS:
            c = attn_step_launch(nh, nkv, D, S, attn_splits(nkv, S, t), "bf16", t)
            c["constexprs"] = {**c["constexprs"], **{k: c["constexprs"][v] if v == "BLOCK_H" else v
                                                     for k, v in consts.items()}}
            if "MERGE_SMALL" in c["constexprs"]:  # (a tree before the chunked combine: no MERGE_*)
                c["constexprs"]["MERGE_SMALL"] = min(c["constexprs"]["MERGE_SMALL"], c["constexprs"]["MERGE_CH"])
            c["num_warps"] = warps or c["num_warps"]
            yield model, name, c


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels.attention import attn_step_kernel

    model, name, launch = job
    try:
        ck = compile_kernel("attn_step_bf16", attn_step_kernel, TYPES, launch["constexprs"], launch["num_warps"], 90,
                            [t.startswith("*") for t in TYPES])
    except Exception as e:  # noqa: BLE001
        return None, f"skip {model} {name}: {type(e).__name__} {str(e)[:300]}"
    return (ck, launch), None


def _describe(job, ck, launch) -> dict:
    model, name, _ = job
    return {"model": model, "variant": name, **{k: launch["constexprs"][k] for k in ("NH", "NKV", "SPLITS", "BLOCK_S",
                                                                                     "SPLIT_ROWS", "PIPE_BYTES")}}


def compile_all(folder: str) -> None:
    from cubin_folder import compile_to_folder

    compile_to_folder(folder, list(_jobs()), _compile, _describe, prefix="a")


def time_all(folder: str, out: str) -> None:
    import torch

    from graph_timing import chain_times_us, rotating_copies
    from kestrel.kernels.attention import attn_step_ref
    from kestrel.runtime import cuda as kc

    quick = os.environ.get("KESTREL_SWEEP_QUICK") == "1"
    only = os.environ.get("KESTREL_ATTN_ONLY")  # "model:variant" (ncu)
    index = json.load(open(os.path.join(folder, "index.json")))
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    for model, (nh, nkv) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        kc_, vc_ = (torch.randn(S, nkv, D, device="cuda", generator=g).bfloat16() for _ in range(2))
        n_copies = 1 if quick else rotating_copies(2 * kc_.numel() * 2)
        copies = [(kc_, vc_)] + [(kc_.clone(), vc_.clone()) for _ in range(n_copies - 1)]
        qg = torch.randn(nh * 2 * D, device="cuda", generator=g)
        k, v = (torch.randn(nkv * D, device="cuda", generator=g) for _ in range(2))
        qn, kn = (0.1 * torch.randn(D, device="cuda", generator=g) for _ in range(2))
        for pos in POSITIONS:
            kr, vr = kc_.float().cpu().clone(), vc_.float().cpu().clone()
            ref = attn_step_ref(qg.cpu(), k.cpu(), v.cpu(), qn.cpu(), kn.cpu(), kr, vr, pos, EPS, THETA, ROTARY,
                                D ** -0.5).cuda().flatten()
            posb = torch.tensor([pos], dtype=torch.int32, device="cuda")
            for e in index:
                if e["model"] != model or (only and only != f"{model}:{e['variant']}"):
                    continue
                kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"],
                                   e["shared"])
                part = torch.zeros(nh, e["SPLITS"], D + 2, device="cuda")
                tickets = torch.zeros(nh, dtype=torch.int32, device="cuda")
                outs = [torch.full((nh * D,), float("nan"), device="cuda") for _ in copies]
                sets = [kc.PackedArgs(e["params"], [qg.data_ptr(), k.data_ptr(), v.data_ptr(), qn.data_ptr(),
                                                    kn.data_ptr(), kk.data_ptr(), vv.data_ptr(), posb.data_ptr(),
                                                    part.data_ptr(), tickets.data_ptr(), o.data_ptr(), EPS, THETA,
                                                    ROTARY, D ** -0.5])
                        for (kk, vv), o in zip(copies, outs)]
                kc.launch(kernel, e["grid"], sets[0], stream)
                torch.cuda.synchronize()
                err = ((outs[0] - ref).abs().max() / ref.abs().max()).item()
                reps = (1, 1) if quick else (7, 64)
                us = statistics.median(chain_times_us(kernel, e["grid"], sets, replays=reps[0], launches=reps[1]))
                r = {**e, "pos": pos, "us": us, "rel_err": err, "tickets_zero": bool((tickets == 0).all().item())}
                rows.append(r)
                print(f"{model:>8} pos {pos:>5} {e['variant']:<20} {us:8.2f} us  err {err:.1e}", flush=True)
    print(f"\n{'model':>8} {'variant':<20} " + " ".join(f"pos {p:>5}" for p in POSITIONS))
    for model in SHAPES:
        for name, _, _ in VARIANTS:
            cells = {r["pos"]: r["us"] for r in rows if r["model"] == model and r["variant"] == name}
            if cells:
                print(f"{model:>8} {name:<20} " + " ".join(f"{cells.get(p, float('nan')):9.2f}" for p in POSITIONS))
    json.dump({"rows": rows}, open(out, "w"), indent=1)


def ncu_summary(path: str) -> None:
    import csv

    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if any("Address" in c for c in r))
    cols, body = rows[head], [r for r in rows[head + 1:] if len(r) == len(rows[head])]

    def col(*names):
        return next(i for i, c in enumerate(cols) if all(n.lower() in c.lower() for n in names))

    a, src = col("Address"), col("Source")
    samp, ex = col("Warp Stall Sampling", "All"), col("Instructions Executed")

    def num(v):
        try:
            return float(v.replace(",", ""))
        except ValueError:
            return 0.0
    total = sum(num(r[samp]) for r in body) or 1.0
    print(f"{len(body)} instructions, {total:.0f} stall samples, {sum(num(r[ex]) for r in body):.0f} warp "
          f"instructions executed")
    buckets: dict[int, list[float]] = {}
    for r in body:
        b = buckets.setdefault(int(r[a], 16) // 2048, [0.0, 0.0])
        b[0] += num(r[samp])
        b[1] += num(r[ex])
    print("stretch (bytes)      samples   share   executed")
    for b, (s_, e) in sorted(buckets.items()):
        if s_ or e:
            print(f"{b * 2048:#07x}-{b * 2048 + 2047:#07x} {s_:9.0f} {s_ / total:7.1%} {e:10.0f}")
    print("most sampled:")
    for r in sorted(body, key=lambda r: -num(r[samp]))[:30]:
        print(f"{r[a]:>8} {num(r[samp]):7.0f} {num(r[samp]) / total:6.1%} {num(r[ex]):7.0f}  {r[src][:90]}")


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    elif sys.argv[1] == "ncu-summary":
        ncu_summary(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
