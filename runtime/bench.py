"""``kestrel-run PLAN --bench`` and ``--verify`` on the GPU (numpy + cuda.bindings, no torch).

bench: interleaved A/B rounds in one process (graph off, graph on), ms/token per round, the paired
saving with its range (a gain is claimed only when the effect is at least 5x the paired range),
p50 / p99 per-token latency (device time of each decode step, from events between steps), first-request latency with the graph on and off (the graph is built at
load, so it must not fall inside the request), the bytes one step must move (the launch plan's
``step_bytes``, at the run's mean KV length) and that over the copy bandwidth measured in the same run.
verify: the same prompt in graph and streaming mode, every step's dumped logits and hidden states
compared byte for byte.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

from kestrel.artifacts.errors import DeviceError
from kestrel.runtime import cuda as kc
from kestrel.runtime.generate import SamplingParams, generate
from kestrel.runtime.gpu import GpuStep
from kestrel.runtime.launch_binding import bytes_per_step


def copy_bandwidth(stream, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (median of ``reps``)."""
    cu = kc.driver()
    a = kc.check(cu.cuMemAlloc(nbytes), "cuMemAlloc")
    b = kc.check(cu.cuMemAlloc(nbytes), "cuMemAlloc")
    start = kc.check(cu.cuEventCreate(0), "cuEventCreate")
    end = kc.check(cu.cuEventCreate(0), "cuEventCreate")
    times = []
    for _ in range(reps):
        kc.check(cu.cuEventRecord(start, stream), "cuEventRecord")
        kc.check(cu.cuMemcpyDtoDAsync(b, a, nbytes, stream), "cuMemcpyDtoDAsync")
        kc.check(cu.cuEventRecord(end, stream), "cuEventRecord")
        kc.check(cu.cuEventSynchronize(end), "cuEventSynchronize")
        times.append(kc.check(cu.cuEventElapsedTime(start, end), "cuEventElapsedTime") / 1e3)
    kc.check(cu.cuMemFree(a), "cuMemFree")
    kc.check(cu.cuMemFree(b), "cuMemFree")
    return 2 * nbytes / statistics.median(times)


def _percentile(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def bench(plan, ids: list[int], n_new: int, rounds: int = 3, log=print) -> dict:
    t0 = time.perf_counter()
    step = GpuStep(plan, use_graph=True)  # one arena; the graph is built here, at load
    build_ms = (time.perf_counter() - t0) * 1e3
    first = {}
    for name in ("graph", "stream"):  # first request after load, per mode
        step.set_graph(name == "graph")
        t = time.perf_counter()
        generate(step, ids, n_new, SamplingParams())
        first[name] = (time.perf_counter() - t) * 1e3
    per_round, lat = [], {"graph": [], "stream": []}
    for r in range(rounds):
        row = {}
        for name in ("stream", "graph"):
            step.set_graph(name == "graph")
            g = generate(step, ids, n_new, SamplingParams(), step_ms=lat[name])
            row[name] = g.ms_per_token
        per_round.append(row)
        log(f"round {r + 1}: graph off {row['stream']:.3f} ms/token, graph on {row['graph']:.3f} ms/token")
    savings = [row["stream"] - row["graph"] for row in per_round]
    effect = statistics.median(savings)
    spread = max(savings) - min(savings)
    med = {k: statistics.median(row[k] for row in per_round) for k in ("graph", "stream")}
    bw = copy_bandwidth(step.stream)
    nbytes = bytes_per_step(step.binding.step_bytes, len(ids) + n_new / 2)
    return {
        "rounds": per_round, "ms_per_token": med, "graph_speedup": med["stream"] / med["graph"],
        "paired_saving_ms": effect, "paired_range_ms": spread,
        "effect_over_range": effect / spread if spread > 0 else float("inf"),
        "gain_claimed": spread == 0 or effect >= 5 * spread,
        "latency_ms": {k: {"p50": _percentile(v, 50), "p99": _percentile(v, 99)} for k, v in lat.items()},
        "first_request_ms": first, "graph_build_ms_at_load": build_ms,
        "launches_per_token": len(step.launches), "bytes_per_token": nbytes, "copy_bandwidth_GBps": bw / 1e9,
        "roofline_ms": nbytes / bw * 1e3, "fraction_of_roofline": nbytes / bw * 1e3 / med["graph"],
        "weights": "random" if plan.random_weights else "checkpoint",
        "prompt_tokens": len(ids), "new_tokens": n_new,
    }


def verify(plan, ids: list[int], n_new: int) -> dict:
    """Graph vs streaming: every dumped file byte for byte; raises DeviceError naming the first mismatch."""
    dirs = {}
    step = GpuStep(plan, use_graph=True)
    for name in ("graph", "stream"):
        step.set_graph(name == "graph")
        d = tempfile.mkdtemp(prefix=f"kestrel-verify-{name}-")
        generate(step, ids, n_new, SamplingParams(), dump_dir=d)
        dirs[name] = d
    files = sorted(f for f in os.listdir(dirs["graph"]) if f.endswith(".f32"))
    for f in files:
        a = open(os.path.join(dirs["graph"], f), "rb").read()
        b = open(os.path.join(dirs["stream"], f), "rb").read()
        if a != b:
            raise DeviceError(f"--verify: graph and streaming differ in {f}")
    return {"verified": True, "files_compared": len(files), "steps": len(files) // 2}
