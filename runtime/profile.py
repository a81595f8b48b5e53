"""``kestrel-run PLAN --profile``: where a decode step's time goes, launch by launch.

The prompt is prefilled as in a normal request (and the first token sampled); then ``steps`` decode
steps are launched kernel by kernel, each launch between two events of its own, and as many steps
are replayed as the CUDA graph, each timed alone (a plan with an M-row step: that program too, first,
over as many full chunks of a longer prompt, under ``prefill`` in the report): the sum of the launches
and the replay should agree within the per-launch overheads the graph saves. Then each kernel's cost
inside the graph (``in_graph``): the replay less the replay of the same chain without that kernel's
launches (graph_knockout). On the GPU the stream is held at a gate while a window of launches is
enqueued and released once they are all queued, so the host's launch latency never shows up as device
time. On the CPU path (any plan, ``--device cpu``) every op of
the reference step is timed with the host clock instead.

Each launch is charged the bytes the launch plan gives it (``bytes``: weights, states, the KV rows
up to the position it ran at; compiler/launch_plan.py), which sum to the step's bytes. The report
groups launches by kernel (family and dtype: ``matvec_q4g128``) and by layer kind (the layers with
attention, the Gated DeltaNet layers, and the embedding / head outside the layers), with the time
per step (median over the steps), the launches, the bytes and the fraction of the bandwidth
measured in the same run (the larger of copy and read-only stream; DESIGN, "Measuring").
numpy + cuda.bindings only (no torch): the CPU path brings torch itself.
"""
from __future__ import annotations

import ctypes
import statistics
import time

from kestrel.artifacts.errors import DeviceError
from kestrel.runtime import bench
from kestrel.runtime import cuda as kc
from kestrel.runtime.generate import SamplingParams, generate
from kestrel.runtime.gpu import GpuStep

WINDOW = 32  # launches enqueued behind one gate


def layer_kinds(launches: list[dict]) -> list[str]:
    """Each launch's layer kind: ``attention`` / ``gdn`` for the layers (a layer with an attention
    launch is an attention layer), ``embedding`` before the first layer, ``head`` after it."""
    attn = {ln.get("layer") for ln in launches if ln["op"].startswith("attn")}
    kinds, seen_layer = [], False
    for ln in launches:
        layer = ln.get("layer")
        if layer is None:
            kinds.append("head" if seen_layer else "embedding")
        else:
            seen_layer = True
            kinds.append("attention" if layer in attn else "gdn")
    return kinds


def launch_bytes(launch: dict, pos: float) -> float:
    """Bytes a launch moves at position ``pos`` (it reads KV rows 0..pos)."""
    b = launch.get("bytes") or {"fixed": 0, "kv_row_bytes": []}
    return b["fixed"] + sum(row * (pos + 1) for row in b["kv_row_bytes"])


def summarize(launches: list[dict], launch_ms: list[list[float]], positions: list[int],
              bandwidth: dict | None, replay_ms: list[float] | None, device: str) -> dict:
    """The report: ``launch_ms[s][i]`` is launch i's time at decode step s (at ``positions[s]``)."""
    med = [statistics.median(col) for col in zip(*launch_ms)]
    pos = statistics.mean(positions)
    bw = bandwidth["used_GBps"] * 1e9 if bandwidth else None
    kinds = layer_kinds(launches)
    rows = []
    for i, (ln, ms) in enumerate(zip(launches, med)):
        rows.append({"index": i, "op": ln["op"], "kernel": ln["kernel"], "layer": ln.get("layer"), "kind": kinds[i],
                     "grid": ln.get("grid"), "ms": ms, "bytes": launch_bytes(ln, pos)})

    def group(key):
        out = {}
        for r in rows:
            g = out.setdefault(r[key], {"launches": 0, "ms": 0.0, "bytes": 0.0})
            g["launches"] += 1
            g["ms"] += r["ms"]
            g["bytes"] += r["bytes"]
        total = sum(g["ms"] for g in out.values()) or 1.0
        for g in out.values():
            g["share"] = g["ms"] / total
            g["GBps"] = g["bytes"] / (g["ms"] * 1e-3) / 1e9 if g["ms"] > 0 else None
            g["fraction_of_bandwidth"] = g["bytes"] / (g["ms"] * 1e-3) / bw if bw and g["ms"] > 0 else None
        return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))

    total_ms = sum(med)
    total_bytes = sum(r["bytes"] for r in rows)
    report = {"device": device, "decode_steps": len(launch_ms), "mean_position": pos,
              "launches_per_step": len(launches), "sum_of_launches_ms": total_ms,
              "bytes_per_step": total_bytes, "bandwidth": bandwidth,
              "by_kernel": group("kernel"), "by_layer_kind": group("kind"), "launches": rows}
    if replay_ms:
        report["graph_replay_ms"] = statistics.median(replay_ms)
        report["graph_replay_ms_range"] = [min(replay_ms), max(replay_ms)]
    if bw:
        report["roofline_ms"] = total_bytes / bw * 1e3
        report["fraction_of_roofline_launches"] = report["roofline_ms"] / total_ms if total_ms else None
        if replay_ms:
            report["fraction_of_roofline_graph"] = report["roofline_ms"] / report["graph_replay_ms"]
    return report


def format_report(r: dict) -> str:
    """The two tables (per kernel, per layer kind) and the totals, as text."""
    frac = r["bandwidth"] is not None

    def table(title, groups):
        head = f"{title:<28} {'launches':>8} {'us/step':>10} {'share':>7} {'MB':>9} {'GB/s':>8}"
        lines = [head + (f" {'of BW':>6}" if frac else ""), "-" * (len(head) + (7 if frac else 0))]
        for name, g in groups.items():
            gbps = f"{g['GBps']:8.0f}" if g["GBps"] is not None else f"{'-':>8}"
            line = (f"{str(name):<28} {g['launches']:>8} {g['ms'] * 1e3:>10.1f} {g['share']:>7.1%} "
                    f"{g['bytes'] / 1e6:>9.2f} {gbps}")
            if frac:
                f = g["fraction_of_bandwidth"]
                line += f" {f:>6.1%}" if f is not None else f" {'-':>6}"
            lines.append(line)
        return "\n".join(lines)

    out = [table("kernel", r["by_kernel"]), "", table("layer kind", r["by_layer_kind"]), ""]
    if r.get("in_graph"):  # graph_knockout (and floors: the bytes at the bandwidth, and the time over them)
        priced = "floor_ms" in r["in_graph"][0]
        head = f"{'in the graph (replay less':<28} {'launches':>8} {'us/step':>10} {'share':>7} {'us/launch':>10}"
        head += f" {'floor us':>9} {'over floor':>10}" if priced else ""
        lines = [head, f"{'the replay without it)':<28}", "-" * len(head)]
        replay = r["graph_replay_ms"]
        for g in r["in_graph"]:
            line = (f"{g['kernel']:<28} {g['launches']:>8} {g['in_graph_ms'] * 1e3:>10.1f} "
                    f"{g['in_graph_ms'] / replay:>7.1%} {g['in_graph_ms'] * 1e3 / g['launches']:>10.2f}")
            lines.append(line + (f" {g['floor_ms'] * 1e3:>9.1f} {g['over_floor_ms'] * 1e3:>10.1f}" if priced else ""))
        if priced:
            over = sum(g["over_floor_ms"] for g in r["in_graph"])
            lines.append(f"{'(sum)':<28} {sum(g['launches'] for g in r['in_graph']):>8} "
                         f"{sum(g['in_graph_ms'] for g in r['in_graph']) * 1e3:>10.1f} {'':>7} {'':>10} "
                         f"{sum(g['floor_ms'] for g in r['in_graph']) * 1e3:>9.1f} {over * 1e3:>10.1f}")
        # (H200, stop 41 call 3: the lone first-layer norm's 6-12 us here, fused away, saved ~1.4 us of the step)
        lines.append("(a kernel's cost in the graph bounds what fusing it away can save: without it the next kernel "
                     "waits on the one before instead)")
        out += lines + [""]
    summary = (f"[{r['device']}] {r['launches_per_step']} launches/step over {r['decode_steps']} decode steps at "
               f"mean position {r['mean_position']:.0f}: sum of launches {r['sum_of_launches_ms']:.3f} ms")
    if "graph_replay_ms" in r:
        summary += f", graph replay {r['graph_replay_ms']:.3f} ms"
    summary += f"; {r['bytes_per_step'] / 1e6:.1f} MB/step"
    if frac:
        bw = r["bandwidth"]
        summary += (f"; bandwidth {bw['used_GBps']:.0f} GB/s (copy {bw['copy_GBps']:.0f}, read-only "
                    f"{bw['read_GBps']:.0f})" if bw.get("read_GBps") else
                    f"; bandwidth {bw['used_GBps']:.0f} GB/s (copy; this plan has no read-only probe)")
        summary += f"; roofline {r['roofline_ms']:.3f} ms"
        if "fraction_of_roofline_graph" in r:
            summary += f", graph at {r['fraction_of_roofline_graph']:.1%} of it"
    out.append(summary)
    if r.get("prefill"):  # the M-row step's tables (profile_rows)
        p = r["prefill"]
        out += ["", f"M-row step ({p['rows']} rows a run, every row valid; per run):", "",
                format_report({**p, "launches_per_step": p["launches_per_step"]}).replace(" decode steps at", " runs at")]
    return "\n".join(out)


def _prefill(step, ids: list[int]) -> None:
    """A greedy request up to its first new token: the states at position len(ids), that token fed in."""
    generate(step, ids, 1, SamplingParams())


def profile_cpu(step, launches: list[dict], ids: list[int], steps: int) -> dict:
    """The CPU reference path: each op of ``steps`` decode steps timed with the host clock."""
    _prefill(step, ids)
    launch_ms, positions = [], []
    for _ in range(steps):
        positions.append(int(step.dyn["pos"]))
        times: list[float] = []
        step.op_ms = times
        try:
            step.run(1)
        finally:
            step.op_ms = None
        if len(times) != len(launches):
            raise RuntimeError(f"the CPU step ran {len(times)} ops, the launch plan lists {len(launches)}")
        launch_ms.append(times)
    return summarize(launches, launch_ms, positions, None, None, "cpu-reference")


class _Gate:
    """A 4-byte counter in mapped pinned host memory the stream waits on: ``hold`` enqueues a wait for
    the next value (cuStreamWaitValue32 >= n), ``release`` writes it. The counter only grows, so a
    release never re-blocks a wait enqueued before it."""

    def __init__(self):
        cu = kc.driver()
        self.kc, self.cu = kc, cu
        self.host = kc.check(cu.cuMemHostAlloc(4, cu.CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc")
        self.dev = kc.check(cu.cuMemHostGetDevicePointer(self.host, 0), "cuMemHostGetDevicePointer")
        self.flag = (ctypes.c_uint32 * 1).from_address(int(self.host))
        self.flag[0] = self.n = 0

    def hold(self, stream) -> None:
        self.n += 1
        self.kc.check(self.cu.cuStreamWaitValue32(stream, self.dev, self.n,
                                                  self.cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ),
                      "cuStreamWaitValue32")

    def release(self) -> None:
        self.flag[0] = self.n

    def close(self) -> None:
        self.kc.check(self.cu.cuMemFreeHost(self.host), "cuMemFreeHost")


def _open_gate(step) -> "_Gate | None":
    """A stream gate, or None where the driver has no stream memory operations (the host's launch gaps
    are then not hidden)."""
    try:
        gate = _Gate()
        gate.hold(step.stream)
        gate.release()
        step.sync()
        return gate
    except DeviceError:
        return None


def _timed_launches(step, packed: list, events: list, gate) -> list[float]:
    """One run of the launches ``packed`` (kernel, grid, args), each between its own two events, in
    windows of WINDOW enqueued behind the gate; each launch's ms."""
    cu = kc.driver()
    for w in range(0, len(packed), WINDOW):
        if gate:
            gate.hold(step.stream)
        for (kernel, grid, args), (a, b) in zip(packed[w:w + WINDOW], events[w:w + WINDOW]):
            kc.check(cu.cuEventRecord(a, step.stream), "cuEventRecord")
            kc.launch(kernel, grid, args, step.stream)
            kc.check(cu.cuEventRecord(b, step.stream), "cuEventRecord")
        if gate:
            gate.release()
    step.sync()
    return [kc.check(cu.cuEventElapsedTime(a, b), "cuEventElapsedTime") for a, b in events]


def _release(gate, events: list) -> None:
    """Close the gate (if any) and destroy the timing events."""
    if gate:
        gate.close()
    cu = kc.driver()
    for pair in events:
        for e in pair:
            cu.cuEventDestroy(e)


def profile_rows(step, launches: list[dict], ids: list[int], chunks: int, bandwidth: dict | None) -> dict:
    """The M-row step (the plan's prefill program): a prompt of (chunks + 1) full chunks (``ids``
    repeated), its first ``chunks`` chunks launched kernel by kernel as profile_gpu launches a decode
    step, then as many replays of the M-row graph (when there is one) timed alone. Positions are each
    chunk's first row; every row of a chunk is valid."""
    cu = kc.driver()
    rows = step.prefill_rows
    prompt = (ids * (rows * (chunks + 1) // len(ids) + 1))[:rows * (chunks + 1)]
    use_graph_m = step.use_graph_m
    step.begin(prompt, 0.0, 1.0, 0)
    gate = _open_gate(step)
    events = [[kc.check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2)] for _ in launches]
    launch_ms, positions = [], []
    try:
        for c in range(chunks):
            positions.append(c * rows)  # every chunk full: the M-row step advances pos by rows
            launch_ms.append(_timed_launches(step, step.prefill_launches, events, gate))
        replay_ms = None
        if step.graph_m_exec is not None:
            step.begin(prompt, 0.0, 1.0, 0)
            step.set_graph_m(True)
            marks: list = []
            step.run_prefill(1, marks)
            step.run_prefill(chunks, marks)
            replay_ms = step.mark_ms(marks)
    finally:
        _release(gate, events)
        step.set_graph_m(use_graph_m)
    report = summarize(launches, launch_ms, positions, bandwidth, replay_ms, "gpu")
    report["rows"] = rows
    report["host_gaps_hidden"] = gate is not None
    return report


def profile_gpu(step, launches: list[dict], ids: list[int], steps: int, bandwidth: dict | None,
                position: int | None = None) -> dict:
    """``steps`` decode steps launched one by one, every launch between two events (behind gates), then
    as many graph replays timed alone (when the step has a graph)."""
    cu = kc.driver()
    if len(step.launches) != len(launches):
        raise DeviceError(f"the step has {len(step.launches)} launches, its launch plan {len(launches)}")
    use_graph = step.use_graph
    step.set_graph(False)
    _prefill(step, ids)
    if position is not None:  # decode from there (the KV rows past the prompt are zeros: timing only)
        step.dyn["pos"] = position
    gate = _open_gate(step)
    events = [[kc.check(cu.cuEventCreate(0), "cuEventCreate") for _ in range(2)] for _ in launches]
    launch_ms, positions = [], []
    try:
        for _ in range(steps):
            positions.append(int(step.dyn["pos"]))
            launch_ms.append(_timed_launches(step, step.launches, events, gate))
        replay_ms, in_graph = None, None
        if step.graph_exec is not None:
            step.set_graph(True)
            marks: list = []
            step.run(1, marks)
            for _ in range(steps):
                step.run(1, marks)
            replay_ms = step.mark_ms(marks)
            in_graph = graph_knockout(step, launches, steps)
    finally:
        _release(gate, events)
        if step.graph_exec is not None:
            step.set_graph(use_graph)
    report = summarize(launches, launch_ms, positions, bandwidth, replay_ms, "gpu")
    report["host_gaps_hidden"] = gate is not None
    report["graph_pdl"] = step.pdl  # the replay's nodes chained by programmatic edges (kernels/pdl.py)
    report["graph_pdl_late"] = step.pdl_late  # ... with the matvecs' late-trigger variants (runtime/gpu.py)
    if in_graph is not None:
        report["in_graph"] = floors(in_graph, report)
    return report


def floors(in_graph: list[dict], report: dict) -> list[dict]:
    """Each kernel's cost in the graph beside its floor: the bytes its launches move (``by_kernel``) at the
    run's bandwidth (``floor_ms``), and what it takes over that (``over_floor_ms``: the gap a target is short
    of, kernel by kernel; a kernel that moves nothing is all gap, launch and latency)."""
    bw = report["bandwidth"]["used_GBps"] * 1e9 if report.get("bandwidth") else None
    out = []
    for g in in_graph:
        row = dict(g, bytes=report["by_kernel"].get(g["kernel"], {}).get("bytes", 0.0))
        if bw:
            row["floor_ms"] = row["bytes"] / bw * 1e3
            row["over_floor_ms"] = row["in_graph_ms"] - row["floor_ms"]
        out.append(row)
    return out


def graph_knockout(step, launches: list[dict], rounds: int) -> list[dict]:
    """What each kernel costs inside the graph, overlaps and edges included (the launch-by-launch table
    times each launch alone): the step graph's replay time less the replay time of the same chain without
    that kernel's launches, ``rounds`` replays of each, alternating, from the same position for every
    kernel. The launches kept read what the dropped ones would have written: timing only."""
    names = [ln["kernel"] for ln in launches]
    pos = int(step.dyn["pos"])
    rows = []
    for name in dict.fromkeys(names):
        drop = {i for i, n in enumerate(names) if n == name}
        if len(drop) == len(names):
            continue
        step.dyn["pos"] = pos
        t = step.time_without(drop, rounds)
        full, without = statistics.median(t["graph_ms"]), statistics.median(t["without_ms"])
        rows.append({"kernel": name, "launches": len(drop), "graph_ms": full, "without_ms": without,
                     "in_graph_ms": full - without})
    step.dyn["pos"] = pos
    return sorted(rows, key=lambda r: -r["in_graph_ms"])


def profile_plan(plan, ids: list[int], steps: int, device: str, log=print, position: int | None = None) -> dict:
    """Load the plan on ``device`` (gpu or cpu) and profile a request with prompt ``ids`` (GPU: decoding
    from ``position`` when given)."""
    launches = plan.launch_plan["launches"]
    if device == "gpu":
        step = GpuStep(plan, use_graph=True, use_graph_m=True, log=log)
        t = time.perf_counter()
        bandwidth = bench.bandwidths(step)
        log(f"bandwidth: copy {bandwidth['copy_GBps']:.0f} GB/s, read-only "
            f"{bandwidth['read_GBps'] or float('nan'):.0f} GB/s ({(time.perf_counter() - t) * 1e3:.0f} ms)")
        rows_report = None
        if step.prefill_rows and step.prefill_rows * (steps + 1) + 2 <= step.max_seq:
            rows_report = profile_rows(step, plan.launch_plan["prefill"]["launches"], ids, steps, bandwidth)
        report = profile_gpu(step, launches, ids, steps, bandwidth, position)
        if rows_report is not None:
            report["prefill"] = rows_report
        return report
    from kestrel.runtime.cpu import CpuStep

    return profile_cpu(CpuStep(plan), launches, ids, steps)
