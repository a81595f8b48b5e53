"""CPU reference runtime: executes the step program op by op with the torch references of kernels/.

It runs any plan (whatever its target), one token per ``run()``, keeping the conv and recurrent
states (fp32) and the KV caches between steps. It is the oracle the GPU paths are checked against.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from kestrel.artifacts.plan import Plan
from kestrel.compiler.ir import TOKENS_STATE, Dyn, IRError, Program, State, Value, Weight, is_q4, q4_group
from kestrel.compiler.ir_text import parse_program
from kestrel.kernels.attention import attention_ref, attn_step_ref, kv_append_ref, rope_ref
from kestrel.kernels.elementwise import add_ref, l2norm_ref, sigmoid_gate_ref, swiglu_ref
from kestrel.kernels.embedding import embedding_ref
from kestrel.kernels.gated_delta import (conv1d_step_ref, gated_delta_step_ref, gdn_delta_ref, gdn_gates_ref,
                                          gdn_norm_ref, gdn_step_ref)
from kestrel.kernels.matvec import matvec_ref, matvec_swiglu_ref, q4_unpack
from kestrel.kernels.rmsnorm import add_rmsnorm_ref, gated_rmsnorm_ref, rmsnorm_ref
from kestrel.kernels.sample import sample_ref, step_end_ref

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "i32": torch.int32}


def weight_tensor(raw, w: Weight) -> torch.Tensor:
    """A weight as the reference kernels take it: its stored dtype, or dequantised fp32 for q4."""
    arr = np.frombuffer(raw, dtype=np.uint8).copy()  # own the bytes: the file map may close
    t = torch.from_numpy(arr)
    if is_q4(w.type.dtype):
        return q4_unpack(t, *w.type.shape, q4_group(w.type.dtype))
    return t.view(TORCH_DTYPES[w.type.dtype]).reshape(w.type.shape)


class CpuStep:
    """The step program bound to weights and states. ``dyn`` holds the dyn slots (python numbers).

    Runs the program at any stage of the pipeline: if it has no step_end op (dyn slots still on the
    host, before hoist_dynamic), ``run`` does step_end's work itself. The step protocol (``begin``,
    ``run``, ``read_tokens``, ``mark_ms``) is the one runtime/generate.py drives; see there.
    """

    mode = "cpu-reference"

    def __init__(self, plan: Plan | None = None, *, program: Program | None = None, weights=None,
                 max_seq: int | None = None):
        if plan is not None:
            program = parse_program(plan.program_text)
            max_seq = plan.manifest["max_seq"]
            if plan.random_weights is not None:  # the same words the GPU's fill kernel writes
                from kestrel.kernels.fill import fill_random_ref

                words = fill_random_ref(program.arena["weights"] // 4, plan.random_weights["seed"]).view(np.uint8)
                weights = {name: weight_tensor(words[w.loc[1]:w.loc[1] + w.type.nbytes], w)
                           for name, w in program.weights.items()}
            else:
                weights = {name: weight_tensor(plan.read(name), w) for name, w in program.weights.items()}
        self.program = prog = program
        self.max_seq = max_seq
        self.weights = weights
        self.host_step_end = not any(op.kind == "step_end" for op in prog.ops)
        if TOKENS_STATE not in prog.states or "n_prompt" not in prog.dyn:
            raise IRError(f"the program declares no token sequence (state {TOKENS_STATE}, dyn n_prompt) to run from")
        self.states = {name: torch.zeros(s.type.shape, dtype=TORCH_DTYPES[s.type.dtype])
                       for name, s in prog.states.items()}
        self.dyn: dict[str, int | float] = {name: 0 for name in prog.dyn}
        self.outputs: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        for s in self.states.values():
            s.zero_()
        for k in self.dyn:
            self.dyn[k] = 0

    def begin(self, prompt: list[int], temperature: float, top_p: float, seed: int) -> None:
        """Start a request: zeroed states, the prompt ids in the token sequence, dyn slots set."""
        self.reset()
        self.states[TOKENS_STATE][:len(prompt)] = torch.tensor(prompt, dtype=torch.int32)
        self.dyn.update(pos=0, token=prompt[0], n_prompt=len(prompt), temperature=temperature, top_p=top_p, seed=seed)

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

    def _step(self) -> None:
        env: dict[int, torch.Tensor] = {}

        def get(x):
            if isinstance(x, Value):
                return env[id(x)]
            if isinstance(x, Weight):
                return self.weights[x.name]
            if isinstance(x, State):
                return self.states[x.name]
            if isinstance(x, Dyn):
                return self.dyn[x.name]
            raise TypeError(x)

        for op in self.program.ops:
            args = [get(x) for x in op.ins]
            res = _EXEC[op.kind](self, op, *args)
            if op.kind in ("sample", "step_end"):
                continue
            if isinstance(res, torch.Tensor):
                res = (res,)
            for v, r in zip(op.outs, res or ()):
                env[id(v)] = r
        self.outputs = {name: env[id(v)] for name, v in self.program.outputs.items()}
        if self.host_step_end:
            d = self.dyn
            d["pos"], d["token"] = step_end_ref(d["pos"], d["sampled"], d["n_prompt"], self.states[TOKENS_STATE])

    def output(self, name: str) -> np.ndarray:
        return self.outputs[name].detach().float().numpy()


class _Ready:
    """The CPU path's answer to read_tokens: already there."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def wait(self) -> list[int]:
        return self.tokens


def _sample(step, op, logits, temperature, top_p, seed, pos):
    step.dyn[op.outs[0].name] = sample_ref(logits, float(temperature), float(top_p), int(seed), int(pos))


def _step_end(step, op, pos, sampled, n_prompt, tokens):
    pos_slot, token_slot = op.outs
    step.dyn[pos_slot.name], step.dyn[token_slot.name] = step_end_ref(int(pos), int(sampled), int(n_prompt), tokens)


_EXEC = {
    "embedding": lambda s, op, table, tok: embedding_ref(table, int(tok)),
    "rmsnorm": lambda s, op, x, w: rmsnorm_ref(x, w, op.attrs["eps"]),
    "matmul": lambda s, op, x, w: matvec_ref(x, w),
    "add": lambda s, op, a, b: add_ref(a, b),
    "reshape": lambda s, op, x: x.reshape(op.attrs["shape"]),
    "slice": lambda s, op, x: x.narrow(op.attrs["axis"], op.attrs["start"], op.attrs["stop"] - op.attrs["start"]),
    "conv1d_step": lambda s, op, x, st, w: conv1d_step_ref(x, st, w, op.attrs["act"]),
    "l2norm": lambda s, op, x: l2norm_ref(x, op.attrs["eps"]),
    "gdn_gates": lambda s, op, a, b, a_log, dt: gdn_gates_ref(a, b, a_log, dt),
    "gated_delta_step": lambda s, op, q, k, v, g, beta, st: gated_delta_step_ref(q, k, v, g, beta, st,
                                                                                 op.attrs["scale"]),
    "gated_rmsnorm": lambda s, op, x, z, w: gated_rmsnorm_ref(x, z, w, op.attrs["eps"]),
    "rope": lambda s, op, x, pos: rope_ref(x, int(pos), op.attrs["theta"], op.attrs["rotary_dim"]),
    "kv_append": lambda s, op, kc, vc, k, v, pos: kv_append_ref(kc, vc, k, v, int(pos)),
    "attention": lambda s, op, q, kc, vc, pos: attention_ref(q, kc, vc, int(pos), op.attrs["scale"]),
    "sigmoid_gate": lambda s, op, x, g: sigmoid_gate_ref(x, g),
    "swiglu": lambda s, op, g, u: swiglu_ref(g, u),
    "sample": _sample,
    "step_end": _step_end,
    "add_rmsnorm": lambda s, op, x, y, w: add_rmsnorm_ref(x, y, w, op.attrs["eps"]),
    "matmul_swiglu": lambda s, op, x, wg, wu: matvec_swiglu_ref(x, wg, wu),
    "gdn_step": lambda s, op, *a: gdn_step_ref(*a, **op.attrs),
    "gdn_delta": lambda s, op, *a: gdn_delta_ref(*a, **op.attrs),
    "gdn_norm": lambda s, op, *a: gdn_norm_ref(*a, **op.attrs),
    "attn_step": lambda s, op, qg, k, v, qn, kn, kc, vc, pos, *scratch: attn_step_ref(qg, k, v, qn, kn, kc, vc, int(pos),
                                                                            **op.attrs),
}
