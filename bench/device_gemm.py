"""The M-row GEMM (kernels/gemm.py) on the H200: each shape against ``gemm_ref`` on the GPU, and its time
per launch as a fraction of the bf16 tensor-core rate measured in the same run (torch.matmul, 8192^3,
random data).

Here:            python bench/device_gemm.py compile bench/gemm-cubins
On the device:   python3 bench/device_gemm.py time bench/gemm-cubins $OUT/gemm-h200.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys

SHAPES = {  # (N, K) of projections at the Qwen3.5 27B and 0.8B shapes
    "27b in_proj_qkv+z+b+a": (16480, 5120), "27b out_proj": (5120, 6144), "27b mlp gate": (17408, 5120),
    "27b mlp down": (5120, 17408), "0.8b in_proj": (6144, 1024), "0.8b mlp down": (1024, 3584),
}
ROWS = (128, 256, 512)
GROUPS = (0, 128)


def compile_all(folder: str) -> None:
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels.gemm import gemm_kernel, gemm_launch
    from kestrel.kernels.targets import TARGETS

    os.makedirs(folder, exist_ok=True)
    index = []
    for name, (n, k) in SHAPES.items():
        for m in ROWS:
            for group in GROUPS:
                c = gemm_launch(m, n, k, group, TARGETS["sm_90"])
                ck = compile_kernel("gemm", gemm_kernel, ["*fp32", "*u8" if group else "*bf16", "*fp32"],
                                    c["constexprs"], c["num_warps"], 90, [True] * 3)
                f = f"gemm-{len(index):03d}.cubin"
                open(os.path.join(folder, f), "wb").write(ck.cubin)
                index.append({"shape": name, "M": m, "N": n, "K": k, "group": group, "grid": c["grid"],
                              "constexprs": c["constexprs"], "num_warps": ck.num_warps, "shared": ck.shared,
                              "entry": ck.name, "cubin": f, "params": [t for _, t in ck.params]})
                print(f"compiled {name} M={m} group={group}", flush=True)
    json.dump(index, open(os.path.join(folder, "index.json"), "w"), indent=1)


def tensor_core_rate() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * 8192 ** 3 / statistics.median(times)


def time_all(folder: str, out: str) -> None:
    import torch

    from graph_timing import launch_times_us
    from kestrel.kernels.gemm import gemm_ref
    from kestrel.kernels.matvec import q4_pack
    from kestrel.runtime import cuda as kc

    rate = tensor_core_rate()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for e in json.load(open(os.path.join(folder, "index.json"))):
        m, n, k, group = e["M"], e["N"], e["K"], e["group"]
        x = torch.randn(m, k, device="cuda", generator=g)
        wf = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
        w = q4_pack(wf, group) if group else wf.to(torch.bfloat16)
        y = torch.full((m, n), float("nan"), device="cuda")
        kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"],
                           e["shared"])
        args = kc.PackedArgs(e["params"], [x.data_ptr(), w.data_ptr(), y.data_ptr()])
        kc.launch(kernel, e["grid"], args, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        ref = gemm_ref(x, w, group)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        us = statistics.median(launch_times_us(kernel, e["grid"], [args], replays=10, launches=32))
        flops = 2 * m * n * k / (us / 1e6)
        rows.append({**{key: e[key] for key in ("shape", "M", "N", "K", "group", "constexprs", "num_warps")},
                     "max_rel_err": err, "finite": bool(torch.isfinite(y).all()), "us": us, "tflops": flops / 1e12,
                     "fraction_of_tensor_core_rate": flops / rate})
        print(f"{e['shape']:<24} M={m:<4} {'q4' if group else 'bf16':<4} err {err:.1e}  {us:8.1f} us  "
              f"{flops / 1e12:6.1f} TFLOP/s  {flops / rate:6.1%}", flush=True)
    json.dump({"bf16_tensor_core_tflops": rate / 1e12, "rows": rows}, open(out, "w"), indent=1)
    print(f"bf16 tensor-core rate (torch.matmul 8192^3): {rate / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
