"""The M-row projections at a verify step's few rows: kernels/matvec.py's few-rows matvec
(matvec_rows_kernel, matvec_rows_swiglu_kernel) over tile / warp configurations around the one-row
matvec's launch rule, against the skinny-tile GEMM the M-row step ran before (gemm_launch's pick), and
the one-row matvec alone (the M = 1 step's kernel), at the 27B and 0.8B shapes, bf16 and q4 g128.

Here:            python bench/rows_sweep.py compile bench/rows-sweep
On the device:   cd bench && python3 rows_sweep.py time rows-sweep $OUT/rows-sweep.json
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import sys

CASES = [("27b in_proj_qkv+z+b+a", 16480, 5120, False), ("27b attn qkv", 14336, 5120, False),
         ("27b out_proj", 5120, 6144, False), ("27b mlp down", 5120, 17408, False),
         ("27b mlp gate+up", 17408, 5120, True), ("0.8b in_proj", 6144, 1024, False),
         ("0.8b mlp gate+up", 3584, 1024, True), ("0.8b mlp down", 1024, 3584, False)]
ROWS = (4, 2)
GROUPS = (0, 128)
# (BLOCK_N, BLOCK_K, warps) besides the rule's pick: around the one-row rule's bf16 and q4 configurations
CONFIGS = {0: [(8, 512, 2), (16, 512, 4), (8, 1024, 4), (16, 256, 4), (4, 1024, 2), (16, 1024, 8), (8, 256, 2),
               (4, 512, 1)],
           128: [(16, 512, 1), (16, 512, 2), (8, 1024, 4), (8, 2048, 4), (16, 1024, 4), (4, 1024, 4), (8, 512, 2),
                 (16, 512, 4)]}


def _jobs():
    from kestrel.kernels.gemm import gemm_launch
    from kestrel.kernels.matvec import matvec_launch, matvec_rows_launch
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    for (name, n, k, pair), m, group in itertools.product(CASES, ROWS, GROUPS):
        rule = matvec_rows_launch(m, n, k, group, t, pair=pair)
        rc = rule["constexprs"]
        yield name, n, k, pair, m, group, "gemm", gemm_launch(m, n, k, group, t, swiglu=pair)
        if m == ROWS[0]:
            yield name, n, k, pair, 1, group, "matvec", matvec_launch(n, k, group, t, pair=pair)
        rule_cfg = (rc["BLOCK_N"], rc["BLOCK_K"], rule["num_warps"])
        for bn, bk, nw in [rule_cfg] + [c for c in CONFIGS[group] if c != rule_cfg]:
            if bk > max(256, 2 * k):
                continue
            if m != ROWS[0] and (bn, bk, nw) != rule_cfg:
                continue  # other row counts: the rule's configuration only
            c = dict(rc, BLOCK_N=bn, BLOCK_K=bk)
            yield name, n, k, pair, m, group, "rows", {"grid": [-(-n // bn), rule["grid"][1], 1], "num_warps": nw,
                                                      "constexprs": c, "rule": (bn, bk, nw) == rule_cfg}


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels import gemm, matvec

    name, n, k, pair, m, group, kind, launch = job
    jit = {("gemm", False): gemm.gemm_kernel, ("gemm", True): gemm.gemm_swiglu_kernel,
           ("matvec", False): matvec.matvec_kernel, ("matvec", True): matvec.matvec_swiglu_kernel,
           ("rows", False): matvec.matvec_rows_kernel, ("rows", True): matvec.matvec_rows_swiglu_kernel}[kind, pair]
    wt = "*u8" if group else "*bf16"
    types = ["*fp32", wt] + ([wt] if pair else []) + ["*fp32"]
    try:
        ck = compile_kernel(kind, jit, types, launch["constexprs"], launch["num_warps"], 90, [True] * len(types))
    except Exception as e:  # noqa: BLE001 - a configuration that does not compile is skipped
        return None, f"skip {name} {kind} {launch['constexprs']}: {type(e).__name__}"
    return (ck, launch), None


def _describe(job, ck, launch) -> dict:
    name, n, k, pair, m, group, kind, _ = job
    c = launch["constexprs"]
    return {"shape": name, "M": m, "N": n, "K": k, "pair": pair, "group": group, "kind": kind,
            "rule": launch.get("rule", True), "BLOCK_N": c["BLOCK_N"], "BLOCK_K": c["BLOCK_K"],
            "BLOCK_M": c.get("BLOCK_M")}


def compile_all(folder: str) -> None:
    from cubin_folder import compile_to_folder

    compile_to_folder(folder, list(_jobs()), _compile, _describe, prefix="r")


def time_all(folder: str, out: str) -> None:
    import torch

    from graph_timing import launch_times_us, rotating_copies
    from kestrel.artifacts.errors import DeviceError
    from kestrel.kernels.matvec import matvec_ref, matvec_swiglu_ref, q4_pack, q4_unpack
    from kestrel.runtime import cuda as kc

    rows, operands = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    stream = torch.cuda.current_stream().cuda_stream
    for e in json.load(open(os.path.join(folder, "index.json"))):
        n, k, group, pair = e["N"], e["K"], e["group"], e["pair"]
        key = (e["shape"], group)
        if key not in operands:
            x = torch.randn(max(ROWS), k, device="cuda", generator=g)
            ws, refs = [], []
            for _ in range(2 if pair else 1):
                wf = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
                w = q4_pack(wf, group) if group else wf.to(torch.bfloat16)
                ws.append(w)
                refs.append(q4_unpack(w, n, k, group) if group else w)
            ref = matvec_swiglu_ref(x, *refs) if pair else matvec_ref(x, refs[0])
            nbytes = sum(v.numel() * v.element_size() for v in ws)
            copies = [[v.clone() for v in ws] for _ in range(rotating_copies(nbytes) - 1)]
            operands = {key: (x, [ws] + copies, ref, nbytes)}  # one shape's operands at a time
        x, wsets, ref, nbytes = operands[key]
        m = e["M"]
        y = torch.full((m, n), float("nan"), device="cuda")
        try:
            kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"],
                               e["shared"])
        except DeviceError:  # more shared memory than a CTA may have: not a candidate
            continue
        sets = [kc.PackedArgs(e["params"], [x.data_ptr()] + [v.data_ptr() for v in ws] + [y.data_ptr()])
                for ws in wsets]
        kc.launch(kernel, e["grid"], sets[0], stream)
        torch.cuda.synchronize()
        err = ((y - ref[:m]).abs().max() / ref[:m].abs().max()).item()
        us = statistics.median(launch_times_us(kernel, e["grid"], sets, replays=7, launches=32))
        rows.append({**{k2: e[k2] for k2 in ("shape", "M", "group", "kind", "rule", "BLOCK_N", "BLOCK_K", "BLOCK_M",
                                              "num_warps", "shared")},
                     "us": us, "max_rel_err": err, "weight_GBps": nbytes / us / 1e3})
    best = {}
    for r in rows:
        key = (r["shape"], r["M"], r["group"], r["kind"])
        if r["max_rel_err"] < (2e-2 if r["kind"] == "gemm" else 1e-4) and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    rule = {(r["shape"], r["M"], r["group"]): r for r in rows if r["kind"] == "rows" and r["rule"]}
    for (shape, m, group, kind), r in sorted(best.items()):
        if kind != "rows":
            continue
        gm = best.get((shape, m, group, "gemm"), {}).get("us", float("nan"))
        one = best.get((shape, 1, group, "matvec"), {}).get("us", float("nan"))
        ru = rule.get((shape, m, group), {}).get("us", float("nan"))
        print(f"{shape:<22} M={m} {'q4' if group else 'bf16':<4} rows best {r['BLOCK_N']}x{r['BLOCK_K']} w{r['num_warps']} "
              f"{r['us']:7.1f} us {r['weight_GBps']:5.0f} GB/s | rule {ru:7.1f} | gemm {gm:7.1f} | matvec M=1 {one:7.1f}")
    json.dump({"rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
