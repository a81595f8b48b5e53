"""One line from a `kestrel-run --bench` JSON report: the tag, ms/token per mode, whether the step graph kept
programmatic edges, and the load-time PDL trial's medians (bench/device_preload_ab.sh, device_carveout_ab.sh).

    python3 bench/bench_line.py REPORT.json TAG
"""
import json
import sys

r = json.load(open(sys.argv[1]))
trial = r.get("pdl_trial_ms") or {}
print(sys.argv[2], "ms/token", {k: round(v, 4) for k, v in r["ms_per_token"].items()}, "pdl", r.get("graph_pdl"),
      "late", r.get("graph_pdl_late"),
      "trial", {k: round(sorted(v)[len(v) // 2], 4) for k, v in trial.items()})
