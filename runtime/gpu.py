"""GPU runtime: runs a plan's launch list from its cubins. numpy + cuda.bindings only (no torch).

Its only input is the plan's launch plan (bound to the arena by runtime/launch_binding.py): at load
(before any request) check the plan's arch against the GPU, allocate the one arena, upload the
weights (checksummed as they are read) or make the fill launches of a random-weights plan, zero the
state, load the cubins, pack every launch's arguments once, and — unless KESTREL_GRAPH=0 —
build the step's CUDA graph from explicit kernel nodes and instantiate it. Where every kernel of the
step was compiled with the PDL wait (sm_90 and later; kernels/pdl.py) a second graph chains the same
nodes by programmatic edges, so each kernel's programs are resident and waiting when the previous one
ends; the two are timed against each other at load (``PDL_TRIAL_STEPS`` replays each, interleaved)
and the chained one kept unless it is more than ``PDL_MARGIN`` slower (``pdl_wins``: the trial's
short replays flatter plain edges, which slow down over a sustained request): on the H200 the
chained graph was 3-13% faster on some plans and 2-29% slower on others, with no rule of size that
predicts which (bench/results/stop19, stop20). Where the plan's step kernels have late-trigger variants
(compiler/codegen.py: the matvecs that let the next kernel launch at their start, compiled again to do it
after their K loop), a third graph chains the step with those and joins the trial, and the faster of the
two chained graphs is the one weighed against plain edges (``pdl_pick``; 2B-9B q4 on the H200 kept the late
one, 0.8B, 27B and 80B-A3B the rule's: bench/results/stop37). KESTREL_PDL=0 / 1 skips the
trial (1: the rule's kernels). The speculative iteration's graph gets the same trial (plain against
programmatic edges; stop 22 measured the chained one 1.2-2.2% faster at 27B q4 and 0.8B bf16, when the runtime
kept plain edges). The M-row step's graph has plain edges. A plan with an M-row
step gets its launches packed too (``run_prefill``), and its own graph unless KESTREL_GRAPH_M=0.
Per token: one graph launch (or the same launches one by one in streaming mode); the step_end kernel advances pos and
feeds the next token in from the ``tokens`` state (prompt ids uploaded once per request, then the
sampled tokens), so generation needs no host write per token; sampled tokens come back to pinned
host memory by asynchronous copies every few steps (see runtime/generate.py).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from kestrel.artifacts.errors import ArtifactError, DeviceError, DoesNotFitError, DraftSourceError, UnsupportedError
from kestrel.artifacts.plan import Plan
from kestrel.runtime import cuda as kc
from kestrel.runtime.launch_binding import bind


def graph_enabled(no_graph_flag: bool = False) -> bool:
    """The KESTREL_GRAPH gate (M=1 step graph): on unless KESTREL_GRAPH=0 or --no-graph."""
    return not no_graph_flag and os.environ.get("KESTREL_GRAPH", "1") != "0"


PDL_TRIAL_STEPS = 5  # replays of each step graph timed at load (after one each to warm up)
PDL_MARGIN = 0.02  # plain edges are kept only when the chained graph's median step is slower by more than this


def pdl_choice() -> bool | None:
    """The KESTREL_PDL gate for the step graph's programmatic edges: None (unset: time both graphs at
    load, keep the faster), False (0: plain edges), True (1: programmatic, no trial)."""
    return {"0": False, "1": True}.get(os.environ.get("KESTREL_PDL", ""))


def pdl_wins(plain_ms: list[float], programmatic_ms: list[float]) -> bool:
    """The load-time trial's verdict: the chained graph's median step is at most PDL_MARGIN slower
    than the plain one's (a tie keeps programmatic edges). Asymmetric because the trial's few replays
    flatter plain edges: over a sustained request a plain graph runs 1-14% slower than in its first
    steps, a chained one ~0.5% (H200, stop 20, calls 7-8: 0.8B bf16 plain 0.779 then 0.829 ms/token
    against chained 0.774-0.778; 27B q4 plain 5.47 then 5.61 against chained 5.54-5.56; 27B bf16 13.17
    then 13.30 against 13.14-13.20; 0.8B q4 0.583 then 0.633 against 0.555-0.561), which the trial
    saw as plain 0-1.5% ahead. Where chained edges truly lose (2B-9B q4: 13-29% in the trial) plain
    edges still win."""
    return _median(programmatic_ms) <= _median(plain_ms) * (1 + PDL_MARGIN)


def _median(v: list[float]) -> float:
    return sorted(v)[len(v) // 2]


def pdl_pick(plain_ms: list[float], programmatic_ms: list[float], late_ms: list[float] | None = None) -> str:
    """The load-time trial's choice of step graph: "late" (programmatic edges, the late-trigger kernels) where
    that graph's median step is below the rule's chained one's, else "programmatic"; then "plain" where the
    chosen one loses to plain edges by more than PDL_MARGIN (``pdl_wins``)."""
    late = late_ms is not None and _median(late_ms) < _median(programmatic_ms)
    if not pdl_wins(plain_ms, late_ms if late else programmatic_ms):
        return "plain"
    return "late" if late else "programmatic"


def graph_m_enabled() -> bool:
    """The KESTREL_GRAPH_M gate (the M-row step's graph): on unless KESTREL_GRAPH_M=0 (the README's gate
    table has the paired A/B that decided it)."""
    return os.environ.get("KESTREL_GRAPH_M", "1") != "0"


def graph_spec_enabled() -> bool:
    """The KESTREL_GRAPH_SPEC gate (the speculative iteration's graph, plans built with --speculative mtp):
    on unless KESTREL_GRAPH_SPEC=0 (then its launches are streamed; --no-graph turns every graph off)."""
    return os.environ.get("KESTREL_GRAPH_SPEC", "1") != "0"


def spec_sampling_enabled() -> bool:
    """The KESTREL_SPEC_SAMPLING gate (speculative plans, requests at temperature > 0): on unless
    KESTREL_SPEC_SAMPLING=0. On, a sampled request speculates with the iteration's speculative-sampling
    kernels (kernels/speculative.py: spec_filter, then draft_sample / spec_sample_rows, many programs a
    row); off, it decodes plainly (one-token steps, the many-CTA sampler). Their first, one-program-a-row
    form took 46.5 ms/token at 27B q4 on the H200 against plain sampling's 6.3 (bench/results/stop22, call 7),
    so the gate was off by default; the many-program form costs a 27B q4 iteration 0.081 ms over the greedy
    one at temperature 0.7 / top-p 0.8 / top-k 20 (bench/results/stop23, call 4), so it is on. Greedy
    requests and ``--draft-source replay:`` do not read it."""
    return os.environ.get("KESTREL_SPEC_SAMPLING", "1") != "0"


class _DynSlots:
    """dict-like access to the dyn buffer in device memory (4-byte slots)."""

    def __init__(self, step: "GpuStep", table: dict):
        self.step, self.table = step, table

    def __contains__(self, name):
        return name in self.table

    def __iter__(self):
        return iter(self.table)

    def __getitem__(self, name):
        slot = self.table[name]
        buf = np.zeros(1, dtype=np.int32 if slot.dtype == "i32" else np.float32)
        self.step.sync()
        self.step.copy_from_device(buf, slot.address)
        return buf[0].item()

    def __setitem__(self, name, value):
        slot = self.table[name]
        buf = np.array([value], dtype=np.int32 if slot.dtype == "i32" else np.float32)
        self.step.copy_to_device(slot.address, buf)


LOAD_RESERVE = 256 << 20  # what loading takes beside the arena once the context exists: cubins, graphs, events


def check_free_memory(arena_bytes: int) -> None:
    """DoesNotFitError (exit 12) unless the arena and LOAD_RESERVE fit the device's free memory now (other
    processes hold part of it, or the plan was built for a larger GPU of its class): said with the numbers
    before the allocation, not as CUDA_ERROR_OUT_OF_MEMORY from inside it."""
    free, total = kc.check(kc.driver().cuMemGetInfo(), "cuMemGetInfo")
    if arena_bytes + LOAD_RESERVE > free:
        raise DoesNotFitError(f"this plan needs a {arena_bytes / 1e9:.1f} GB arena (+ {LOAD_RESERVE / 1e9:.2f} GB "
                              f"for its kernels and graphs) and the GPU has {free / 1e9:.1f} GB free of "
                              f"{total / 1e9:.1f} GB: free the GPU (nvidia-smi shows what holds it) or build a "
                              f"smaller plan (--quant q4, a lower --max-seq)")


class GpuStep:
    synchronous = False  # run() enqueues the steps on the stream

    def __init__(self, plan: Plan, use_graph: bool = True, log=None, use_graph_m: bool | None = None):
        lp = plan.launch_plan
        target = plan.manifest["target"]
        if target == "cpu" or not lp or not lp.get("kernels"):
            raise UnsupportedError(f"this plan was built for {target}: it has no GPU kernels; rebuild with "
                                   f"--target sm_XX, or run it with --device cpu")
        cu = kc.driver()
        self.dev, self.ctx = kc.init(0)
        cc = kc.compute_capability(self.dev)
        want = int(target.split("_")[1])
        if cc != want:
            raise DeviceError(f"this plan was built for {target}, this GPU is sm_{cc}: rebuild with --target sm_{cc}")
        if lp.get("tokens") is None or "n_prompt" not in lp["dyn_slots"]:
            raise ArtifactError("this plan has no device token sequence (made by an older Kestrel): rebuild it")
        self.max_seq = plan.manifest["max_seq"]
        self.stream = kc.check(cu.cuStreamCreate(0), "cuStreamCreate")
        check_free_memory(lp["arena_bytes"])
        # one arena: the launch plan's regions back to back, bound to its address
        self.arena = kc.check(cu.cuMemAlloc(lp["arena_bytes"]), "cuMemAlloc (arena)")
        self.binding = b = bind(lp, int(self.arena))
        kc.check(cu.cuMemsetD8(self.arena, 0, lp["arena_bytes"]), "cuMemsetD8")
        self.outputs = self._step_outputs = {name: (o.address, o.numel) for name, o in b.outputs.items()}
        self._prefill_outputs = {name: (o.address, o.numel) for name, o in (b.prefill_outputs or {}).items()}
        self.tokens_addr = b.tokens.address
        # pinned host mirror of the token sequence: the asynchronous copies land here
        self._host_ptr = kc.check(cu.cuMemAllocHost(4 * self.max_seq), "cuMemAllocHost")
        self.host_tokens = np.ctypeslib.as_array((ctypes.c_int32 * self.max_seq).from_address(int(self._host_ptr)))
        self._timing_events: list = []  # reused timing marks (run(..., marks))
        self._n_marks = 0
        self._copy_events = [kc.check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
                             for _ in range(4)]
        self._n_copies = 0
        self.probes = lp.get("probes", {})  # measuring kernels in the table (runtime/bench.py)
        self.kernels = [kc.Kernel(plan.cubin(k["part"]), k["name"], k["num_warps"], k["shared"],
                                  bool(k["constexprs"].get("PDL")), k.get("carveout", -1)) for k in lp["kernels"]]
        fill = [self._pack(launch) for launch in b.fill]  # a random-weights plan: the weights made on the device
        for kernel, grid, args in fill:
            kc.launch(kernel, grid, args, self.stream)
        self.sync()  # the packed arguments live until the launches have been made
        for name, addr, nbytes in b.weights:  # a checkpoint plan: checksummed as read, one weight in memory at a time
            data = np.frombuffer(plan.read(name), dtype=np.uint8)
            if data.nbytes != nbytes:
                raise ArtifactError(f"{plan.path}: weight {name!r} has {data.nbytes} bytes, the launch plan "
                                    f"places {nbytes}; rebuild the plan")
            self.copy_to_device(addr, data)
        self.launches = [self._pack(launch) for launch in b.launches]
        # the M-row step (prompts in chunks of prefill_rows tokens), when the plan has one
        self.prefill_rows = b.prefill_rows
        self.prefill_launches = [self._pack(launch) for launch in b.prefill_launches or []]
        self.dyn = _DynSlots(self, b.dyn)
        self.graph_fallbacks = 0
        self.graph_exec = self._try_graph(self.launches, log, False) if use_graph else None
        self.use_graph = self.graph_exec is not None
        # the step graph's nodes chained by programmatic edges, when the trial (or KESTREL_PDL) says so; with the
        # late-trigger kernels instead, where the plan has them and the trial says so
        self.pdl, self.pdl_late, self.pdl_trial = False, False, None
        choice = pdl_choice()
        if self.use_graph and choice is not False and all(kernel.pdl for kernel, _, _ in self.launches):
            lates = [k.get("late") for k in lp["kernels"]]
            late_launches = [(self.kernels[lates[bl.kernel_index]], grid, args) if lates[bl.kernel_index] is not None
                             else (kernel, grid, args) for bl, (kernel, grid, args) in zip(b.launches, self.launches)]
            graphs = {}
            try:
                graphs["programmatic"] = self._build_graph(self.launches, True)
                if choice is None and any(x is not None for x in lates):
                    graphs["late"] = self._build_graph(late_launches, True)
            except DeviceError as e:  # the graphs built so far stay candidates
                if log:
                    log(f"note: a step graph with programmatic edges was not built ({e})")
            if graphs:
                pick, self.pdl_trial = self._keep_one(self.graph_exec, graphs, choice)
                if pick != "plain":
                    self.graph_exec, self.pdl, self.pdl_late = graphs[pick], True, pick == "late"
                if pick == "late":  # streaming and the profile launch what the graph does
                    self.launches = late_launches
        use_graph_m = graph_m_enabled() if use_graph_m is None else use_graph_m
        self.graph_m_exec = (self._try_graph(self.prefill_launches, log, False) if use_graph_m and self.prefill_rows
                             else None)
        self.use_graph_m = self.graph_m_exec is not None
        # speculative decoding (--speculative mtp): its prefill (an M-row program, under KESTREL_GRAPH_M) and
        # its iteration (KESTREL_GRAPH_SPEC), each its own graph, built here at load: the prefill's with plain
        # edges, the iteration's with plain or programmatic ones as the load-time trial says
        self.spec_k = b.draft_tokens if b.spec_launches else 0
        # speculative sampling at temperature > 0 (plans from before it speculate greedily only), under the
        # KESTREL_SPEC_SAMPLING gate (0: sampled requests decode plainly)
        self.spec_sampling = bool(self.spec_k) and spec_sampling_enabled() and any(
            launch["op"] == "spec_sample_rows" for launch in lp["speculative"]["iteration"]["launches"])
        self.spec_prefill_launches = [self._pack(launch) for launch in b.spec_prefill_launches or []]
        self.spec_launches = [self._pack(launch) for launch in b.spec_launches or []]
        self._spec_outputs = {name: (o.address, o.numel) for name, o in (b.spec_outputs or {}).items()}
        self.graph_spec_prefill_exec = (self._try_graph(self.spec_prefill_launches, log, False)
                                        if self.spec_k and self.use_graph_m else None)
        self.graph_spec_exec = (self._try_graph(self.spec_launches, log, False)
                                if self.spec_k and use_graph and graph_spec_enabled() else None)
        # the iteration's graph chained by programmatic edges too, kept as the step's is (the trial, KESTREL_PDL)
        self.spec_pdl, self.spec_pdl_trial = False, None
        if (self.graph_spec_exec is not None and choice is not False
                and all(kernel.pdl for kernel, _, _ in self.spec_launches)):
            try:
                chained = self._build_graph(self.spec_launches, True)
            except DeviceError as e:
                chained = None
                if log:
                    log(f"note: the speculative iteration's graph with programmatic edges was not built ({e})")
            if chained is not None:
                pick, self.spec_pdl_trial = self._keep_one(self.graph_spec_exec, {"programmatic": chained}, choice)
                if pick != "plain":
                    self.graph_spec_exec, self.spec_pdl = chained, True
        # pinned slots for dyn.pos read back beside the tokens (read_spec), one per copy event
        self._pos_ptr = kc.check(cu.cuMemAllocHost(4 * len(self._copy_events)), "cuMemAllocHost")
        self.host_pos = np.ctypeslib.as_array((ctypes.c_int32 * len(self._copy_events)).from_address(int(self._pos_ptr)))
        self.sync()

    def _keep_one(self, plain, chained: dict, choice: bool | None) -> tuple[str, dict | None]:
        """Of a program's plain graph and its chained ones ({name: graph}), the one kept: by the load-time trial
        (``pdl_pick``) unless KESTREL_PDL chose (1: "programmatic"); the others destroyed. (name, trial or None)."""
        trial = self._time_graphs({"plain": plain, **chained}) if choice is None else None
        pick = pdl_pick(**trial) if trial else "programmatic"
        for name, g in {"plain": plain, **chained}.items():
            if name != pick:
                kc.check(kc.driver().cuGraphExecDestroy(g), "cuGraphExecDestroy")
        return pick, trial

    def _time_graphs(self, graphs: dict) -> dict:
        """Median-ready step times (ms) of graphs of the same step, {name: graph}, replayed in turn at load (before
        any request: begin() zeroes the states and dyn slots the replays advance), after one replay each to warm
        up: {"<name>_ms": [..]}."""
        marks: list = []
        gs = list(graphs.values())
        for g in gs[:-1]:
            self._replay(1, g, None, None)
        self._replay(1, gs[-1], None, marks)  # its warm-up replay gives the first mark
        for _ in range(PDL_TRIAL_STEPS):
            for g in gs:
                self._replay(1, g, None, marks)
        ms = self.mark_ms(marks)
        self._n_marks = 0
        return {f"{name}_ms": ms[i::len(gs)] for i, name in enumerate(graphs)}

    def time_without(self, drop: set[int], rounds: int) -> dict:
        """The step graph replayed alternately with the same chain without the launches at indices ``drop`` (its
        edges programmatic as the step graph's), ``rounds`` times each: {"graph_ms": [..], "without_ms": [..]}.
        Timing only: the launches kept read what the dropped ones would have written (states, outputs)."""
        cu = kc.driver()
        graph, without = kc.chain_graph([x for i, x in enumerate(self.launches) if i not in drop], self.pdl)
        try:
            marks: list = []
            self._replay(1, self.graph_exec, None, marks)
            for _ in range(rounds):
                self._replay(1, without, None, marks)
                self._replay(1, self.graph_exec, None, marks)
            ms = self.mark_ms(marks)
        finally:
            kc.check(cu.cuGraphExecDestroy(without), "cuGraphExecDestroy")
            kc.check(cu.cuGraphDestroy(graph), "cuGraphDestroy")
            self._n_marks = 0
        return {"without_ms": ms[0::2], "graph_ms": ms[1::2]}

    @property
    def mode(self) -> str:
        return "gpu-graph" if self.use_graph else "gpu-stream"

    def set_graph(self, on: bool) -> None:
        """Switch between replaying the graph and streaming the same launches (same arena)."""
        if on and self.graph_exec is None:
            raise DeviceError("the CUDA graph was not built for this step")
        self.sync()
        self.use_graph = on

    def set_graph_m(self, on: bool) -> None:
        """The same switch for the M-row step."""
        if on and self.graph_m_exec is None:
            raise DeviceError("the CUDA graph of the M-row step was not built (KESTREL_GRAPH_M=0, --no-graph, or its "
                              "build failed)")
        self.sync()
        self.use_graph_m = on

    def _try_graph(self, launches, log, pdl: bool):
        try:
            return self._build_graph(launches, pdl)
        except DeviceError as e:
            self.graph_fallbacks += 1
            if log:
                log(f"warning: CUDA graph build failed ({e}); falling back to streaming launches")
            return None

    def _pack(self, launch):
        """(kernel, grid, arguments packed once) for a bound launch."""
        return (self.kernels[launch.kernel_index], launch.grid,
                kc.PackedArgs(launch.types, launch.values, (launch.scratch, 0)))

    # --- memory ------------------------------------------------------------------------------
    def copy_to_device(self, dst: int, src: np.ndarray) -> None:
        cu = kc.driver()
        kc.check(cu.cuMemcpyHtoDAsync(dst, src.ctypes.data, src.nbytes, self.stream), "cuMemcpyHtoDAsync")
        kc.check(cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def copy_from_device(self, dst: np.ndarray, src: int) -> None:
        cu = kc.driver()
        kc.check(cu.cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.nbytes, self.stream), "cuMemcpyDtoHAsync")
        kc.check(cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def sync(self) -> None:
        kc.check(kc.driver().cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    # --- the step ----------------------------------------------------------------------------
    def _build_graph(self, launches, pdl: bool):
        """The launches as a chain of kernel nodes (kc.chain_graph); the graph is kept alive with the step."""
        graph, graph_exec = kc.chain_graph(launches, pdl)
        self._graphs = getattr(self, "_graphs", []) + [graph]
        return graph_exec

    def reset(self) -> None:
        cu = kc.driver()
        self.sync()
        for addr, nbytes in self.binding.reset:  # states and dyn slots
            kc.check(cu.cuMemsetD8(addr, 0, nbytes), "cuMemsetD8 (reset)")
        self.sync()

    def begin(self, prompt: list[int], temperature: float, top_p: float, seed: int, start: int = 0,
              top_k: int = 0, min_p: float = 0.0) -> None:
        """Start a request: zero the states, upload the prompt ids and the dyn slots (the request's
        one host write; generate checked the lengths, and the kernels clamp anyway). ``start`` > 0
        continues the sequence instead: the states already hold positions < start (a chat's earlier
        turns), so only prompt[start:] is uploaded and nothing is zeroed."""
        if start == 0:
            self.reset()
        self.sync()
        slots, base = self.dyn.table, self.binding.regions["dyn"]
        image = np.zeros(max(s.address - base for s in slots.values()) // 4 + 1, dtype=np.int32)
        values = dict(pos=start, token=prompt[start], n_prompt=len(prompt), temperature=temperature, top_p=top_p,
                      seed=seed, top_k=top_k, min_p=min_p, replay=0)
        for name, v in values.items():
            if name in slots:
                arr = image.view(np.float32) if slots[name].dtype == "f32" else image
                arr[(slots[name].address - base) // 4] = v
        self.copy_to_device(base, image)
        self.copy_to_device(self.tokens_addr + 4 * start, np.asarray(prompt[start:self.max_seq], dtype=np.int32))
        self._n_marks = 0

    def set_replay(self, tokens: list[int], accept: float) -> None:
        """Controlled acceptance for this request (after ``begin``): the replayed token sequence uploaded to
        ``spec.replay`` (zeros past it), dyn.replay and dyn.replay_accept set (kernels/speculative.py)."""
        buf = self.binding.spec_replay
        if buf is None:
            raise DraftSourceError("this plan has no replay buffer for --draft-source (made by an older Kestrel): "
                                "rebuild it with --speculative mtp")
        image = np.zeros(buf.numel, dtype=np.int32)
        n = min(len(tokens), buf.numel)
        image[:n] = np.asarray(tokens[:n], dtype=np.int32)
        self.copy_to_device(buf.address, image)
        self.dyn["replay_accept"] = float(accept)
        self.dyn["replay"] = 1

    def run(self, n: int = 1, marks: list | None = None) -> None:
        """``n`` steps, asynchronously on the stream (reading a dyn slot or an output waits for them);
        ``marks`` receives a timing event recorded after each step."""
        self._replay(n, self.graph_exec if self.use_graph else None, self.launches, marks)
        self.outputs = self._step_outputs

    def run_prefill(self, n: int = 1, marks: list | None = None) -> None:
        """``n`` runs of the M-row step, each taking the next ``prefill_rows`` prompt tokens from
        dyn.pos (after the prompt's last chunk it has sampled the first new token and fed it in);
        ``marks`` as in run."""
        if not self.prefill_rows:
            raise UnsupportedError("this plan has no M-row step: rebuild it with --prefill-rows N")
        self._replay(n, self.graph_m_exec if self.use_graph_m else None, self.prefill_launches, marks)
        self.outputs = self._prefill_outputs  # output() reads the last program's (the chunk's last valid row)

    def run_spec_prefill(self, n: int = 1, marks: list | None = None) -> None:
        """``run_prefill`` with the speculative prefill (the M-row step that also runs the MTP head over the
        chunk; after the prompt's last chunk the first token and K drafts are in ``tokens``)."""
        if not self.spec_k:
            raise UnsupportedError("this plan has no speculative programs: rebuild it with --speculative mtp")
        self._replay(n, self.graph_spec_prefill_exec, self.spec_prefill_launches, marks)
        self.outputs = self._prefill_outputs

    def run_spec(self, n: int = 1, marks: list | None = None) -> None:
        """``n`` speculative iterations, asynchronously: each verifies the token at dyn.pos and the K drafts
        after it, accepts on the device, rolls the recurrent states back and drafts the next K (pos
        advances by 1 .. K + 1); ``marks`` as in run."""
        if not self.spec_k:
            raise UnsupportedError("this plan has no speculative programs: rebuild it with --speculative mtp")
        self._replay(n, self.graph_spec_exec, self.spec_launches, marks)
        self.outputs = self._spec_outputs

    def read_spec(self, lo: int, hi: int) -> "_SpecCopy":
        """tokens[lo:hi] and dyn.pos as they stand after the work enqueued so far, copied to pinned host
        memory behind it; ``wait()`` on the handle returns (tokens, pos)."""
        cu = kc.driver()
        i = self._n_copies % len(self._copy_events)
        kc.check(cu.cuMemcpyDtoHAsync(int(self._host_ptr) + 4 * lo, self.tokens_addr + 4 * lo, 4 * (hi - lo),
                                      self.stream), "cuMemcpyDtoHAsync (tokens)")
        kc.check(cu.cuMemcpyDtoHAsync(int(self._pos_ptr) + 4 * i, self.dyn.table["pos"].address, 4, self.stream),
                 "cuMemcpyDtoHAsync (pos)")
        ev = self._copy_events[i]  # (a ring of four: generate keeps at most two read-backs in flight)
        self._n_copies += 1
        kc.check(cu.cuEventRecord(ev, self.stream), "cuEventRecord")
        return _SpecCopy(self, ev, lo, hi, i)

    def _replay(self, n: int, graph_exec, launches, marks) -> None:
        cu = kc.driver()
        for _ in range(n):
            if graph_exec is not None:
                kc.check(cu.cuGraphLaunch(graph_exec, self.stream), "cuGraphLaunch")
            else:
                for kernel, grid, args in launches:
                    kc.launch(kernel, grid, args, self.stream)
            if marks is not None:
                if self._n_marks == len(self._timing_events):
                    self._timing_events.append(kc.check(cu.cuEventCreate(0), "cuEventCreate"))
                ev = self._timing_events[self._n_marks]
                self._n_marks += 1
                kc.check(cu.cuEventRecord(ev, self.stream), "cuEventRecord")
                marks.append(ev)

    def mark_ms(self, marks: list) -> list[float]:
        """Device time between consecutive marks, in ms."""
        cu = kc.driver()
        if marks:
            kc.check(cu.cuEventSynchronize(marks[-1]), "cuEventSynchronize")
        return [kc.check(cu.cuEventElapsedTime(a, b), "cuEventElapsedTime") for a, b in zip(marks, marks[1:])]

    def read_tokens(self, lo: int, hi: int) -> "_TokenCopy":
        """Copy tokens[lo:hi] to pinned host memory behind the steps enqueued so far; ``wait()`` on
        the handle returns them."""
        cu = kc.driver()
        kc.check(cu.cuMemcpyDtoHAsync(int(self._host_ptr) + 4 * lo, self.tokens_addr + 4 * lo, 4 * (hi - lo),
                                      self.stream), "cuMemcpyDtoHAsync (tokens)")
        # generate keeps at most two copies in flight and begin() drains the stream, so a ring of
        # four events is never re-recorded while someone still waits on it
        ev = self._copy_events[self._n_copies % len(self._copy_events)]
        self._n_copies += 1
        kc.check(cu.cuEventRecord(ev, self.stream), "cuEventRecord")
        return _TokenCopy(self, ev, lo, hi)

    def output(self, name: str) -> np.ndarray:
        addr, n = self.outputs[name]
        buf = np.empty(n, dtype=np.float32)
        self.sync()
        self.copy_from_device(buf, addr)
        return buf


class _SpecCopy:
    """An asynchronous read-back of token rows and dyn.pos (see GpuStep.read_spec)."""

    def __init__(self, step: GpuStep, event, lo: int, hi: int, slot: int):
        self.step, self.event, self.lo, self.hi, self.slot = step, event, lo, hi, slot

    def wait(self) -> tuple[list[int], int]:
        cu = kc.driver()
        kc.check(cu.cuEventSynchronize(self.event), "cuEventSynchronize")
        return [int(t) for t in self.step.host_tokens[self.lo:self.hi]], int(self.step.host_pos[self.slot])


class _TokenCopy:
    """An asynchronous copy of token sequence rows to the host (see GpuStep.read_tokens)."""

    def __init__(self, step: GpuStep, event, lo: int, hi: int):
        self.step, self.event, self.lo, self.hi = step, event, lo, hi

    def wait(self) -> list[int]:
        cu = kc.driver()
        kc.check(cu.cuEventSynchronize(self.event), "cuEventSynchronize")
        return [int(t) for t in self.step.host_tokens[self.lo:self.hi]]
