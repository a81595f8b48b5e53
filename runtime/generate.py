"""The token loop shared by every execution path (CPU reference, GPU graph and streaming, TensorRT engine).

A *step* object (runtime/cpu.py CpuStep, runtime/gpu.py GpuStep) exposes
  * ``begin(prompt, temperature, top_p, seed)``: a new request: zeroed states, the prompt ids in the
    ``tokens`` state, the dyn slots set (pos 0, token = prompt[0], n_prompt) — the one host write;
  * ``run(n, marks=None)``: enqueue n M=1 steps; each consumes dyn.token at dyn.pos, leaves
    dyn.sampled, and its step_end feeds the next token in (the next prompt id during prefill, else
    the sampled one, appended to ``tokens``) and advances dyn.pos; ``marks`` collects timing marks;
  * ``read_tokens(lo, hi)``: a handle whose ``wait()`` returns tokens[lo:hi] (asynchronous on the GPU);
  * ``mark_ms(marks)``, ``output(name)`` (``hidden`` / ``logits`` of the last step, float32),
    ``dyn`` (the slots, dict-like), ``reset()``, ``max_seq``, ``mode``, and ``synchronous``: whether
    ``run`` has finished the steps when it returns (the CPU path) or only enqueued them (GPU).
  * ``prefill_rows`` and ``run_prefill(n, marks=None)``: the M-row step, when the plan has one (0 if not).
  * ``spec_k`` (0 if none), ``run_spec_prefill(n, marks=None)``, ``run_spec(n, marks=None)`` and
    ``read_spec(lo, hi)`` (a handle whose ``wait()`` returns (tokens[lo:hi], pos)): speculative decoding,
    when the plan has it (``kestrelc build --speculative mtp``; the CPU path and the GPU runtime run it);
    ``spec_sampling``: its iteration samples at temperature > 0 (plans built before that speculate only
    greedy requests), and ``set_replay(tokens, accept)``: controlled acceptance for the request begun.
Prefill runs the same step once per prompt token, or the M-row step once per chunk of M tokens.

Speculative decoding (``_speculate``; requests on a plan built with ``--speculative mtp``, greedy or sampled): the
speculative prefill leaves the first token and K drafts in ``tokens``; each iteration then verifies,
accepts on the device and drafts again, advancing pos by 1 .. K + 1. Iterations are enqueued in
batches; after each batch an asynchronous read-back brings dyn.pos and the rows of ``tokens`` the batch
may have written, and the host waits for a batch only once the next is enqueued, as for the one-token
step. An iteration at position p writes up to row p + 2K + 1, so iterations run while that fits in
max_seq; the rest (and ``--dump``, chats) is plain decoding, which continues from any iteration's end
exactly (the iteration leaves pos, token and every state where the one-token step would have them). At
temperature > 0 the iteration samples speculatively on the device (kernels/speculative.py): the output
follows the plain sampler's distribution, not its token stream.

Controlled acceptance (``replay``, ``kestrel-run --draft-source replay:FILE``): a ``Replay`` puts a previous
greedy run's tokens in the ``spec.replay`` state (``step.set_replay``, after ``begin``) and sets dyn.replay;
each iteration's drafts are then those tokens, each corrupted with probability 1 - accept, and the
iteration emits the replayed tokens, so acceptance is set while the iteration does all its work.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

from kestrel.artifacts.errors import DeviceError, DraftSourceError, InputError, OutputError

MIN_TEMPERATURE = 1e-5  # below it, logits / T overflow fp32: use 0 (greedy)


@dataclass
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax)
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off

    def check(self):
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf):
            raise InputError(f"--temperature {self.temperature}: must be 0 (greedy) or a finite number >= "
                             f"{MIN_TEMPERATURE}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"--top-p {self.top_p}: must be in (0, 1]")
        if not 0 <= self.seed < 2 ** 31:
            raise InputError(f"--seed {self.seed}: must be in [0, 2^31)")
        if not 0 <= self.top_k < 2 ** 31:
            raise InputError(f"--top-k {self.top_k}: must be 0 (off) or a positive number of tokens")
        if not 0 <= self.min_p <= 1:
            raise InputError(f"--min-p {self.min_p}: must be in [0, 1] (0: off)")


@dataclass
class Replay:
    """Controlled acceptance: ``tokens`` = a previous greedy run's prompt + generated tokens; each draft is
    the replayed token with probability ``accept``, else another one (kernels/speculative.py)."""

    tokens: list[int]
    accept: float

    def check(self):
        if not 0 <= self.accept <= 1:
            raise InputError(f"--draft-accept {self.accept}: must be in [0, 1]")


def expected_accepted(accept: float, k: int) -> float:
    """Mean drafts accepted per iteration under controlled acceptance: each of K drafts is intact with
    probability ``accept`` and an iteration accepts its leading intact drafts: sum_{i=1..K} accept^i."""
    return sum(accept ** i for i in range(1, k + 1))


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    stopped_by: str = "max_tokens"
    draft_tokens: int = 0  # K of a speculative run (0: plain decoding)
    spec_iterations: int = 0  # speculative iterations whose tokens reached the host
    spec_accepted: int = 0  # drafts they accepted, in all

    @property
    def accepted_per_step(self) -> float | None:
        """Mean drafts accepted per speculative iteration (0 .. K), or None without speculation."""
        return self.spec_accepted / self.spec_iterations if self.spec_iterations else None

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


READBACK_EVERY = 8  # k: sampled tokens reach the host every k/2 steps, two batches in flight


def generate(step, prompt: list[int], max_new_tokens: int, sampling: SamplingParams, eos_ids=(),
             max_seq: int | None = None, vocab_size: int | None = None, dump_dir: str | None = None,
             on_step=None, step_ms: list | None = None, readback_every: int = READBACK_EVERY,
             on_tokens=None, resume_from: int = 0, replay: Replay | None = None) -> Generation:
    """Prefill ``prompt`` and generate up to ``max_new_tokens`` tokens (stopping after an EOS id).

    The prompt ids and sampling settings are written once (``step.begin``); from then on the step
    feeds itself. Steps are enqueued in batches of k/2 (k = ``readback_every``); after each batch
    the token sequence rows it produced are copied back asynchronously, and the host waits for a
    batch only once the next one is enqueued, so the device never waits on the host. An EOS is
    therefore seen at most k - 1 steps late; those overrun steps are discarded, and no step is ever
    enqueued beyond prompt + max_new_tokens - 1, which check_lengths keeps within max_seq.

    A step with an M-row step (``prefill_rows`` > 0) prefills in ceil(n / M) runs of it instead of n
    one-token steps, unless ``dump_dir`` asks for every prompt step's outputs.

    ``on_step(step, phase, pos, token_in)`` (and ``dump_dir``, which is one) runs after every step:
    that mode runs one step at a time (after an M-row prefill, once for the last prompt row, whose
    outputs the M-row step leaves). ``on_tokens(tokens)`` receives the generated tokens as they
    reach the host (a read-back batch at a time; streamed output). ``step_ms``, if given, receives
    each decode step's duration (device-side timing marks on the GPU). ``resume_from`` > 0: the step's
    states already hold ``prompt[:resume_from]`` (a chat's earlier turns, consumed with no overrun:
    run one step at a time); only the rest is prefilled. ``replay``: controlled acceptance (a speculative
    plan; the request must be the replayed one's prompt and fit in its tokens: the caller checks).
    """
    sampling.check()
    check_lengths(len(prompt), max_new_tokens, max_seq if max_seq is not None else step.max_seq)
    if vocab_size is not None:
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    hooks = [on_step] if on_step else []
    dumper = _Dumper(dump_dir) if dump_dir else None
    if dumper:
        hooks.append(dumper.add)
    n, gen = len(prompt), Generation(prompt_tokens=list(prompt))
    end = n + max_new_tokens  # tokens[n:end] are the generated tokens; the step at pos p writes tokens[p + 1]
    marks = [] if step_ms is not None else None

    rows = getattr(step, "prefill_rows", 0) if dumper is None else 0  # a dump records every prompt step
    chunks = -(-(n - resume_from) // rows) if rows else 0
    k = getattr(step, "spec_k", 0)
    speculate = (k > 0 and rows > 0 and not hooks and resume_from == 0
                 and (sampling.temperature == 0 or getattr(step, "spec_sampling", False))  # (older plans: greedy)
                 and max_new_tokens > 1 and n + 2 * k + 2 <= step.max_seq)  # room for one iteration at least
    if replay is not None:
        replay.check()
        if not speculate:
            raise DraftSourceError("--draft-source replays drafts into speculative iterations: this request runs none "
                             "(a plan without --speculative mtp, --dump, or no room for an iteration before max_seq)")

    t0 = time.perf_counter()
    step.begin(prompt, sampling.temperature, sampling.top_p, sampling.seed, start=resume_from,
               top_k=sampling.top_k, min_p=sampling.min_p)
    if replay is not None:
        step.set_replay(replay.tokens, replay.accept)
    if hooks:  # one step at a time, the outputs of each read back
        seq = list(prompt)
        start = resume_from
        if rows:  # the M-row step ends as the one-token step at n - 1 would: tokens[n] sampled and fed in
            step.run_prefill(chunks, marks)
            start = n - 1  # the loop below takes up from that sample
        for pos in range(start, end - 1):
            if not (rows and pos == n - 1):  # (the M-row step ran the last prompt row: its outputs are there)
                step.run(1, marks if pos >= n - 1 else None)
            for hook in hooks:
                hook(step, "prefill" if pos < n else "decode", pos, seq[pos])
            if pos >= n - 1:
                seq.append(int(step.dyn["sampled"]))
                if pos == n - 1:
                    gen.prefill_ms = (time.perf_counter() - t0) * 1e3
                    t1 = time.perf_counter()
                if on_tokens:
                    on_tokens(seq[-1:])
                if seq[-1] in eos_ids:
                    gen.stopped_by = "eos"
                    break
        gen.tokens = seq[n:]
    else:
        batch = max(1, readback_every // 2)
        if speculate:
            step.run_spec_prefill(chunks, marks)
        elif rows:
            step.run_prefill(chunks, marks)
        else:
            step.run(n - resume_from, marks)  # prefill: the last prompt step samples tokens[n]
        if marks is not None:
            del marks[:-1]  # time decode steps only, from the end of prefill
        first = True
        if step.synchronous:  # the CPU path ran the prefill inside run(): it ends here, not at the first read
            gen.prefill_ms = (time.perf_counter() - t0) * 1e3
            t1, first = time.perf_counter(), False
        if speculate:
            t_first = _speculate(step, gen, n, end, k, eos_ids, on_tokens, batch, marks)
            if first:
                gen.prefill_ms = (t_first - t0) * 1e3
                t1, first = t_first, False
            inflight, hi = [], n + len(gen.tokens)  # plain steps take up from the last iteration's end
        else:
            inflight, hi = [step.read_tokens(n, n + 1)], n + 1
        while inflight or (gen.stopped_by != "eos" and hi < end):
            if hi < end and len(inflight) < 2:
                m = min(batch, end - hi)
                step.run(m, marks)
                inflight.append(step.read_tokens(hi, hi + m))
                hi += m
                continue
            got = inflight.pop(0).wait()
            if first:
                gen.prefill_ms = (time.perf_counter() - t0) * 1e3
                t1, first = time.perf_counter(), False
            fresh = len(gen.tokens)
            for t in got:
                gen.tokens.append(t)
                if t in eos_ids:
                    gen.stopped_by = "eos"
                    inflight = []  # the steps still in flight are overrun: discarded
                    break
            if on_tokens:
                on_tokens(gen.tokens[fresh:])
    gen.decode_ms = (time.perf_counter() - t1) * 1e3
    if marks is not None:
        step_ms.extend(step.mark_ms(marks))
    if dumper:
        dumper.close(step)
    return gen


def _speculate(step, gen: Generation, n: int, end: int, k: int, eos_ids, on_tokens, batch: int,
               marks: list | None) -> float:
    """Speculative iterations after the speculative prefill, until tokens[n:end] are in (or an EOS, or
    no iteration fits before max_seq any more: the caller finishes with plain steps). Batches of up to
    ``batch`` iterations, each followed by an asynchronous read-back of (tokens, pos); two in flight.
    Iterations a batch need not run (the tokens are in) are not enqueued: each gives at least one token.
    Returns the time the first read-back (the prefill's token) arrived."""
    gen.draft_tokens = k
    limit = step.max_seq - 2 * k - 2  # an iteration at pos p writes rows up to p + 2k + 1
    lo = hi = n  # bounds of pos once everything enqueued has run
    inflight = [(step.read_spec(n, n + 1), 0, n)]  # (read-back, iterations before it, its first token index)
    got, t_first, pos = n, None, n  # tokens[n:got] are in gen.tokens; pos: exact, as of the last read-back
    while inflight:
        if len(inflight) < 2 and lo < end - 1 and hi <= limit:
            b = min(batch, end - 1 - lo, (limit - hi) // (k + 1) + 1)
            step.run_spec(b, marks)
            # tokens the batch may write: after the lowest position it can start from, up to the highest it can
            # reach (every token up to the exact start has been read by the time this read-back is)
            inflight.append((step.read_spec(lo + 1, min(hi + b * (k + 1) + 1, step.max_seq)), b, lo + 1))
            lo, hi = lo + b, hi + b * (k + 1)
            continue
        handle, b, first_index = inflight.pop(0)
        toks, new_pos = handle.wait()
        if new_pos < pos + b:  # every iteration gives at least one token: anything else would loop forever
            raise DeviceError(f"{b} speculative iterations moved the position from {pos} to {new_pos}, not by at "
                              f"least {b}: the plan's speculative program did not run; decode with --temperature "
                              f"> 0 or rebuild the plan without --speculative")
        if t_first is None:
            t_first = time.perf_counter()
        if b:
            gen.spec_iterations += b
            gen.spec_accepted += new_pos - pos - b  # each iteration gives its accepted drafts + 1
        fresh = toks[got - first_index:new_pos + 1 - first_index]  # tokens[got .. new_pos]
        pos, got = new_pos, new_pos + 1
        rest = sum(r[1] for r in inflight)  # the bounds again, from the exact position
        lo, hi = pos + rest, pos + rest * (k + 1)
        kept = len(gen.tokens)
        for t in fresh:
            if len(gen.tokens) == end - n:
                break
            gen.tokens.append(t)
            if t in eos_ids:
                gen.stopped_by = "eos"
                break
        if on_tokens and len(gen.tokens) > kept:
            on_tokens(gen.tokens[kept:])
        if gen.stopped_by == "eos" or len(gen.tokens) == end - n:
            break  # iterations still in flight are overrun: discarded
    return t_first if t_first is not None else time.perf_counter()


class _Dumper:
    """Per-step logits and final hidden states as raw little-endian float32, with index.json. The folder
    is made if missing (its parent must exist: runtime/cli.py checks with output_folder); the step
    files and index of an earlier dump there are removed first, so the folder holds one run."""

    def __init__(self, folder: str):
        try:
            os.makedirs(folder, exist_ok=True)
            for f in os.listdir(folder):
                if f == "index.json" or (f.startswith("step") and f.endswith(".f32")):
                    os.remove(os.path.join(folder, f))
        except OSError as e:
            raise OutputError(f"--dump {folder}: cannot prepare the folder ({e.strerror})") from None
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
