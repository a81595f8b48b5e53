"""Run under compute-sanitizer on the GPU: one plan, graph and streaming, greedy and sampled requests
(top-p, top-k, plain temperature, min-p),
and one request that fills the sequence to max_seq exactly (the last row of every KV cache and of
the token sequence written), so memcheck sees every kernel at the edges it clamps at.

    compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py PLAN
"""
from __future__ import annotations

import sys

from kestrel.artifacts.plan import load_plan
from kestrel.runtime.generate import SamplingParams, generate
from kestrel.runtime.gpu import GpuStep


def main(path: str) -> None:
    plan = load_plan(path)
    max_seq = plan.manifest["max_seq"]
    for use_graph in (True, False):  # (an M-row step's graph too: both graph modes of both programs)
        step = GpuStep(plan, use_graph=use_graph, use_graph_m=use_graph)
        a = generate(step, [1, 2, 3, 4], 16, SamplingParams())
        b = generate(step, [1, 2, 3, 4], 16, SamplingParams(temperature=0.8, top_p=0.9, seed=7))
        # the sampling kernel's other paths: the candidate merge (top-k), the whole-vocabulary
        # temperature path, and the exact fallback (min-p over a flat distribution)
        generate(step, [1, 2, 3, 4], 8, SamplingParams(temperature=0.7, top_p=0.8, seed=3, top_k=20))
        generate(step, [1, 2, 3, 4], 8, SamplingParams(temperature=1.0, seed=5))
        generate(step, [1, 2, 3, 4], 8, SamplingParams(temperature=2.0, seed=9, min_p=0.01))
        c = generate(step, list(range(1, max_seq - 7)), 8, SamplingParams())
        print(step.mode, f"M-row graph {step.use_graph_m}" if step.prefill_rows else "no M-row step", len(a.tokens),
              len(b.tokens), len(c.tokens), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
