"""``kestrel-run PLAN --bench`` and ``--verify`` on the GPU (numpy + cuda.bindings, no torch).

bench: interleaved A/B rounds in one process (graph off, graph on, graph on sampling at temperature 0.7 /
top-p 0.8 / top-k 20), ms/token per round, the paired
saving with its range (a gain is claimed only when the effect is at least 5x the paired range),
p50 / p99 per-token latency (device time of each decode step, from events between steps), first-request latency with the graph on and off (the graph is built at
load, so it must not fall inside the request), the bytes one step must move (the launch plan's
``step_bytes``, at the run's mean KV length: the whole embedding table when it is the tied lm_head) and
that over the bandwidth measured in the same run: the larger of a device copy (read + write counted) and
a read-only stream (the plan's probe kernel, kernels/bandwidth.py), both reported.
With ``positions`` (``--positions``): decode ms/token from each of those positions (``seek``: the KV
rows up to it are read, not prefilled). With ``prompt_lengths`` (``--prompt-lengths``, plans with an M-row step): time to first token and
prefill tokens/s per prompt length (the request's ids repeated to that length), the M-row step with its
graph on and off and the one-token prefill, interleaved rounds, paired graph saving with its range.
verify: the same prompt in graph and streaming mode, every step's dumped logits and hidden states
compared byte for byte; with an M-row step, also the prompt prefilled by it (both its modes) and the
logits, hidden states and tokens of every step after it.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

from kestrel.artifacts.errors import DeviceError, DraftSourceError
from kestrel.runtime import cuda as kc
from kestrel.runtime import profile  # (profile imports this module too: used at call time)
from kestrel.runtime.generate import Replay, SamplingParams, expected_accepted, generate
from kestrel.runtime.gpu import GpuStep
from kestrel.runtime.launch_binding import bytes_per_step


# the sampled setting the bench times beside greedy (Qwen's recommended one)
SAMPLED = SamplingParams(temperature=0.7, top_p=0.8, seed=1, top_k=20)
SAMPLED_TEXT = "temperature 0.7, top-p 0.8, top-k 20"


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


def read_bandwidth(step, nbytes: int = 1 << 30, reps: int = 10) -> float | None:
    """Read-only stream with the plan's probe kernel (kernels/bandwidth.py), bytes read per second
    (median of ``reps``); None for a plan built without the probe."""
    probe = step.probes.get("read_stream")
    if probe is None:
        return None
    cu = kc.driver()
    n_words = nbytes // 64 * 16  # a multiple of 16 words (the probe is compiled knowing it)
    buf = kc.check(cu.cuMemAlloc(nbytes), "cuMemAlloc")
    tiles = -(-n_words // probe["block"])
    sms = kc.check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                                           step.dev), "cuDeviceGetAttribute")
    programs = max(1, min(tiles, probe["programs_per_sm"] * sms))
    out = kc.check(cu.cuMemAlloc(4 * programs), "cuMemAlloc")
    start = kc.check(cu.cuEventCreate(0), "cuEventCreate")
    end = kc.check(cu.cuEventCreate(0), "cuEventCreate")
    try:
        kc.check(cu.cuMemsetD32Async(buf, 1, n_words, step.stream), "cuMemsetD32Async")
        kernel = step.kernels[probe["kernel_index"]]
        args = kc.PackedArgs(["*i32", "*i32", "i32", "i32"], [int(buf), int(out), n_words, tiles])
        kc.launch(kernel, (programs, 1, 1), args, step.stream)  # warm-up
        times = []
        for _ in range(reps):
            kc.check(cu.cuEventRecord(start, step.stream), "cuEventRecord")
            kc.launch(kernel, (programs, 1, 1), args, step.stream)
            kc.check(cu.cuEventRecord(end, step.stream), "cuEventRecord")
            kc.check(cu.cuEventSynchronize(end), "cuEventSynchronize")
            times.append(kc.check(cu.cuEventElapsedTime(start, end), "cuEventElapsedTime") / 1e3)
    finally:
        step.sync()
        kc.check(cu.cuMemFree(buf), "cuMemFree")
        kc.check(cu.cuMemFree(out), "cuMemFree")
    return n_words * 4 / statistics.median(times)


def bandwidths(step) -> dict:
    """DESIGN's bandwidth: the copy rate and the read-only rate measured now, and the larger ("used")."""
    copy = copy_bandwidth(step.stream)
    read = read_bandwidth(step)
    return {"copy_GBps": copy / 1e9, "read_GBps": read / 1e9 if read else None,
            "used_GBps": max(copy, read or 0.0) / 1e9}


def _percentile(xs, q):
    return float(np.percentile(np.asarray(xs), q))


class OneToken:
    """A step with its M-row step hidden: the prompt goes through the one-token step."""

    prefill_rows = 0

    def __init__(self, step):
        self.step = step

    def __getattr__(self, name):
        return getattr(self.step, name)


def ttft_ms(step, prompt) -> float:
    """Wall time of a greedy request that stops at its first new token (the prefill), in ms."""
    step.sync()
    t = time.perf_counter()
    generate(step, prompt, 1, SamplingParams())
    return (time.perf_counter() - t) * 1e3


def bench_prefill(step, ids: list[int], lengths: list[int], rounds: int, log=print,
                  one_token_max: int = 2048) -> list:
    """TTFT per prompt length: the M-row step with its graph on and off, and (up to ``one_token_max``
    tokens) the one-token prefill; interleaved rounds after one warm-up each."""
    out = []
    for n in lengths:
        prompt = (ids * (n // len(ids) + 1))[:n]
        modes = ["rows_graph", "rows_stream"] + (["one_token"] if n <= one_token_max else [])
        times = {m: [] for m in modes}
        for r in range(rounds + 1):  # round 0 warms up
            for m in modes:
                step.set_graph_m(m == "rows_graph")
                t = ttft_ms(OneToken(step) if m == "one_token" else step, prompt)
                if r:
                    times[m].append(t)
        step.set_graph_m(True)
        saving = [b - a for a, b in zip(times["rows_graph"], times["rows_stream"])]
        entry = {"prompt_tokens": n, "prefill_rows": step.prefill_rows,
                 "ttft_ms": {m: statistics.median(v) for m, v in times.items()},
                 "ttft_ms_range": {m: [min(v), max(v)] for m, v in times.items()},
                 "prefill_tokens_per_s": {m: n / statistics.median(v) * 1e3 for m, v in times.items()},
                 "graph_m_paired_saving_ms": statistics.median(saving),
                 "graph_m_paired_range_ms": max(saving) - min(saving)}
        out.append(entry)
        log(f"prompt {n}: TTFT M-row graph {entry['ttft_ms']['rows_graph']:.1f} ms "
            f"({entry['prefill_tokens_per_s']['rows_graph']:.0f} tokens/s), streaming "
            f"{entry['ttft_ms']['rows_stream']:.1f} ms"
            + (f", one-token prefill {entry['ttft_ms']['one_token']:.1f} ms" if "one_token" in times else ""))
    return out


def seek(step, ids: list[int], position: int) -> None:
    """Prefill ``ids`` (greedy, first token sampled and fed in), then move dyn.pos to ``position``: the
    next step reads KV rows 0..position, rows past the prompt being zeros. For timing decode at a long
    context without prefilling it (the bytes a step reads do not depend on what the rows hold)."""
    generate(step, ids, 1, SamplingParams())
    step.dyn["pos"] = position


def decode_at(step, ids: list[int], positions: list[int], n: int, rounds: int, log=print) -> list:
    """ms/token of ``n`` greedy graph steps from each position (``seek``), median of ``rounds``, with the
    bytes a step moves there (the KV rows up to it counted) over the run's bandwidth."""
    bw = bandwidths(step)
    out = []
    for p in positions:
        times = []
        for _ in range(rounds + 1):  # the first warms up
            seek(step, ids, p)
            marks: list = []
            step.run(1, marks)
            step.run(n, marks)
            times.append(statistics.median(step.mark_ms(marks)))
        ms = statistics.median(times[1:])
        nbytes = bytes_per_step(step.binding.step_bytes, p + n / 2)
        roof = nbytes / (bw["used_GBps"] * 1e9) * 1e3
        out.append({"position": p, "ms_per_token": ms, "ms_range": [min(times[1:]), max(times[1:])],
                    "bytes_per_token": nbytes, "roofline_ms": roof, "fraction_of_roofline": roof / ms})
        log(f"position {p}: {ms:.3f} ms/token ({nbytes / 1e6:.0f} MB/token, {roof / ms:.1%} of the roofline)")
    return out


def bench(plan, ids: list[int], n_new: int, rounds: int = 3, log=print,
          prompt_lengths: list[int] | None = None, positions: list[int] | None = None) -> dict:
    t0 = time.perf_counter()
    step = GpuStep(plan, use_graph=True, use_graph_m=True)  # one arena; the graphs are built here, at load
    build_ms = (time.perf_counter() - t0) * 1e3
    first = {}
    for name in ("graph", "stream"):  # first request after load, per mode (both programs' graphs)
        step.set_graph(name == "graph")
        if step.prefill_rows:
            step.set_graph_m(name == "graph")
        t = time.perf_counter()
        generate(step, ids, n_new, SamplingParams())
        first[name] = (time.perf_counter() - t) * 1e3
    if step.prefill_rows:
        step.set_graph_m(True)
    per_round, lat = [], {"graph": [], "stream": [], "graph_sampled": []}
    for r in range(rounds):
        row = {}
        for name in ("stream", "graph", "graph_sampled"):
            step.set_graph(name != "stream")
            g = generate(step, ids, n_new, SAMPLED if name == "graph_sampled" else SamplingParams(),
                         step_ms=lat[name])
            row[name] = g.ms_per_token
        per_round.append(row)
        log(f"round {r + 1}: graph off {row['stream']:.3f} ms/token, graph on {row['graph']:.3f} ms/token, "
            f"sampled ({SAMPLED_TEXT}) {row['graph_sampled']:.3f}")
    savings = [row["stream"] - row["graph"] for row in per_round]
    effect = statistics.median(savings)
    spread = max(savings) - min(savings)
    med = {k: statistics.median(row[k] for row in per_round) for k in ("graph", "stream", "graph_sampled")}
    sampling_cost = [row["graph_sampled"] - row["graph"] for row in per_round]
    bw = bandwidths(step)
    nbytes = bytes_per_step(step.binding.step_bytes, len(ids) + n_new / 2)
    used = bw["used_GBps"] * 1e9
    return {
        "rounds": per_round, "ms_per_token": med, "graph_speedup": med["stream"] / med["graph"],
        "paired_saving_ms": effect, "paired_range_ms": spread,
        "sampled": SAMPLED_TEXT, "sampling_cost_ms": statistics.median(sampling_cost),
        "sampling_cost_range_ms": [min(sampling_cost), max(sampling_cost)],
        "effect_over_range": effect / spread if spread > 0 else float("inf"),
        "gain_claimed": spread == 0 or effect >= 5 * spread,
        "latency_ms": {k: {"p50": _percentile(v, 50), "p99": _percentile(v, 99)} for k, v in lat.items()},
        "first_request_ms": first, "graph_build_ms_at_load": build_ms,
        "graph_pdl": step.pdl, "graph_pdl_late": step.pdl_late, "pdl_trial_ms": step.pdl_trial,
        "launches_per_token": len(step.launches),
        "bytes_per_token": nbytes, "copy_bandwidth_GBps": bw["copy_GBps"],
        "read_bandwidth_GBps": bw["read_GBps"], "bandwidth_GBps": bw["used_GBps"],
        "roofline_ms": nbytes / used * 1e3, "fraction_of_roofline": nbytes / used * 1e3 / med["graph"],
        "weights": "random" if plan.random_weights else "checkpoint",
        "prompt_tokens": len(ids), "new_tokens": n_new, "prefill_rows": step.prefill_rows,
        "prefill": bench_prefill(step, ids, prompt_lengths, rounds, log) if prompt_lengths else None,
        "long_context": decode_at(step, ids, positions, n_new, rounds, log) if positions else None,
    }


def _m_row_outputs(step, ids, n_new) -> list[bytes]:
    """The prompt prefilled by the M-row step, then one step at a time: every step's logits, hidden
    state and token, as bytes."""
    seen = []

    def grab(s, phase, pos, tok):
        seen.extend([s.output("logits").tobytes(), s.output("hidden").tobytes()])

    g = generate(step, ids, n_new, SamplingParams(), on_step=grab)
    return seen + [np.asarray(g.tokens, dtype=np.int32).tobytes()]


def verify(plan, ids: list[int], n_new: int) -> dict:
    """Graph vs streaming: every dumped file byte for byte; raises DeviceError naming the first mismatch.
    A plan with an M-row step: also the M-row prefill and the steps after it, both programs in each mode."""
    dirs = {}
    step = GpuStep(plan, use_graph=True, use_graph_m=True)
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
    res = {"verified": True, "files_compared": len(files), "steps": len(files) // 2}
    if step.prefill_rows:
        outs = {}
        for name in ("graph", "stream"):
            step.set_graph(name == "graph")
            step.set_graph_m(name == "graph")
            outs[name] = _m_row_outputs(step, ids, n_new)
        bad = next((i for i, (a, b) in enumerate(zip(outs["graph"], outs["stream"])) if a != b), None)
        if bad is not None or len(outs["graph"]) != len(outs["stream"]):
            raise DeviceError(f"--verify: the M-row step's graph and streaming runs differ (output {bad})")
        res["m_row_outputs_compared"] = len(outs["graph"])
    return res


# --- controlled acceptance (kestrel-run PLAN --bench --draft-source replay:FILE --draft-accept 0,0.5,0.8,1) ---

CONTROLLED_LABEL = ("controlled-acceptance figures: the drafts are a previous greedy run's tokens replayed, each "
                    "corrupted with probability 1 - draft_accept; not the MTP head's own acceptance")
SPEC_PHASES = ("verify", "accept_rollback", "draft")


def spec_phases(launches: list[dict]) -> list[str]:
    """Each launch of the speculative iteration's phase: ``verify`` (spec_begin, the replay override and
    the M-row pass of the target through its lm_head), ``accept_rollback`` (the row decisions, accept and
    the Gated DeltaNet states advanced by the kept rows: gdn_commit), ``draft`` (the MTP head over the verified
    rows, its one-row passes, each draft's lm_head and selection, and spec_end)."""
    first = next(i for i, ln in enumerate(launches) if ln["op"] == "argmax_rows")
    last = max(i for i, ln in enumerate(launches) if ln["op"] in ("accept", "gdn_commit"))
    return ["verify" if i < first else "accept_rollback" if i <= last else "draft" for i in range(len(launches))]


def _graph_ms(step, packed: list, n: int, pdl: bool = False) -> list[float]:
    """``packed`` launches captured as one graph (``pdl``: programmatic edges, else plain), replayed n + 1 times;
    each replay's ms but the first's."""
    cu = kc.driver()
    graph, graph_exec = kc.chain_graph(packed, pdl)
    events = [kc.check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(n + 2)]
    try:
        kc.check(cu.cuEventRecord(events[0], step.stream), "cuEventRecord")
        for ev in events[1:]:
            kc.check(cu.cuGraphLaunch(graph_exec, step.stream), "cuGraphLaunch")
            kc.check(cu.cuEventRecord(ev, step.stream), "cuEventRecord")
        kc.check(cu.cuEventSynchronize(events[-1]), "cuEventSynchronize")
        return [kc.check(cu.cuEventElapsedTime(a, b), "cuEventElapsedTime") for a, b in zip(events[1:], events[2:])]
    finally:
        for ev in events:
            cu.cuEventDestroy(ev)
        cu.cuGraphExecDestroy(graph_exec)
        cu.cuGraphDestroy(graph)


def _by_kernel(launches: list[dict], rows: list[list[float]]) -> dict:
    """{kernel id: [launches, ms]} (each launch's median over the rows), largest first."""
    out: dict = {}
    for ln, col in zip(launches, zip(*rows)):
        g = out.setdefault(ln["kernel"], [0, 0.0])
        g[0] += 1
        g[1] += statistics.median(col)
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


def iteration_phases(step, launches: list[dict], ids: list[int], seq: list[int], n: int = 8,
                     m1_launches: list[dict] | None = None) -> dict:
    """The iteration's launches kernel by kernel (each between two events, behind profile's stream gate) over
    ``n`` iterations of a replayed request at acceptance 1, and the one-token step's the same way and as
    graph replays: ms per phase (median over iterations), the verify at K + 1 rows over the M=1 step."""
    cu = kc.driver()
    phases = spec_phases(launches)
    k = step.spec_k
    n = max(1, min(n, (step.max_seq - len(ids) - 4 * k - 4) // (k + 3)))  # every position inside max_seq
    use_graph = step.use_graph
    step.begin(ids, 0.0, 1.0, 0)
    step.set_replay(seq, 1.0)
    step.run_spec_prefill(-(-len(ids) // step.prefill_rows))
    gate = profile._open_gate(step)
    events = [[kc.check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2)] for _ in step.spec_launches]
    m1_events = [[kc.check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2)] for _ in step.launches]
    try:
        per_iter = [profile._timed_launches(step, step.spec_launches, events, gate) for _ in range(n)]
        m1_rows = [profile._timed_launches(step, step.launches, m1_events, gate) for _ in range(n)]
        m1 = [sum(row) for row in m1_rows]
        m1_graph = verify_graph = None
        if step.graph_exec is not None:
            step.set_graph(True)
            marks: list = []
            step.run(1, marks)
            step.run(n, marks)
            m1_graph = statistics.median(step.mark_ms(marks))
            # the verify's launches alone as one graph (the iteration's edges), against the step's graph
            verify_graph = statistics.median(_graph_ms(step, [step.spec_launches[i] for i, p in enumerate(phases)
                                                              if p == "verify"], n, step.spec_pdl))
    finally:
        profile._release(gate, events)
        profile._release(None, m1_events)
        step.set_graph(use_graph)
    med = {ph: statistics.median(sum(ms for ms, p in zip(row, phases) if p == ph) for row in per_iter)
           for ph in SPEC_PHASES}
    m1_med = statistics.median(m1)
    verify = [i for i, p in enumerate(phases) if p == "verify"]
    return {"phase_ms_kernel_by_kernel": med, "launches_per_phase": {ph: phases.count(ph) for ph in SPEC_PHASES},
            # where the verify's time goes, per kernel (median over iterations), beside the one-token step's
            "verify_by_kernel": _by_kernel([launches[i] for i in verify], [[row[i] for i in verify] for row in per_iter]),
            "m1_step_by_kernel": _by_kernel(m1_launches, m1_rows) if m1_launches else None,
            "iteration_ms_kernel_by_kernel": statistics.median(sum(row) for row in per_iter),
            "m1_step_ms_kernel_by_kernel": m1_med, "m1_step_ms_graph": m1_graph,
            "verify_over_m1_step": med["verify"] / m1_med if m1_med > 0 else None,
            # the same ratio as graphs replay them (launch costs mostly hidden): the verify's launches as one graph
            "verify_ms_graph": verify_graph,
            "verify_over_m1_step_graph": verify_graph / m1_graph if verify_graph and m1_graph else None,
            "draft_ms_per_draft": med["draft"] / step.spec_k}


def bench_controlled(plan, ids: list[int], seq: list[int], accepts: list[float], rounds: int = 3, log=print,
                     source: str = "replay", step=None, launches: list | None = None,
                     m1_launches: list | None = None) -> dict:
    """ms/token of speculative decoding at controlled acceptance: for each ``accepts`` value a, requests
    replaying ``seq`` (prompt + a greedy run's tokens) with each draft intact with probability a (the
    iteration does all its work: the MTP head drafts, its drafts are replaced on the device), interleaved
    with plain decoding over ``rounds`` rounds after a warm-up (round r's corruption seeded by r); then
    the iteration's phases kernel by kernel (iteration_phases). Every figure is a controlled-acceptance one.
    ``step`` (a loaded GpuStep), ``launches`` (its iteration's launch-plan entries) and ``m1_launches`` (its
    one-token step's, for the per-kernel table; none: no table) stand in for ``plan``."""
    step = step or GpuStep(plan, use_graph=True, use_graph_m=True)
    if not step.spec_k:
        raise DraftSourceError("--draft-source replays drafts into speculative iterations: this plan has none; "
                               "rebuild it with --speculative mtp")
    k, n_new = step.spec_k, len(seq) - len(ids)
    times = {a: [] for a in accepts}
    acc = {a: [] for a in accepts}
    same = {a: True for a in accepts}
    plain = []
    for r in range(rounds + 1):  # round 0 warms up
        k_saved, step.spec_k = step.spec_k, 0
        try:
            g = generate(step, ids, n_new, SamplingParams())
        finally:
            step.spec_k = k_saved
        if r:
            plain.append(g.ms_per_token)
        for a in accepts:
            g = generate(step, ids, n_new, SamplingParams(seed=r), replay=Replay(seq, a))
            same[a] &= g.tokens == seq[len(ids):len(ids) + len(g.tokens)]
            if r:
                times[a].append(g.ms_per_token)
                acc[a].append((g.spec_accepted, g.spec_iterations))
        if r:
            log(f"round {r}: plain {plain[-1]:.3f} ms/token; " + ", ".join(
                f"accept {a}: {times[a][-1]:.3f} ms/token ({acc[a][-1][0] / max(1, acc[a][-1][1]):.2f} accepted)"
                for a in accepts))
    plain_ms = statistics.median(plain)
    rows = []
    for a in accepts:
        accepted = sum(x for x, _ in acc[a]) / max(1, sum(n for _, n in acc[a]))
        ms = statistics.median(times[a])
        rows.append({"draft_accept": a, "expected_accepted_per_step": expected_accepted(a, k),
                     "accepted_per_step": accepted, "tokens_per_iteration": accepted + 1,
                     "iterations": sum(n for _, n in acc[a]), "ms_per_token": ms,
                     "ms_per_token_range": [min(times[a]), max(times[a])], "speedup_over_plain": plain_ms / ms,
                     "tokens_equal_replay": same[a]})
    lp_launches = launches if launches is not None else plan.launch_plan["speculative"]["iteration"]["launches"]
    return {"controlled_acceptance": {
        "label": CONTROLLED_LABEL, "draft_source": source, "draft_tokens": k, "prompt_tokens": len(ids),
        "new_tokens": n_new, "rounds": rounds, "plain_ms_per_token": plain_ms,
        "plain_ms_per_token_rounds": plain, "rows": rows,
        "iteration": iteration_phases(step, lp_launches, ids, seq, m1_launches=m1_launches if plan is None
                                      else plan.launch_plan["launches"]),
        "spec_graph": step.graph_spec_exec is not None, "spec_graph_pdl": step.spec_pdl,
        "spec_pdl_trial_ms": step.spec_pdl_trial,
        "weights": None if plan is None else "random" if plan.random_weights else "checkpoint"}}


def format_controlled(r: dict) -> str:
    c = r["controlled_acceptance"]
    it = c["iteration"]
    lines = [f"controlled-acceptance figures (K = {c['draft_tokens']}, drafts replayed from {c['draft_source']}; "
             f"plain decoding {c['plain_ms_per_token']:.3f} ms/token)",
             "draft_accept  accepted/iter (expected)  tokens/iter  ms/token  x plain"]
    for row in c["rows"]:
        lines.append(f"{row['draft_accept']:>12}  {row['accepted_per_step']:>13.2f} ({row['expected_accepted_per_step']:.2f})"
                     f"  {row['tokens_per_iteration']:>11.2f}  {row['ms_per_token']:>8.3f}  {row['speedup_over_plain']:>7.2f}")
    ph = it["phase_ms_kernel_by_kernel"]
    lines.append(f"iteration kernel by kernel {it['iteration_ms_kernel_by_kernel']:.3f} ms: verify at K + 1 rows "
                 f"{ph['verify']:.3f} ms ({it['verify_over_m1_step']:.2f}x the M=1 step's "
                 f"{it['m1_step_ms_kernel_by_kernel']:.3f}), accept + rollback {ph['accept_rollback']:.3f} ms, "
                 f"MTP drafts {ph['draft']:.3f} ms ({it['draft_ms_per_draft']:.3f} per draft)")
    if it.get("verify_over_m1_step_graph"):
        lines.append(f"as graphs: the verify's launches {it['verify_ms_graph']:.3f} ms, "
                     f"{it['verify_over_m1_step_graph']:.2f}x the step's graph ({it['m1_step_ms_graph']:.3f} ms)")
    for name, table in (("verify", it.get("verify_by_kernel")), ("M=1 step", it.get("m1_step_by_kernel"))):
        if table:
            lines.append(f"{name} by kernel (ms, launches): " + ", ".join(
                f"{k} {ms:.3f} ({n})" for k, (n, ms) in list(table.items())[:10]))
    return "\n".join(lines)
