"""On the GPU: which kernels of the speculative verify compute its first row differently from the one-token step
(issue 12's exactness). From one state, the one-token step and one speculative iteration run launch by launch,
and after each launch its op's outputs are copied back (the verify's: row 0, the token at dyn.pos, which both
programs compute from the same inputs). The ops are matched by the weights they read (a product, a norm, a Gated
DeltaNet or attention layer); the first one whose output differs is where the two stop agreeing.

    python3 bench/device_row_diff.py OUT.json PLAN [PLAN ...]

The state after a plain prefill of IDS and STEPS one-token steps is saved and restored between the two runs.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from kestrel.artifacts.plan import load_plan
from kestrel.compiler.ir import Weight
from kestrel.compiler.ir_text import parse_program
from kestrel.compiler.ops import is_view
from kestrel.runtime import cuda as kc
from kestrel.runtime.gpu import GpuStep

IDS = [(i * 7919) % 5000 + 3 for i in range(40)]
STEPS = int(os.environ.get("KESTREL_DIFF_STEPS", "8"))
NP_DTYPE = {"f32": np.float32, "i32": np.int32, "bf16": np.uint16}
SAVED = ("state", "dyn")


def _region(step: GpuStep, name: str, size: int) -> np.ndarray:
    host = np.empty(size, dtype=np.uint8)
    step.copy_from_device(host, step.binding.regions[name])
    return host


def _capture(step: GpuStep, launches, program) -> dict:
    """Each non-view op's outputs (row 0 of a [rows, N] output) after its launch, keyed by the weights it reads
    (first occurrence only), in program order."""
    ops = [op for op in program.ops if not is_view(op)]
    assert len(ops) == len(launches), (len(ops), len(launches))
    out = {}
    for op, (kernel, grid, args) in zip(ops, launches):
        kc.launch(kernel, grid, args, step.stream)
        step.sync()
        names = tuple(sorted(w.name for w in op.ins if isinstance(w, Weight)))
        if not names or names in out:
            continue
        vals = []
        for v in op.outs:
            if v.loc is None or v.type.dtype not in NP_DTYPE:
                continue
            n = v.type.shape[-1] if v.type.shape else 1  # (a [rows, N] output: row 0)
            host = np.empty(n, dtype=NP_DTYPE[v.type.dtype])
            step.copy_from_device(host, step.binding.regions[v.loc[0]] + v.loc[1])
            vals.append(host)
        out[names] = (op.kind, op.launch["kernel"] if op.launch else "", vals)
    return out


def run_plan(path: str) -> dict:
    plan = load_plan(path)
    step = GpuStep(plan, use_graph=False, use_graph_m=False)
    step.begin(IDS, 0.0, 1.0, 0)
    step.run_prefill(-(-len(IDS) // step.prefill_rows))
    step.run(STEPS)
    step.sync()
    lp = plan.launch_plan
    sizes = {r: lp["regions"][r]["size"] for r in SAVED}
    saved = {r: _region(step, r, sizes[r]) for r in SAVED}
    one = _capture(step, step.launches, parse_program(plan.program_text))
    for r in SAVED:
        step.copy_to_device(step.binding.regions[r], saved[r])
    ver = _capture(step, step.spec_launches, parse_program(plan.spec_programs[1]))
    rows = []
    for key, (kind, kernel, vals) in one.items():
        match = key if key in ver else next(  # attn_step's q and k norms: attn_rows_q reads the q norm
            (k for k, v in ver.items() if v[0] == "attn_rows_q" and set(k) <= set(key)), None)
        if match is None:
            continue
        vkind, vkernel, vvals = ver[match]
        for i, (a, b) in enumerate(zip(vals, vvals)):
            n = min(a.size, b.size)
            a, b = a[:n], b[:n]
            equal = bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))
            diff = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.dtype == np.float32 else None
            scale = float(np.max(np.abs(a.astype(np.float64)))) if a.dtype == np.float32 else None
            rows.append({"weights": list(key)[:3], "output": i, "step": f"{kind} {kernel}",
                         "verify": f"{vkind} {vkernel}", "equal": equal, "max_abs_diff": diff, "scale": scale})
    first = next((r for r in rows if not r["equal"]), None)
    print(f"{os.path.basename(path)}: {len(rows)} outputs compared, {sum(not r['equal'] for r in rows)} differ; "
          f"first: {first and (first['weights'], first['step'], first['verify'], first['max_abs_diff'])}", flush=True)
    for r in [r for r in rows if not r["equal"]][:12]:
        print(f"  {r['weights'][0]:48s} {r['step']:44s} {r['verify']:44s} {r['max_abs_diff']} / {r['scale']}")
    return {"plan": os.path.basename(path), "steps_before": STEPS, "outputs": rows}


if __name__ == "__main__":
    json.dump([run_plan(p) for p in sys.argv[2:]], open(sys.argv[1], "w"), indent=1)
