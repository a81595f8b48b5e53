"""On the GPU: whole plans end to end. For each plan: greedy tokens on the GPU (graph and streaming)
against the CPU reference path, every step's dumped logits and hidden states byte-compared between
graph and streaming, the plain token loop (device-fed prompt, batched asynchronous read-back) against
the one-step-at-a-time loop with the driver calls of one request counted (no host-to-device copy
after the request's first write; the EOS overrun), and ms/token in both modes (interleaved rounds).

    python bench/device_e2e.py $OUT/e2e.json bench/plans/*.plan
    (KESTREL_E2E_NEW=N: N new tokens instead of 32)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from kestrel.artifacts.plan import load_plan
from kestrel.runtime import cuda as kc
from kestrel.runtime.generate import READBACK_EVERY, SamplingParams, generate
from kestrel.runtime.gpu import GpuStep

PROMPT = [72, 101, 108, 108, 111, 44, 32, 107, 101, 115, 116, 114, 101, 108]
N_NEW = int(os.environ.get("KESTREL_E2E_NEW", "32"))  # fewer where the CPU reference is slow (27B-width plans)


def dump_bytes(folder):
    index = json.load(open(os.path.join(folder, "index.json")))
    return [open(os.path.join(folder, s[k]), "rb").read() for s in index["steps"] for k in ("logits", "hidden")]


class CountingDriver:
    """cuda.bindings' driver module with every cu* call counted by name."""

    def __init__(self, cu):
        self.cu, self.calls = cu, {}

    def __getattr__(self, name):
        f = getattr(self.cu, name)
        if not (name.startswith("cu") and callable(f)):
            return f

        def counted(*a):
            self.calls[name] = self.calls.get(name, 0) + 1
            return f(*a)
        return counted


def counted_generate(step, *args, **kw):
    """generate() with the driver calls it makes counted (kestrel.runtime.cuda.driver patched)."""
    real = kc.driver
    counter = CountingDriver(real())
    kc.driver = lambda: counter
    try:
        g = generate(step, *args, **kw)
    finally:
        kc.driver = real
    return g, counter.calls


def token_loop_checks(graph: GpuStep, stepwise_tokens: list[int]) -> dict:
    n_new = len(stepwise_tokens)
    g, calls = counted_generate(graph, PROMPT, n_new, SamplingParams())
    res = {"plain_loop_tokens_equal_stepwise": g.tokens == stepwise_tokens,
           "plain_loop_first_divergence": next((i for i, (x, y) in enumerate(zip(g.tokens, stepwise_tokens)) if x != y),
                                               None),
           "driver_calls_per_request": calls,
           "host_to_device_copies_per_request": calls.get("cuMemcpyHtoDAsync", 0),
           "graph_launches": calls.get("cuGraphLaunch", 0),
           "expected_graph_launches": len(PROMPT) + n_new - 1}
    eos_at = 5
    e, calls = counted_generate(graph, PROMPT, n_new, SamplingParams(), eos_ids={stepwise_tokens[eos_at]})
    first = stepwise_tokens.index(stepwise_tokens[eos_at])
    res["eos_tokens_ok"] = e.tokens == stepwise_tokens[:first + 1] and e.stopped_by == "eos"
    res["eos_overrun_steps"] = calls.get("cuGraphLaunch", 0) - (len(PROMPT) + first)
    res["eos_overrun_bound"] = READBACK_EVERY - 1
    return res


def run_plan(path: str) -> dict:
    plan = load_plan(path)
    res = {"plan": os.path.basename(path), "target": plan.manifest["target"], "quant": plan.manifest["quant"]}
    t0 = time.perf_counter()
    graph = GpuStep(plan, use_graph=True)
    res["load_graph_s"] = time.perf_counter() - t0
    stream = GpuStep(plan, use_graph=False)
    from kestrel.runtime.cpu import CpuStep

    cpu = CpuStep(plan)
    outs, dumps = {}, {}
    for name, step in (("graph", graph), ("stream", stream), ("cpu", cpu)):
        d = tempfile.mkdtemp()
        g = generate(step, PROMPT, N_NEW, SamplingParams(), dump_dir=d)
        outs[name], dumps[name] = g.tokens, d
    res["tokens"] = outs
    res["graph_equals_stream_tokens"] = outs["graph"] == outs["stream"]
    a, b = dump_bytes(dumps["graph"]), dump_bytes(dumps["stream"])
    res["graph_vs_stream_dump_bytes_identical"] = a == b
    res.update(token_loop_checks(graph, outs["graph"]))
    res["dump_files_compared"] = len(a)
    first = next((i for i, (x, y) in enumerate(zip(outs["graph"], outs["cpu"])) if x != y), None)
    res["gpu_vs_cpu_first_divergence"] = first
    # logits error GPU vs CPU over the steps (same teacher: compare only up to the first divergence)
    ig = json.load(open(os.path.join(dumps["graph"], "index.json")))["steps"]
    ic = json.load(open(os.path.join(dumps["cpu"], "index.json")))["steps"]
    n = len(PROMPT) + (first if first is not None else N_NEW) - 1
    errs = []
    for sg, sc in list(zip(ig, ic))[:n]:
        lg = np.fromfile(os.path.join(dumps["graph"], sg["logits"]), dtype="<f4")
        lc = np.fromfile(os.path.join(dumps["cpu"], sc["logits"]), dtype="<f4")
        errs.append(float(np.abs(lg - lc).max() / np.abs(lc).max()))
    res["gpu_vs_cpu_max_rel_logits_err"] = max(errs)
    if first is not None:  # explain a divergence by the CPU's top-2 margin at that step
        sc = ic[len(PROMPT) - 1 + first]
        lc = np.sort(np.fromfile(os.path.join(dumps["cpu"], sc["logits"]), dtype="<f4"))
        res["cpu_top2_margin_at_divergence"] = float(lc[-1] - lc[-2])
        res["cpu_logit_scale"] = float(np.abs(lc).max())
    # timing: interleaved rounds, decode ms/token
    rounds = {"graph": [], "stream": []}
    for _ in range(5):
        for name, step in (("stream", stream), ("graph", graph)):
            g = generate(step, PROMPT, 64, SamplingParams())
            rounds[name].append(g.ms_per_token)
    res["ms_per_token"] = {k: v for k, v in rounds.items()}
    res["ms_per_token_median"] = {k: statistics.median(v) for k, v in rounds.items()}
    res["launches_per_token"] = len(graph.launches)
    return res


def main(out_path, *plans):
    report = [run_plan(p) for p in plans]
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    for r in report:
        print(json.dumps({k: v for k, v in r.items() if k not in ("tokens", "ms_per_token")}))


if __name__ == "__main__":
    main(*sys.argv[1:])
