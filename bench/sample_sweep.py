"""Launch-configuration sweep for the greedy path of the sample kernel at the Qwen3.5 vocabulary.
(The recorded run, bench/results/tuning/sample-sweep-h200.json, also tried software-pipelining the
greedy loop, STAGES=3: slower everywhere, so the kernel does not pipeline; its STAGES=1 rows are
what this script measures now.)

Here:            python bench/sample_sweep.py compile DIR
On the device:   python3 bench/sample_sweep.py time DIR $OUT/sample-sweep.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys

V = 248320
TYPES = ["*fp32", "*fp32", "*fp32", "*i32", "*i32", "*i32"]
VARIANTS = [(bk, nw) for bk in (2048, 4096, 8192, 16384) for nw in (8, 16, 32) if bk >= nw * 32 * 4]


def compile_all(folder):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels.sample import sample_kernel

    os.makedirs(folder, exist_ok=True)
    index = []
    for bk, nw in VARIANTS:
        c = compile_kernel("sample", sample_kernel, TYPES, {"V": V, "BLOCK": bk}, nw, 90, [True] * 6)
        f = f"sample-{bk}-{nw}.cubin"
        open(os.path.join(folder, f), "wb").write(c.cubin)
        index.append(dict(BLOCK=bk, num_warps=nw, name=c.name, cubin=f, shared=c.shared))
    json.dump(index, open(os.path.join(folder, "index.json"), "w"), indent=1)
    print(len(index), "variants")


def time_all(folder, out):
    import torch

    from graph_timing import launch_times_us
    from kestrel.runtime import cuda as kc

    torch.zeros(1, device="cuda")
    kc.init(0)
    logits = torch.randn(V, device="cuda")
    want = int(torch.argmax(logits))
    t, p, sd, ps, res = (torch.zeros(1, device="cuda"), torch.ones(1, device="cuda"),
                         torch.zeros(1, dtype=torch.int32, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda"),
                         torch.zeros(1, dtype=torch.int32, device="cuda"))
    rows = []
    for e in json.load(open(os.path.join(folder, "index.json"))):
        k = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["name"], e["num_warps"], e["shared"])
        args = kc.PackedArgs(TYPES, [x.data_ptr() for x in (logits, t, p, sd, ps, res)])
        kc.launch(k, [1, 1, 1], args, 0)
        torch.cuda.synchronize()
        ok = int(res.item()) == want
        times = launch_times_us(k, [1, 1, 1], [args], replays=8)
        rows.append(dict(e, us=statistics.median(times), correct=ok))
        print(f"BLOCK={e['BLOCK']:5} warps={e['num_warps']:2} {rows[-1]['us']:7.2f} us ok={ok}")
    json.dump(rows, open(out, "w"), indent=1)


if __name__ == "__main__":
    compile_all(sys.argv[2]) if sys.argv[1] == "compile" else time_all(sys.argv[2], sys.argv[3])
