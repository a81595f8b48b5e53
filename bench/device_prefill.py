"""On the GPU: the M-row step (prompts prefilled ``prefill_rows`` tokens a replay) of each plan.

For each plan (built with --prefill-rows M):
  * exactness: the M-row prefill's first-token logits against the one-token prefill's (same plan, same
    GPU; the summation order and the GEMM's bf16 activations differ: max |diff| / max |logit| is
    reported), and the greedy tokens of both (the first divergence, if any, with the margin there);
  * graph vs streaming (KESTREL_GRAPH_M's two modes): logits, hidden and the greedy tokens after an
    M-row prefill byte-compared;
  * GPU vs CPU reference (plans up to CPU_MAX_BYTES of weights): the M-row prefill on the CPU path
    of the same plan, first-token logits compared, greedy tokens compared;
  * speed: time to first token and prefill tokens/s at each prompt length (random ids), M-row with
    the graph on and off and the one-token prefill, interleaved rounds, medians and ranges.

    python bench/device_prefill.py OUT.json PLAN [PLAN ...]
    (env: PROMPT_LENGTHS=512,2048  ROUNDS=3  CPU_MAX_BYTES=3e9 (weights)  ONE_TOKEN_MAX=2048)
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

from kestrel.artifacts.plan import load_plan
from kestrel.runtime.bench import OneToken, ttft_ms
from kestrel.runtime.generate import SamplingParams, generate
from kestrel.runtime.gpu import GpuStep

N_NEW = 16


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, min(vocab, 50000), n)]


def first_logits(step, prompt):
    """Greedy generation; the logits the first new token was sampled from, and the tokens."""
    seen = {}

    def grab(s, phase, pos, tok):
        if pos == len(prompt) - 1:
            seen["logits"] = s.output("logits").copy()
            seen["hidden"] = s.output("hidden").copy()

    g = generate(step, prompt, N_NEW, SamplingParams(), on_step=grab)
    return seen["logits"], seen["hidden"], g.tokens


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def profile_rows(step, plan, prompt) -> dict:
    """One full chunk of the M-row step launched kernel by kernel, an event after each: device ms per
    kernel id (summed over the layers), second of two runs."""
    from kestrel.runtime import cuda as kc
    cu = kc.driver()
    lp = plan.launch_plan
    ids = [lp["kernels"][x["kernel_index"]]["id"] for x in lp["prefill"]["launches"]]
    evs = [kc.check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(len(ids) + 1)]
    per: dict = {}
    for _ in range(2):
        step.begin(prompt, 0.0, 1.0, 0)
        kc.check(cu.cuEventRecord(evs[0], step.stream), "cuEventRecord")
        for i, (kernel, grid, args) in enumerate(step.prefill_launches):
            kc.launch(kernel, grid, args, step.stream)
            kc.check(cu.cuEventRecord(evs[i + 1], step.stream), "cuEventRecord")
        kc.check(cu.cuEventSynchronize(evs[-1]), "cuEventSynchronize")
        per = {}
        for k, a, b in zip(ids, evs, evs[1:]):
            per[k] = per.get(k, 0.0) + kc.check(cu.cuEventElapsedTime(a, b), "cuEventElapsedTime")
    return dict(sorted(per.items(), key=lambda kv: -kv[1]))


def check_plan(path: str) -> dict:
    plan = load_plan(path)
    m = plan.manifest
    rows = m.get("prefill_rows", 0)
    res = {"plan": os.path.basename(path), "prefill_rows": rows, "max_seq": m["max_seq"], "quant": m.get("quant")}
    if not rows:
        res["error"] = "no M-row step"
        return res
    vocab = m["model"]["vocab_size"]
    t0 = time.perf_counter()
    step = GpuStep(plan, use_graph=True, use_graph_m=True)
    res["load_s"] = time.perf_counter() - t0
    n = min(2 * rows + 3, m["max_seq"] - N_NEW - 1)  # crosses a chunk boundary, not a multiple of M
    prompt = prompt_ids(n, vocab, 1)
    # exactness against the one-token prefill
    lr, hr, tr = first_logits(step, prompt)
    l1, h1, t1 = first_logits(OneToken(step), prompt)
    res["prompt_len"] = n
    res["rows_vs_one_token_rel_logits"] = rel(lr, l1)
    res["rows_vs_one_token_rel_hidden"] = rel(hr, h1)
    res["rows_vs_one_token_first_divergence"] = divergence(tr, t1)
    res["argmax_equal"] = int(np.argmax(lr)) == int(np.argmax(l1))
    s1 = np.sort(l1)
    res["one_token_top2_margin"] = float(s1[-1] - s1[-2])
    # graph vs streaming of the M-row step
    step.set_graph_m(False)
    ls, hs, ts = first_logits(step, prompt)
    step.set_graph_m(True)
    res["graph_vs_stream_identical"] = bool(ls.tobytes() == lr.tobytes() and hs.tobytes() == hr.tobytes() and ts == tr)
    # GPU vs the CPU reference path (same plan, same M-row program)
    if float(os.environ.get("CPU_MAX_BYTES", "3e9")) >= plan.launch_plan["arena"]["weights"]:
        from kestrel.runtime.cpu import CpuStep
        t0 = time.perf_counter()
        cpu = CpuStep(plan)
        lc, hc, tc = first_logits(cpu, prompt)
        res["cpu_s"] = time.perf_counter() - t0
        res["gpu_vs_cpu_rel_logits"] = rel(lr, lc)
        res["gpu_vs_cpu_rel_hidden"] = rel(hr, hc)
        res["gpu_vs_cpu_first_divergence"] = divergence(tr, tc)
        sc = np.sort(lc)
        res["cpu_top2_margin"] = float(sc[-1] - sc[-2])
        del cpu
    res["profile_ms_one_chunk"] = profile_rows(step, plan, prompt_ids(rows, vocab, 5))
    # speed
    lengths = [int(x) for x in os.environ.get("PROMPT_LENGTHS", "512,2048").split(",")]
    rounds = int(os.environ.get("ROUNDS", "3"))
    one_max = int(os.environ.get("ONE_TOKEN_MAX", "2048"))
    res["speed"] = []
    for L in lengths:
        if L + 2 > m["max_seq"]:
            continue
        p = prompt_ids(L, vocab, L)
        times = {"rows_graph": [], "rows_stream": [], "one_token": []}
        ttft_ms(step, p)  # warm-up
        for _ in range(rounds):
            step.set_graph_m(True)
            times["rows_graph"].append(ttft_ms(step, p))
            step.set_graph_m(False)
            times["rows_stream"].append(ttft_ms(step, p))
            step.set_graph_m(True)
            if L <= one_max:
                times["one_token"].append(ttft_ms(OneToken(step), p))
        entry = {"prompt_len": L}
        for k, v in times.items():
            if v:
                entry[k] = {"ttft_ms_median": statistics.median(v), "ttft_ms_range": [min(v), max(v)],
                            "tokens_per_s": L / statistics.median(v) * 1e3}
        g, s = times["rows_graph"], times["rows_stream"]
        entry["graph_minus_stream_ms"] = {"median": statistics.median([a - b for a, b in zip(g, s)]),
                                          "range": [min(a - b for a, b in zip(g, s)), max(a - b for a, b in zip(g, s))]}
        res["speed"].append(entry)
    return res


def main(out: str, *plans: str) -> None:
    results = []
    for p in plans:
        try:
            r = check_plan(p)
        except Exception as e:  # keep going: one plan's failure is reported, the others still run
            import traceback
            r = {"plan": os.path.basename(p), "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        results.append(r)
        json.dump(results, open(out, "w"), indent=1)
        print(json.dumps({k: v for k, v in r.items() if k not in ("speed", "trace")}), flush=True)
        if "trace" in r:
            print(r["trace"], flush=True)
    print(f"{'plan':34} {'L':>6} {'M-row graph':>12} {'M-row stream':>13} {'one-token':>10}  tok/s (M-row graph)")
    for r in results:
        for e in r.get("speed", []):
            cell = lambda k: f"{e[k]['ttft_ms_median']:.1f}" if k in e else "-"  # noqa: E731
            print(f"{r['plan']:34} {e['prompt_len']:>6} {cell('rows_graph'):>12} {cell('rows_stream'):>13} "
                  f"{cell('one_token'):>10}  {e['rows_graph']['tokens_per_s']:.0f}")


if __name__ == "__main__":
    main(*sys.argv[1:])
