"""Launch-configuration sweep of the M-row GEMM (kernels/gemm.py): tile sizes and warps at the Qwen3.5
27B / 0.8B projection shapes, bf16 and q4, for the launch rule in gemm_launch.

Here:            python bench/gemm_sweep.py compile bench/gemm-sweep
On the device:   cd bench && python3 gemm_sweep.py time gemm-sweep $OUT/gemm-sweep.json
GEMM_SET=small (both steps): the verify step's few rows (M = 4) with 16-row tiles, narrow N tiles and
1-8 warps, at the 27B shapes (issue 12: the M-row step at k + 1 rows against the one-token step).
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import sys

CASES = [("27b in_proj_qkv+z+b+a", 16480, 5120), ("27b out_proj", 5120, 6144), ("27b mlp down", 5120, 17408),
         ("0.8b in_proj", 6144, 1024)]
ROWS = (128, 512)
GROUPS = (0, 128)
CONFIGS = [(bm, bn, bk, nw) for bm, bn, bk, nw in itertools.product((64, 128), (64, 128, 256), (64, 128), (4, 8))
           if not (bm == 64 and bn == 64 and nw == 8)]
SWIGLU = os.environ.get("GEMM_SET") == "small-swiglu"
if os.environ.get("GEMM_SET", "").startswith("small"):
    CASES = [("27b in_proj_qkv+z+b+a", 16480, 5120), ("27b attn qkv", 14336, 5120), ("27b out_proj", 5120, 6144),
             ("27b mlp down", 5120, 17408), ("27b mlp gate", 17408, 5120)]
    ROWS = (4,)
    CONFIGS = [(16, bn, bk, nw) for bn, bk, nw in itertools.product((16, 32, 64, 128), (64, 128, 256), (1, 2, 4, 8))
               if nw * 32 <= bn * bk // 8]
if SWIGLU:
    CASES = [("27b mlp gate+up", 17408, 5120)]


def compile_all(folder: str) -> None:
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels.gemm import gemm_kernel, gemm_swiglu_kernel

    os.makedirs(folder, exist_ok=True)
    index = []
    for (name, n, k), m, group in itertools.product(CASES, ROWS, GROUPS):
        for bm, bn, bk, nw in CONFIGS:
            consts = {"M": m, "N": n, "K": k, "GROUP": group, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                      "DOT_FP32": False}
            try:
                wt = "*u8" if group else "*bf16"
                ck = compile_kernel("gemm", gemm_swiglu_kernel if SWIGLU else gemm_kernel,
                                    ["*fp32", wt, wt, "*fp32"] if SWIGLU else ["*fp32", wt, "*fp32"], consts, nw, 90,
                                    [True] * (4 if SWIGLU else 3))
            except Exception as e:  # noqa: BLE001 - a configuration that does not compile is skipped
                print(f"skip {name} M={m} {consts}: {type(e).__name__}", flush=True)
                continue
            f = f"g{len(index):04d}.cubin"
            open(os.path.join(folder, f), "wb").write(ck.cubin)
            grid = -(-m // bm) * -(-n // bn)
            index.append({"shape": name, "M": m, "N": n, "K": k, "group": group, "grid": [grid, 1, 1],
                          "constexprs": consts, "num_warps": ck.num_warps, "shared": ck.shared, "entry": ck.name,
                          "cubin": f, "params": [t for _, t in ck.params]})
        print(f"compiled {name} M={m} group={group}", flush=True)
    json.dump(index, open(os.path.join(folder, "index.json"), "w"), indent=1)
    print(len(index), "kernels")


def time_all(folder: str, out: str) -> None:
    import torch

    from device_gemm import tensor_core_rate
    from graph_timing import launch_times_us
    from kestrel.kernels.gemm import gemm_ref, gemm_swiglu_ref
    from kestrel.kernels.matvec import q4_pack
    from kestrel.artifacts.errors import DeviceError
    from kestrel.runtime import cuda as kc

    rate = tensor_core_rate()
    rows, operands = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for e in json.load(open(os.path.join(folder, "index.json"))):
        m, n, k, group = e["M"], e["N"], e["K"], e["group"]
        key = (m, n, k, group)
        if key not in operands:
            x = torch.randn(m, k, device="cuda", generator=g)
            ws = []
            for _ in range(2 if SWIGLU else 1):
                wf = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
                ws.append(q4_pack(wf, group) if group else wf.to(torch.bfloat16))
            ref = gemm_swiglu_ref(x, *ws, group) if SWIGLU else gemm_ref(x, ws[0], group)
            operands = {key: (x, ws, ref)}  # one shape's operands at a time
        x, ws, ref = operands[key]
        w = ws[0]
        y = torch.full((m, n), float("nan"), device="cuda")
        try:
            kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"],
                               e["shared"])
        except DeviceError:  # more shared memory than a CTA may have: not a candidate
            continue
        args = kc.PackedArgs(e["params"], [x.data_ptr()] + [v.data_ptr() for v in ws] + [y.data_ptr()])
        kc.launch(kernel, e["grid"], args, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        us = statistics.median(launch_times_us(kernel, e["grid"], [args], replays=7, launches=16))
        c = e["constexprs"]
        rows.append({"shape": e["shape"], "M": m, "group": group, "BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"],
                     "BLOCK_K": c["BLOCK_K"], "num_warps": e["num_warps"], "shared": e["shared"], "us": us,
                     "max_rel_err": err, "fraction_of_tensor_core_rate": 2 * m * n * k / (us / 1e6) / rate,
                     "weight_GBps": sum(v.numel() * v.element_size() for v in ws) / us / 1e3})
    best = {}
    for r in rows:
        key = (r["shape"], r["M"], r["group"])
        if r["max_rel_err"] < 1e-4 and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    for (shape, m, group), r in sorted(best.items()):
        print(f"{shape:<24} M={m:<4} {'q4' if group else 'bf16':<4} best {r['BLOCK_M']}x{r['BLOCK_N']}x{r['BLOCK_K']} "
              f"w{r['num_warps']}: {r['us']:8.1f} us {r['fraction_of_tensor_core_rate']:6.1%} {r['weight_GBps']:6.0f} GB/s")
    json.dump({"bf16_tensor_core_tflops": rate / 1e12, "rows": rows,
               "best": [dict(r) for r in best.values()]}, open(out, "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
