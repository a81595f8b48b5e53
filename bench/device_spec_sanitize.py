"""compute-sanitizer on one speculative plan's sampled speculation (temperature 0.7, top-p 0.8, top-k 20),
its launches streamed so that memcheck names the kernel: a short request, then a greedy one, then plain greedy
decoding (the one-token step: with --verify exact its q4 products on the tensor-core kernel at one row).

    compute-sanitizer --tool memcheck --print-limit 5 python3 bench/device_spec_sanitize.py PLAN
"""
from __future__ import annotations

import sys

from kestrel.artifacts.plan import load_plan
from kestrel.runtime.bench import SAMPLED
from kestrel.runtime.generate import SamplingParams, generate
from kestrel.runtime.gpu import GpuStep

IDS = [(i * 7919) % 5000 + 3 for i in range(40)]

if __name__ == "__main__":
    step = GpuStep(load_plan(sys.argv[1]), use_graph=False, use_graph_m=False)
    step.graph_spec_exec = None
    g = generate(step, IDS, 6, SAMPLED)
    print("sampled", g.tokens, "accepted", g.accepted_per_step, flush=True)
    print("greedy", generate(step, IDS, 6, SamplingParams()).tokens, flush=True)
    step.spec_k = 0
    print("plain", generate(step, IDS, 6, SamplingParams()).tokens, flush=True)
