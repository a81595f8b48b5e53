"""A sweep's compiled kernels as a folder the device reads: every job compiled here in a process pool
(``compile_one(job)`` -> ((CompiledKernel, launch), None) or (None, message to print)), each cubin a file,
and ``index.json`` listing them with ``describe(job, kernel, launch)``'s fields plus the launch facts the
timing side needs (grid, num_warps, shared, entry, cubin, params)."""
from __future__ import annotations

import json
import multiprocessing
import os


def compile_to_folder(folder: str, jobs: list, compile_one, describe, prefix: str = "k") -> list[dict]:
    os.makedirs(folder, exist_ok=True)
    index = []
    with multiprocessing.get_context("fork").Pool(len(os.sched_getaffinity(0))) as pool:
        for job, (res, msg) in zip(jobs, pool.imap(compile_one, jobs, chunksize=4)):
            if res is None:
                print(msg, flush=True)
                continue
            ck, launch = res
            f = f"{prefix}{len(index):04d}.cubin"
            open(os.path.join(folder, f), "wb").write(ck.cubin)
            index.append({**describe(job, ck, launch), "grid": launch["grid"], "num_warps": ck.num_warps,
                          "shared": ck.shared, "entry": ck.name, "cubin": f, "params": [t for _, t in ck.params]})
    json.dump(index, open(os.path.join(folder, "index.json"), "w"), indent=1)
    print(len(index), "kernels")
    return index
