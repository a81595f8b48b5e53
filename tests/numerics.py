"""Helpers to run a program at any pipeline stage on the CPU reference path, teacher-forced."""
from __future__ import annotations

import torch

from kestrel.compiler.ir import Program
from kestrel.compiler.weights import weight_bytes
from kestrel.runtime.cpu import CpuStep, weight_tensor


def step_for(program: Program, ckpt, max_seq: int, rows_program: Program | None = None) -> CpuStep:
    """``program`` (and ``rows_program``, its M-row step, sharing its weights) on the CPU reference path."""
    weights = {n: weight_tensor(weight_bytes(w, ckpt.read), w) for n, w in program.weights.items()}
    return CpuStep(program=program, weights=weights, max_seq=max_seq, prefill_program=rows_program)


def forced_logits(step: CpuStep, tokens: list[int]) -> torch.Tensor:
    """Logits after each token of ``tokens``, feeding exactly those tokens (teacher forcing: all of
    them are the prompt, which the step feeds itself from its token sequence)."""
    step.begin(tokens, 0.0, 1.0, 0)
    out = []
    for _ in tokens:
        step.run()
        out.append(torch.from_numpy(step.output("logits").copy()))
    return torch.stack(out)


def forced_logits_rows(step: CpuStep, tokens: list[int]) -> torch.Tensor:
    """``forced_logits`` through the step's M-row program built with every row's logits (``lower(..., rows,
    all_logits=True)``): a chunk of rows a run, each row's logits the one-token step's at that position bit for
    bit on the CPU path (tests/test_prefill_rows.py), in a fraction of the time."""
    step.begin(tokens, 0.0, 1.0, 0)
    out = []
    while len(out) < len(tokens):
        step.run_prefill(1)
        out.extend(step.outputs["logits"].detach().float()[:len(tokens) - len(out)])
    return torch.stack(out)
