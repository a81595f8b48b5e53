"""The token loop shared by every execution path (CPU reference now, GPU graph/streaming later).

A *step* object exposes ``dyn`` (the dyn slots), ``reset()``, ``run()`` (one M=1 step: consumes
dyn.token at dyn.pos, leaves dyn.sampled, advances dyn.pos and feeds sampled back into dyn.token)
and ``output(name)`` (``hidden`` / ``logits`` of the last step as float32 numpy arrays).
Prefill runs the same step once per prompt token, the host writing dyn.token each time.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from kestrel.artifacts.errors import InputError


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0
    seed: int = 0

    def check(self):
        if self.temperature < 0:
            raise InputError(f"--temperature {self.temperature}: must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise InputError(f"--top-p {self.top_p}: must be in (0, 1]")
        if not 0 <= self.seed < 2 ** 31:
            raise InputError(f"--seed {self.seed}: must be in [0, 2^31)")


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    stopped_by: str = "max_tokens"

    @property
    def ms_per_token(self) -> float:
        """Decode time per generated token after the first (which prefill produces)."""
        n = len(self.tokens) - 1
        if n > 0:
            return self.decode_ms / n
        return self.prefill_ms / max(1, len(self.prompt_tokens))


def check_lengths(n_prompt: int, max_new: int, max_seq: int) -> None:
    if n_prompt == 0:
        raise InputError("the prompt is empty: give --prompt TEXT or --prompt-ids 1,2,3")
    if max_new < 1:
        raise InputError(f"--max-new-tokens {max_new}: must be at least 1")
    if n_prompt + max_new > max_seq:
        raise InputError(f"prompt ({n_prompt} tokens) + --max-new-tokens {max_new} = {n_prompt + max_new} exceeds "
                         f"the plan's max_seq {max_seq}: shorten the prompt, lower --max-new-tokens, or rebuild "
                         f"with a larger --max-seq")


def generate(step, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, eos_ids=(),
             max_seq: int | None = None, vocab_size: int | None = None, dump_dir: str | None = None,
             token_times: list | None = None) -> Generation:
    """``token_times``, if given, receives time.perf_counter() as each generated token reaches the host."""
    sampling.check()
    check_lengths(len(prompt), max_new_tokens, max_seq if max_seq is not None else step.max_seq)
    if vocab_size is not None:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    dumper = _Dumper(dump_dir) if dump_dir else None
    step.reset()
    step.dyn["temperature"], step.dyn["top_p"], step.dyn["seed"] = sampling.temperature, sampling.top_p, sampling.seed
    gen = Generation(prompt_tokens=list(prompt))

    t0 = time.perf_counter()
    for tok in prompt:
        step.dyn["token"] = tok
        pos = step.dyn["pos"]
        step.run()
        if dumper:
            dumper.add(step, "prefill", pos, tok)
    gen.tokens.append(int(step.dyn["sampled"]))
    t1 = time.perf_counter()
    if token_times is not None:
        token_times.append(t1)
    gen.prefill_ms = (t1 - t0) * 1e3
    while len(gen.tokens) < max_new_tokens:
        if gen.tokens[-1] in eos_ids:
            gen.stopped_by = "eos"
            break
        pos, tok = step.dyn["pos"], step.dyn["token"]  # step_end fed the sampled token back
        step.run()
        if dumper:
            dumper.add(step, "decode", pos, tok)
        gen.tokens.append(int(step.dyn["sampled"]))
        if token_times is not None:
            token_times.append(time.perf_counter())
    else:
        if gen.tokens[-1] in eos_ids:
            gen.stopped_by = "eos"
    gen.decode_ms = (time.perf_counter() - t1) * 1e3
    if dumper:
        dumper.close(step)
    return gen


class _Dumper:
    """Per-step logits and final hidden states as raw little-endian float32, with index.json."""

    def __init__(self, folder: str):
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise InputError(f"--dump {folder}: cannot create the folder ({e.strerror})") from None
        self.folder, self.steps, self.shapes = folder, [], {}

    def add(self, step, phase: str, pos: int, token_in: int):
        i = len(self.steps)
        entry = {"step": i, "phase": phase, "pos": int(pos), "token_in": int(token_in),
                 "sampled": int(step.dyn["sampled"])}
        for name in ("logits", "hidden"):
            arr = step.output(name).astype("<f4", copy=False)
            self.shapes[name] = list(arr.shape)
            fname = f"step{i:05d}.{name}.f32"
            arr.tofile(os.path.join(self.folder, fname))
            entry[name] = fname
        self.steps.append(entry)

    def close(self, step):
        index = {"dtype": "float32", "byte_order": "little", "shapes": self.shapes,
                 "mode": getattr(step, "mode", "unknown"), "steps": self.steps}
        with open(os.path.join(self.folder, "index.json"), "w") as f:
            json.dump(index, f, indent=1)
