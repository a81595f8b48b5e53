"""On the GPU: speculative decoding with the MTP head (issue 12) on plans built with --speculative mtp.

Per plan, in one process (the runtime's own API: kestrel.runtime.gpu.GpuStep and generate):
  * exactness on the GPU: greedy tokens of the speculative loop against the plain loop of the same
    plan (spec_k set to 0: the M-row prefill and one-token steps), and the speculative loop with the
    iteration's graph against its launches streamed;
  * timing, 3 interleaved rounds, medians: plain ms/token, speculative ms/token with the iteration's
    graph and streamed (the KESTREL_GRAPH_SPEC gate's paired A/B; with random weights
    nearly every draft is rejected, so each iteration gives one token), and the iteration alone
    (events around each of 24 replays of its graph after a speculative prefill);
  * the projection from the iteration's time (at A accepted drafts per iteration a token costs
    iteration / (A + 1)), labelled as arithmetic;
  * the controlled-acceptance table (kestrel.runtime.bench.bench_controlled, what `kestrel-run PLAN --bench
    --draft-source replay:FILE --draft-accept 0,0.5,0.8,1` runs; labelled controlled-acceptance figures):
    the replay is this plan's own greedy speculative run of IDS (written to OUT.replay-N.json), its drafts
    corrupted at 1 - A on the device, so acceptance is set exactly: ms/token per A, the measured and
    expected mean accepted, the speed-up over plain decoding, the iteration kernel by kernel split into
    the verify at K + 1 rows (over the one-token step), accept + rollback and the MTP drafts;
  * speculative sampling at temperature 0.7 / top-p 0.8 / top-k 20: repeatable for a seed, ms/token against
    plain sampling, drafts accepted (the token loop speculates only under KESTREL_SPEC_SAMPLING=1: "speculated"
    says which ran), and the iteration alone replayed at that setting against the same graph at
    temperature 0, interleaved: their difference is what the iteration's sampling (K drafts + the K + 1
    rows) costs.

    python3 bench/device_spec.py OUT.json PLAN [PLAN ...]
"""
from __future__ import annotations

import json
import os
import statistics
import sys

from kestrel.artifacts.plan import load_plan
from kestrel.runtime.bench import SAMPLED, bench_controlled, format_controlled
from kestrel.runtime.generate import SamplingParams, generate
from kestrel.runtime.gpu import GpuStep

IDS = [(i * 7919) % 5000 + 3 for i in range(40)]
NEW = 64


def run(step, spec: bool, graph: bool = True, sampling: SamplingParams | None = None):
    k, g = step.spec_k, step.graph_spec_exec
    try:
        if not spec:
            step.spec_k = 0
        if not graph:
            step.graph_spec_exec = None
        return generate(step, IDS, NEW, sampling or SamplingParams())
    finally:
        step.spec_k, step.graph_spec_exec = k, g


def iteration_ms(step, n: int = 24, sampling: SamplingParams | None = None) -> list[float]:
    s = sampling or SamplingParams()
    step.begin(IDS, s.temperature, s.top_p, s.seed, top_k=s.top_k, min_p=s.min_p)
    step.run_spec_prefill(-(-len(IDS) // step.prefill_rows))
    marks: list = []
    step.run_spec(1, marks)
    step.run_spec(n, marks)
    return step.mark_ms(marks)


def main(out: str, plans: list[str]) -> None:
    report = []
    for path in plans:
        step = GpuStep(load_plan(path), use_graph=True, use_graph_m=True)
        k = step.spec_k
        plain, spec, stream = run(step, False), run(step, True), run(step, True, graph=False)
        r = {"plan": path, "draft_tokens": k, "spec_graph": step.graph_spec_exec is not None,
             "spec_graph_pdl": step.spec_pdl,
             "spec_equals_plain": spec.tokens == plain.tokens, "graph_equals_streaming": spec.tokens == stream.tokens,
             "first_difference": next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b), None),
             "accepted_per_step": spec.accepted_per_step, "iterations": spec.spec_iterations}
        times = {"plain": [], "spec": [], "spec_stream": [], "iteration": []}
        for _ in range(3):
            times["plain"].append(run(step, False).ms_per_token)
            times["spec"].append(run(step, True).ms_per_token)
            times["spec_stream"].append(run(step, True, graph=False).ms_per_token)
            times["iteration"].append(statistics.median(iteration_ms(step)))
        if os.environ.get("SPEC_PDL") == "1" and all(kernel.pdl for kernel, _, _ in step.spec_launches):
            # the iteration's graph with programmatic edges (kernels/pdl.py) against the plain one, both built here
            # (the runtime keeps whichever its load-time trial chose: step.spec_pdl)
            kept = step.graph_spec_exec
            plain_graph, chained = step._build_graph(step.spec_launches, False), step._build_graph(step.spec_launches, True)
            times["iteration_pdl"], times["iteration_plain"] = [], []
            for _ in range(3):
                step.graph_spec_exec = chained
                times["iteration_pdl"].append(statistics.median(iteration_ms(step)))
                step.graph_spec_exec = plain_graph
                times["iteration_plain"].append(statistics.median(iteration_ms(step)))
            step.graph_spec_exec = chained
            r["pdl_equals_plain"] = run(step, True).tokens == spec.tokens
            step.graph_spec_exec = kept
            r["runtime_kept_programmatic"], r["spec_pdl_trial_ms"] = step.spec_pdl, step.spec_pdl_trial
        med = {name: statistics.median(v) for name, v in times.items()}
        saving = [b - a for a, b in zip(times["spec"], times["spec_stream"])]
        r.update({"ms_per_token_plain": med["plain"], "ms_per_token_speculative": med["spec"],
                  "ms_per_token_speculative_streamed": med["spec_stream"],
                  "graph_saving_ms_per_token": statistics.median(saving),
                  "graph_saving_paired_range_ms": max(saving) - min(saving),
                  "ms_per_iteration": med["iteration"], "rounds": times,
                  "projected_ms_per_token_at_accepted": {a: med["iteration"] / (a + 1) for a in range(k + 1)} |
                  {2.5: med["iteration"] / 3.5}})
        # speculative sampling (temperature > 0) and the controlled-acceptance table
        a, b = run(step, True, sampling=SAMPLED), run(step, True, sampling=SAMPLED)
        ts = {"spec": [], "plain": [], "iteration_sampled": [], "iteration_greedy": []}
        for _ in range(3):  # interleaved: the sampled iteration against the greedy one (same launches, T = 0)
            ts["spec"].append(run(step, True, sampling=SAMPLED).ms_per_token)
            ts["plain"].append(run(step, False, sampling=SAMPLED).ms_per_token)
            ts["iteration_sampled"].append(statistics.median(iteration_ms(step, sampling=SAMPLED)))
            ts["iteration_greedy"].append(statistics.median(iteration_ms(step)))
        extra = [x - y for x, y in zip(ts["iteration_sampled"], ts["iteration_greedy"])]
        r["sampled"] = {"setting": "temperature 0.7, top-p 0.8, top-k 20, seed 1", "repeatable": a.tokens == b.tokens,
                        "speculated": a.draft_tokens > 0,  # KESTREL_SPEC_SAMPLING=1 (else plain decoding)
                        "accepted_per_step": a.accepted_per_step, "ms_per_token_speculative": statistics.median(ts["spec"]),
                        "ms_per_token_plain": statistics.median(ts["plain"]),
                        "ms_per_iteration_sampled": statistics.median(ts["iteration_sampled"]),
                        "ms_per_iteration_greedy": statistics.median(ts["iteration_greedy"]),
                        "sampling_ms_per_iteration": statistics.median(extra),
                        "sampling_ms_paired_range": max(extra) - min(extra), "rounds": ts}
        print(f"{path}: sampled ({r['sampled']['setting']}; speculated {r['sampled']['speculated']}): "
              f"{r['sampled']['ms_per_token_speculative']:.3f} ms/token against plain sampling's "
              f"{r['sampled']['ms_per_token_plain']:.3f}; iteration {r['sampled']['ms_per_iteration_sampled']:.3f} ms "
              f"sampled vs {r['sampled']['ms_per_iteration_greedy']:.3f} greedy: the sampling costs "
              f"{r['sampled']['sampling_ms_per_iteration']:.3f} ms (paired range "
              f"{r['sampled']['sampling_ms_paired_range']:.3f})", flush=True)
        replay = f"{out}.replay-{len(report)}.json"
        json.dump({"tokens": spec.tokens, "prompt_ids": IDS, "temperature": 0.0, "plan": path}, open(replay, "w"))
        lp = load_plan(path).launch_plan
        c = bench_controlled(None, IDS, IDS + spec.tokens, [0.0, 0.5, 0.8, 1.0], 3, source=f"replay:{replay}",
                             step=step, launches=lp["speculative"]["iteration"]["launches"], m1_launches=lp["launches"])
        r.update(c)
        print(format_controlled(c), flush=True)
        report.append(r)
        print(f"{path}: K={k} spec==plain {r['spec_equals_plain']} (first diff {r['first_difference']}) "
              f"graph==stream {r['graph_equals_streaming']} accepted {r['accepted_per_step']:.2f}/iter; plain "
              f"{med['plain']:.3f} ms/token, speculative {med['spec']:.3f} (streamed {med['spec_stream']:.3f}; "
              f"graph saves {r['graph_saving_ms_per_token']:.3f}, paired range {r['graph_saving_paired_range_ms']:.3f}), "
              f"iteration {med['iteration']:.3f} ms "
              f"({med['iteration'] / med['plain']:.2f}x the plain step); projected at 2.5 accepted "
              f"{med['iteration'] / 3.5:.3f} ms/token" + (
                  f"; programmatic edges: iteration {med['iteration_pdl']:.3f} ms against plain "
                  f"{med['iteration_plain']:.3f} (same tokens: {r['pdl_equals_plain']})"
                  if "iteration_pdl" in med else ""), flush=True)
        del step
    json.dump(report, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
