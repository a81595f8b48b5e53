"""CPU reference runtime: executes the step program op by op with the torch references of kernels/
(each op kind's ``reference`` in compiler/ops.py, called as ``reference(*operands, **attrs)``).

It runs any plan (whatever its target), one token per ``run()``, keeping the conv and recurrent
states (fp32) and the KV caches between steps. It is the oracle the GPU paths are checked against.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from kestrel.artifacts.errors import DraftSourceError
from kestrel.artifacts.plan import Plan
from kestrel.compiler.ir import (TOKENS_STATE, Dyn, IRError, Program, State, Value, Weight, is_q4, q4_group,
                                 q4_placements)
from kestrel.compiler.ir_text import parse_program
from kestrel.compiler.ops import OPS, is_view
from kestrel.compiler.launch_plan import REPLAY_STATE as REPLAY
from kestrel.kernels.fill import fill_random_words, fill_runs
from kestrel.kernels.matvec import q4_codes
from kestrel.kernels.sample import step_end_ref

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i32": torch.int32}


def weight_tensor(raw, w: Weight) -> torch.Tensor:
    """A weight as the reference kernels take it: its stored dtype; for q4 its codes and scales as ``q4`` (the
    products read only those: ``matvec_ref``, ``moe.weight_rows``), on an [N, K] tensor of NaN that takes no
    memory (stride 0), so any other use of a q4 weight's values shows as NaN. ~1 byte a weight where the
    dequantised fp32 copy beside the codes took 5: 4 layers of the 80B-A3B shape load in 8.4 GB (peak, random
    weights), where they did not fit this 24 GB machine."""
    arr = np.frombuffer(raw, dtype=np.uint8).copy()  # own the bytes: the file map may close
    t = torch.from_numpy(arr)
    if is_q4(w.type.dtype):
        n, k = w.type.shape
        lean = torch.full((1, 1), float("nan")).expand(n, k)
        lean.q4 = (*q4_codes(t, n, k, q4_group(w.type.dtype)), q4_group(w.type.dtype))
        return lean
    return t.view(TORCH_DTYPES[w.type.dtype]).reshape(w.type.shape)


def _filled(w: Weight, runs) -> np.ndarray:
    """A random plan's weight: its bytes of the region the fill runs leave, made for it alone (the whole region,
    41.6 GB at 80B-A3B q4, is never held)."""
    lo, hi = w.loc[1] // 4, -(-(w.loc[1] + w.type.nbytes) // 4)
    start = w.loc[1] - 4 * lo
    return fill_random_words(lo, hi, runs).view(np.uint8)[start:start + w.type.nbytes]


class CpuStep:
    """The step program bound to weights and states. ``dyn`` holds the dyn slots (python numbers).

    Runs the program at any stage of the pipeline: if it has no step_end op (dyn slots still on the
    host, before hoist_dynamic), ``run`` does step_end's work itself. The step protocol (``begin``,
    ``run``, ``read_tokens``, ``mark_ms``) is the one runtime/generate.py drives; see there.
    """

    mode = "cpu-reference"
    synchronous = True  # run() returns once the steps are done

    def __init__(self, plan: Plan | None = None, *, program: Program | None = None, weights=None,
                 max_seq: int | None = None, prefill_program: Program | None = None,
                 spec_programs: tuple[Program, Program] | None = None):
        if plan is not None:
            program = parse_program(plan.program_text)
            if plan.prefill_program_text is not None:
                prefill_program = parse_program(plan.prefill_program_text)
            if plan.spec_programs is not None:
                spec_programs = tuple(parse_program(t) for t in plan.spec_programs)
            max_seq = plan.manifest["max_seq"]
            every = dict(program.weights)  # the step's weights and the speculative programs' (the MTP head's)
            for p in spec_programs or ():
                every.update({n: w for n, w in p.weights.items() if n not in every})
            if plan.random_weights is not None:  # the same words the GPU's fill launches write
                rw = plan.random_weights  # q4_scales: since stop 33 (older plans: the scales as the chunks left them)
                q4 = q4_placements(every.values()) if rw.get("q4_scales") else ()
                runs = fill_runs(program.arena["weights"] // 4, rw["seed"], q4)
                weights = {name: weight_tensor(_filled(w, runs), w) for name, w in every.items()}
            else:
                weights = {name: weight_tensor(plan.read(name), w) for name, w in every.items()}
        self.program = prog = program
        # the M-row step (a prompt chunk of prefill_rows tokens a run), sharing weights, states and dyn slots
        self.prefill_program = prefill_program
        self.prefill_rows = next((op.attrs["rows"] for op in prefill_program.ops if op.kind == "prefill_end"), 0) \
            if prefill_program is not None else 0
        self.max_seq = max_seq
        self.weights = weights
        self.host_step_end = not any(op.kind == "step_end" for op in prog.ops)
        if TOKENS_STATE not in prog.states or "n_prompt" not in prog.dyn:
            raise IRError(f"the program declares no token sequence (state {TOKENS_STATE}, dyn n_prompt) to run from")
        # speculative decoding (--speculative mtp): its prefill and iteration, K drafts an iteration
        self.spec_prefill_program, self.spec_program = spec_programs or (None, None)
        self.spec_k = next((op.attrs["rows"] - 1 for op in self.spec_program.ops if op.kind == "spec_begin"), 0) \
            if self.spec_program is not None else 0
        # speculative sampling at temperature > 0 and replay (plans from before them speculate greedily only)
        self.spec_sampling = self.spec_program is not None and any(op.kind == "spec_sample_rows"
                                                                   for op in self.spec_program.ops)
        progs = [p for p in (prog, prefill_program, self.spec_prefill_program, self.spec_program) if p is not None]
        self.states = {}
        for p in progs:  # every program's states (the MTP head's KV caches, the verify's row states)
            for name, s in p.states.items():
                self.states.setdefault(name, torch.zeros(s.type.shape, dtype=TORCH_DTYPES[s.type.dtype]))
        self.dyn: dict[str, int | float] = {name: 0 for p in progs for name in p.dyn}
        self.outputs: dict[str, torch.Tensor] = {}
        self.op_ms: list | None = None  # when a list: each launch's (non-view op's) host time, in ms
        self.accepted_log: list[int] = []  # drafts accepted by each speculative iteration run

    def reset(self) -> None:
        for s in self.states.values():
            s.zero_()
        for k in self.dyn:
            self.dyn[k] = 0

    def begin(self, prompt: list[int], temperature: float, top_p: float, seed: int, start: int = 0,
              top_k: int = 0, min_p: float = 0.0) -> None:
        """Start a request: zeroed states, the prompt ids in the token sequence, dyn slots set. ``start`` > 0
        continues the sequence (the states hold positions < start): only prompt[start:] is written."""
        if start == 0:
            self.reset()
        self.states[TOKENS_STATE][start:len(prompt)] = torch.tensor(prompt[start:], dtype=torch.int32)
        self.dyn.update(pos=start, token=prompt[start], n_prompt=len(prompt), temperature=temperature, top_p=top_p,
                        seed=seed, top_k=top_k, min_p=min_p)
        if "replay" in self.dyn:
            self.dyn["replay"] = 0

    def set_replay(self, tokens: list[int], accept: float) -> None:
        """Controlled acceptance for this request (after ``begin``): the replayed token sequence in
        ``spec.replay`` (zeros past it) and dyn.replay set (kernels/speculative.py, replay_drafts)."""
        if REPLAY not in self.states:
            raise DraftSourceError("this plan has no replay buffer for --draft-source (made by an older Kestrel): "
                                   "rebuild it with --speculative mtp")
        replay = self.states[REPLAY]
        replay.zero_()
        n = min(len(tokens), replay.numel())
        replay[:n] = torch.tensor(tokens[:n], dtype=torch.int32)
        self.dyn.update(replay=1, replay_accept=float(accept))

    def run(self, n: int = 1, marks: list | None = None) -> None:
        """``n`` decode steps; each reads dyn.token at dyn.pos, leaves dyn.sampled, feeds the next
        token in and advances dyn.pos. ``marks`` receives a timestamp after each step."""
        for _ in range(n):
            self._step()
            if marks is not None:
                marks.append(time.perf_counter())

    def read_tokens(self, lo: int, hi: int) -> "_Ready":
        return _Ready([int(t) for t in self.states[TOKENS_STATE][lo:hi]])

    @staticmethod
    def mark_ms(marks: list) -> list[float]:
        return [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]

    def run_prefill(self, n: int = 1, marks: list | None = None) -> None:
        """``n`` runs of the M-row step: each takes the next ``prefill_rows`` prompt tokens from
        dyn.pos; after the prompt's last chunk it has sampled the first new token and fed it in.
        ``marks`` receives a timestamp after the last."""
        for _ in range(n):
            self._run(self.prefill_program)
        if marks is not None:
            marks.append(time.perf_counter())

    def run_spec_prefill(self, n: int = 1, marks: list | None = None) -> None:
        """``run_prefill`` with the speculative prefill: the M-row step that also runs the MTP head over the
        chunk and, after the prompt's last chunk, leaves K drafts at tokens[n_prompt + 1 ..]."""
        for _ in range(n):
            self._run(self.spec_prefill_program)
        if marks is not None:
            marks.append(time.perf_counter())

    def run_spec(self, n: int = 1, marks: list | None = None) -> None:
        """``n`` speculative iterations: each verifies the token at dyn.pos and the K drafts after it, accepts
        on the device, rolls the recurrent states back and drafts the next K; pos advances by 1 .. K + 1.
        ``marks`` receives a timestamp after each iteration."""
        for _ in range(n):
            self._run(self.spec_program)
            self.accepted_log.append(int(self.dyn["accepted"]))
            if marks is not None:
                marks.append(time.perf_counter())

    def read_spec(self, lo: int, hi: int) -> "_Ready":
        """tokens[lo:hi] and dyn.pos, as they stand after the iterations run so far."""
        return _Ready(([int(t) for t in self.states[TOKENS_STATE][lo:hi]], int(self.dyn["pos"])))

    def _step(self) -> None:
        self._run(self.program)
        if self.host_step_end:
            d = self.dyn
            d["pos"], d["token"] = step_end_ref(d["pos"], d["sampled"], d["n_prompt"], self.states[TOKENS_STATE])

    def _run(self, program: Program) -> None:
        env: dict[int, torch.Tensor] = {}

        def get(x):
            if isinstance(x, Value):
                return env[id(x)]
            if isinstance(x, Weight):
                return self.weights[x.name]
            if isinstance(x, State):
                return self.states[x.name]
            if isinstance(x, Dyn):
                return int(self.dyn[x.name]) if x.dtype == "i32" else float(self.dyn[x.name])
            raise TypeError(x)

        for op in program.ops:
            d = OPS[op.kind]
            t = time.perf_counter()
            res = d.reference(*[get(x) for x in op.ins], **op.attrs)
            if self.op_ms is not None and not is_view(op):
                self.op_ms.append((time.perf_counter() - t) * 1e3)
            if not isinstance(res, tuple):
                res = (res,)
            if d.writes_dyn:  # sample, step_end: their results are dyn slots
                for slot, value in zip(op.outs, res):
                    self.dyn[slot.name] = value
                continue
            for v, r in zip(op.outs, res):
                env[id(v)] = r
        self.outputs = {name: env[id(v)] for name, v in program.outputs.items()}
        self.values = env  # every value of the last run, by id (tests read the MoE routing buffers)

    def output(self, name: str) -> np.ndarray:
        return self.outputs[name].detach().float().numpy()


class _Ready:
    """The CPU path's answer to read_tokens and read_spec: already there."""

    def __init__(self, tokens):
        self.tokens = tokens

    def wait(self) -> list[int]:
        return self.tokens
