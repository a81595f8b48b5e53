"""Per-launch kernel time on the device, as the bench scripts measure it (torch there for buffers,
CUDA graphs and events; kernels launched from their cubins through kestrel.runtime.cuda).

A CUDA graph of at least ``launches`` launches of one kernel cycles over the given packed argument
sets (copies of the operands larger than L2, so each launch reads from DRAM); the graph is replayed
``replays`` times and each replay's time is divided by its launch count.
"""
from __future__ import annotations

import torch

from kestrel.runtime import cuda as kc


def replay_times_us(g: torch.cuda.CUDAGraph, replays: int, n: int) -> list[float]:
    """Each of ``replays`` replays of the captured graph ``g`` timed with events, divided by its ``n`` launches."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return times


def launch_times_us(kernel, grid, packed_sets: list, replays: int, launches: int = 64) -> list[float]:
    reps = max(1, launches // len(packed_sets))
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        for _ in range(reps):
            for args in packed_sets:
                kc.launch(kernel, grid, args, stream.cuda_stream)
    return replay_times_us(g, replays, reps * len(packed_sets))


def chain_times_us(kernel, grid, packed_sets: list, replays: int, launches: int = 64, pdl: bool = True) -> list[float]:
    """As launch_times_us, the launches chained as the step's graph chains its nodes (runtime/gpu.py):
    programmatic edges when ``pdl``, so each launch's programs start while the previous one finishes (what
    a kernel does before its PDL wait overlaps the previous launch)."""
    reps = max(1, launches // len(packed_sets))
    _, graph_exec = kc.chain_graph([(kernel, grid, a) for _ in range(reps) for a in packed_sets], pdl)
    stream = torch.cuda.Stream()
    n = reps * len(packed_sets)
    cu = kc.driver()
    times = []
    torch.cuda.synchronize()
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        kc.check(cu.cuGraphLaunch(graph_exec, stream.cuda_stream), "cuGraphLaunch")
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / n)
    return times


L2_BYTES = 50 << 20


def rotating_copies(nbytes: int) -> int:
    """How many copies of operands of ``nbytes`` a timing graph rotates over so that together they hold
    four times the 50 MB L2 (each launch then reads from DRAM): 1 to 16."""
    return max(1, min(16, -(-4 * L2_BYTES // nbytes)))
