"""On the GPU: how long greedy speculative decoding stays on plain decoding's tokens (issue 12's exactness), per
plan, over several prompts: the first token where they differ (None: all equal) out of NEW.

    python3 bench/device_spec_exactness.py OUT.json PLAN [PLAN ...]
    (KESTREL_EXACT_NEW: tokens, 256; KESTREL_EXACT_PROMPTS: prompts, 3)
"""
from __future__ import annotations

import json
import os
import sys

from kestrel.artifacts.plan import load_plan
from kestrel.runtime.generate import SamplingParams, generate
from kestrel.runtime.gpu import GpuStep

NEW = int(os.environ.get("KESTREL_EXACT_NEW", "256"))
PROMPTS = [[(i * 7919 + 13 * p) % 5000 + 3 for i in range(40 + 7 * p)]
           for p in range(int(os.environ.get("KESTREL_EXACT_PROMPTS", "3")))]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def main(out: str, paths: list[str]) -> None:
    report = []
    for path in paths:
        plan = load_plan(path)
        step = GpuStep(plan, use_graph=True)
        k = step.spec_k
        for n, ids in enumerate(PROMPTS):
            step.spec_k = 0
            plain = generate(step, ids, NEW, SamplingParams()).tokens
            step.spec_k = k
            spec = generate(step, ids, NEW, SamplingParams()).tokens
            d = first_difference(plain, spec)
            report.append({"plan": os.path.basename(path), "verify": (plan.speculative or {}).get("verify"),
                           "prompt": n, "tokens": NEW, "first_difference": d})
            print(f"{os.path.basename(path)} prompt {n}: spec == plain for {NEW if d is None else d} of {NEW} tokens",
                  flush=True)
    json.dump(report, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
