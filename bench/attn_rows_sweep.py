"""The M-row attention kernel (kernels/attention.py attn_rows_q_kernel) at a verify's few rows and the 27B
head shape (24 query / 4 kv heads of 256, bf16 caches, max_seq 4096): the launch rule's sequence split
against no split and other split sizes, at several context positions, each checked against
attn_rows_q_ref on the device and timed chained as the step's graph chains it (caches rotated over copies
larger than L2, as in the step, where other layers' weights evict them).

Here:            python bench/attn_rows_sweep.py compile bench/attn-rows-sweep
On the device:   cd bench && python3 attn_rows_sweep.py time attn-rows-sweep $OUT/attn-rows.json
(KESTREL_ATTN_POS="64 1000": the positions; KESTREL_SWEEP_QUICK=1: one launch each, for ncu)
"""
from __future__ import annotations

import json
import os
import statistics
import sys

NH, NKV, D, S = 24, 4, 256, 4096
W = NH * 2 * D + 2 * NKV * D
ROWS = (4, 8, 16)
POSITIONS = tuple(int(p) for p in os.environ.get("KESTREL_ATTN_POS", "64 1000 4000").split())
SPLIT_TILES = (None, 1, 2, 4)  # None: SPLITS = 1 (the kernel before the split); else split_tiles x BLOCK_N rows
# at 4 rows, the rule's launch with these changed (the fixed cost at a short context): (name, constexprs, warps)
TWEAKS = [("8 warps", {}, 8), ("BLOCK_N 64", {"BLOCK_N": 64}, None), ("no pipeline", {"PIPE_BYTES": 0}, None),
          ("BLOCK_N 16", {"BLOCK_N": 16}, None)]
EPS, THETA, ROTARY = 1e-6, 1e7, 64


def _jobs():
    import dataclasses

    from kestrel.kernels.attention import attn_rows_q_launch
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    for m in ROWS:
        for st in SPLIT_TILES:
            rules = dict(t.rules)
            rules["attn_rows"] = dataclasses.replace(rules["attn_rows"], **(
                {"max_splits": 1} if st is None else {"split_tiles": st}))
            c = attn_rows_q_launch(m, W, NH, NKV, D, S, dataclasses.replace(t, rules=rules))
            yield m, st, c
    for name, consts, warps in TWEAKS:
        c = attn_rows_q_launch(4, W, NH, NKV, D, S, t)
        c["constexprs"] = {**c["constexprs"], **consts, "SPLIT_ROWS": c["constexprs"]["SPLIT_ROWS"]}
        c["num_warps"] = warps or c["num_warps"]
        yield 4, name, c


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels.attention import attn_rows_q_kernel

    m, st, launch = job
    types = ["*fp32", "*fp32", "*bf16", "*bf16", "*i32", "*i32", "*fp32", "*i32", "*fp32",
             "i32", "i32", "fp32", "fp32", "i32", "fp32"]
    try:
        ck = compile_kernel("attn_rows_q_bf16", attn_rows_q_kernel, types, launch["constexprs"], launch["num_warps"],
                            90, [t.startswith("*") for t in types])
    except Exception as e:  # noqa: BLE001
        return None, f"skip M={m} split_tiles={st}: {type(e).__name__} {str(e)[:300]}"
    return (ck, launch), None


def _describe(job, ck, launch) -> dict:
    m, st, _ = job
    c = launch["constexprs"]
    return {"M": m, "split_tiles": st, "SPLITS": c["SPLITS"], "SPLIT_ROWS": c["SPLIT_ROWS"], "BLOCK_R": c["BLOCK_R"],
            "BLOCK_N": c["BLOCK_N"]}


def compile_all(folder: str) -> None:
    from cubin_folder import compile_to_folder

    compile_to_folder(folder, list(_jobs()), _compile, _describe, prefix="a")


def time_all(folder: str, out: str) -> None:
    import torch

    from graph_timing import chain_times_us, rotating_copies
    from kestrel.kernels.attention import attn_rows_q_ref, attn_rows_scratch
    from kestrel.runtime import cuda as kc

    g = torch.Generator(device="cuda").manual_seed(0)
    kc_, vc_ = (torch.randn(S, NKV, D, device="cuda", generator=g).bfloat16() for _ in range(2))
    copies = [(kc_, vc_)] + [(kc_.clone(), vc_.clone()) for _ in range(rotating_copies(2 * kc_.numel() * 2) - 1)]
    x = torch.randn(max(ROWS), W, device="cuda", generator=g)
    qn = 0.1 * torch.randn(D, device="cuda", generator=g)
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    index = json.load(open(os.path.join(folder, "index.json")))
    kf, vf = kc_.float().cpu(), vc_.float().cpu()
    for pos in POSITIONS:
        for e in index:
            m = e["M"]
            xm = x[:m].contiguous()
            posb = torch.tensor([pos], dtype=torch.int32, device="cuda")
            npb = torch.tensor([pos + m], dtype=torch.int32, device="cuda")
            ref = attn_rows_q_ref(xm.cpu(), qn.cpu(), kf, vf, pos, pos + m, 0, NH, EPS, THETA, ROTARY,
                                  D ** -0.5).cuda()
            kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"],
                               e["shared"])
            pshape, tshape = attn_rows_scratch({"grid": e["grid"], "constexprs": {"BLOCK_R": e["BLOCK_R"]}}, D)
            part = torch.zeros(pshape, device="cuda")
            tickets = torch.zeros(tshape, dtype=torch.int32, device="cuda")
            outs = [torch.full((m, NH * D), float("nan"), device="cuda") for _ in copies]
            sets = [kc.PackedArgs(e["params"], [xm.data_ptr(), qn.data_ptr(), k.data_ptr(), v.data_ptr(),
                                                posb.data_ptr(), npb.data_ptr(), part.data_ptr(), tickets.data_ptr(),
                                                o.data_ptr(), 0, NH, EPS, THETA, ROTARY, D ** -0.5])
                    for (k, v), o in zip(copies, outs)]
            kc.launch(kernel, e["grid"], sets[0], stream)
            torch.cuda.synchronize()
            err = ((outs[0] - ref).abs().max() / ref.abs().max()).item()
            again = outs[0].clone()
            kc.launch(kernel, e["grid"], sets[0], stream)
            torch.cuda.synchronize()
            reps = (1, 1) if os.environ.get("KESTREL_SWEEP_QUICK") == "1" else (7, 64)  # (under ncu)
            us = statistics.median(chain_times_us(kernel, e["grid"], sets, replays=reps[0], launches=reps[1]))
            r = {**e, "pos": pos, "us": us, "rel_err": err, "repeatable": torch.equal(again, outs[0]),
                 "tickets_zero": bool((tickets == 0).all().item())}
            rows.append(r)
            print(f"pos {pos:>5} M={m:<2} split_tiles {str(e['split_tiles']):>4} grid {e['grid']} {us:8.2f} us "
                  f"err {err:.1e} repeatable {r['repeatable']} tickets 0 {r['tickets_zero']}", flush=True)
    for r in rows:
        if isinstance(r["split_tiles"], str):
            print(f"pos {r['pos']:>5} M=4 {r['split_tiles']:<12} {r['us']:8.2f} us")
    print("\n  pos   M   no split   " + "   ".join(f"tiles {t}" for t in SPLIT_TILES[1:]))
    for pos in POSITIONS:
        for m in ROWS:
            cells = {r["split_tiles"]: r["us"] for r in rows if r["pos"] == pos and r["M"] == m}
            print(f"{pos:>5} {m:>3} " + " ".join(f"{cells.get(t, float('nan')):9.2f}" for t in SPLIT_TILES))
    json.dump({"rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
