"""On the GPU: ``kestrel-run`` with torch and Triton made unimportable, on a checkpoint plan and on a
random-weight plan — the launch plan is the GPU runtime's only input, and nothing of the compiler, the
kernels, torch or Triton is loaded. For each plan: the tokens of a greedy run (graph and streaming)
with torch and Triton blocked, against the same run with everything importable (and, for a checkpoint
plan, against the CPU reference path), and the kestrel / torch / triton modules the blocked run loaded.

    python3 bench/device_no_torch.py $OUT/no-torch.json bench/plans/tiny-sm90-bf16.plan bench/plans/qwen3.5-0.8b-sm90-q4.plan
"""
from __future__ import annotations

import json
import subprocess
import sys

from kestrel.artifacts.plan import load_plan

RUN = r"""
import json, sys
if {block}:
    sys.modules["torch"] = None
    sys.modules["triton"] = None
from kestrel.runtime.cli import main
sys.argv = ["kestrel-run", {plan!r}, "--prompt-ids", "1,2,3,4,5,6,7,8", "--max-new-tokens", "24", "--json"] + {extra!r}
try:
    main()
except SystemExit as e:
    if e.code:
        raise
mods = sorted(m for m in sys.modules if sys.modules[m] is not None and (m.split(".")[0] in ("torch", "triton")
              or m.startswith(("kestrel.compiler", "kestrel.kernels", "kestrel.passes"))))
print(json.dumps({{"loaded": mods}}))
"""


def run(plan: str, block: bool, extra: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-c", RUN.format(block=block, plan=plan, extra=extra)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr[-2000:]}
    lines = r.stdout.strip().splitlines()
    return {**json.loads(lines[-2]), **json.loads(lines[-1])}


def main(out: str, plans: list[str]) -> None:
    report = []
    for plan in plans:
        row = {"plan": plan}
        for mode, extra in (("graph", []), ("stream", ["--no-graph"])):
            blocked, free = run(plan, True, extra), run(plan, False, extra)
            row[mode] = {"blocked": blocked, "importable": {"tokens": free.get("tokens"), "mode": free.get("mode")}}
            row[mode]["same_tokens"] = blocked.get("tokens") == free.get("tokens") and "tokens" in blocked
        if load_plan(plan).random_weights is None:  # the CPU reference of a random 0.8B plan would take long
            cpu = run(plan, False, ["--device", "cpu"])
            row["cpu_reference_tokens_equal"] = cpu.get("tokens") == row["graph"]["blocked"].get("tokens")
        row["ok"] = all(row[m]["same_tokens"] and row[m]["blocked"].get("loaded") == [] for m in ("graph", "stream")) \
            and row.get("cpu_reference_tokens_equal", True)
        report.append(row)
        print(f"{plan}: ok={row['ok']} graph={row['graph']['blocked'].get('mode')} "
              f"tokens={row['graph']['blocked'].get('tokens', row['graph']['blocked'].get('error'))} "
              f"cpu_equal={row.get('cpu_reference_tokens_equal')}", flush=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
