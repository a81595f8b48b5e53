"""On the GPU: interactive ``kestrel-run --chat`` (the step's states kept between turns: GpuStep.begin
with start > 0) against fresh runs of the whole conversation, on the GPU and on the CPU reference
path, and a streamed (non-JSON) run's text against the JSON run's.

    python3 bench/device_chat.py $OUT/chat-h200.json bench/plans/chat-tiny-sm90.plan
"""
from __future__ import annotations

import json
import subprocess
import sys

from kestrel.artifacts.plan import load_plan
from kestrel.runtime.chat import ChatTemplate
from kestrel.runtime.cpu import CpuStep
from kestrel.runtime.generate import SamplingParams, generate
from kestrel.runtime.gpu import GpuStep
from kestrel.runtime.tokenizer import PlanTokenizer

CLI = "import sys; from kestrel.runtime.cli import main; sys.argv[0] = 'kestrel-run'; main()"
TURNS = ["Hello there", "Tell me more", "And once again"]


def main(out: str, plan_path: str) -> None:
    r = subprocess.run([sys.executable, "-c", CLI, plan_path, "--chat", "--max-new-tokens", "12", "--json"],
                       input="\n".join(TURNS) + "\n", capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    turns = [json.loads(line) for line in r.stdout.splitlines()]
    plan = load_plan(plan_path)
    tok, template = PlanTokenizer(plan.tokenizer_json), ChatTemplate.from_manifest(plan.manifest)
    eos = {tok.token_id("<|im_end|>")} - {None}
    messages, rows = [], []
    gpu, cpu = GpuStep(plan), CpuStep(plan)
    for text, t in zip(TURNS, turns):
        messages.append({"role": "user", "content": text})
        ids = tok.encode(template.render(messages))
        fresh_gpu = generate(gpu, ids, 12, SamplingParams(), eos_ids=eos).tokens
        fresh_cpu = generate(cpu, ids, 12, SamplingParams(), eos_ids=eos).tokens
        rows.append({"turn": t["turn"], "reused_tokens": t["reused_tokens"], "prompt_tokens": t["prompt_tokens"],
                     "interactive": t["tokens"], "fresh_gpu": fresh_gpu, "fresh_cpu": fresh_cpu,
                     "equal": t["tokens"] == fresh_gpu == fresh_cpu})
        messages.append({"role": "assistant", "content": t["text"]})
    s = subprocess.run([sys.executable, "-c", CLI, plan_path, "--prompt", "Hello", "--max-new-tokens", "16"],
                       capture_output=True, text=True)
    j = subprocess.run([sys.executable, "-c", CLI, plan_path, "--prompt", "Hello", "--max-new-tokens", "16", "--json"],
                       capture_output=True, text=True)
    streamed = {"rc": s.returncode, "stdout": s.stdout, "json_text": json.loads(j.stdout)["text"],
                "printable": all(c.isprintable() or c == "\n" for c in s.stdout)}
    # the GPU step continued with more prompt tokens (begin with start > 0, as a chat turn that reuses the
    # state does) against a fresh request over the whole sequence: tokens and the last logits, byte for byte
    first, more = tok.encode("Hi there"), tok.encode(" and more")
    g1 = generate(gpu, first, 5, SamplingParams(), on_step=lambda *a: None)
    seq = first + g1.tokens[:-1] + more
    g2 = generate(gpu, seq, 8, SamplingParams(), on_step=lambda *a: None, resume_from=len(first) + len(g1.tokens) - 1)
    resumed_logits = gpu.output("logits").tobytes()
    g3 = generate(gpu, seq, 8, SamplingParams(), on_step=lambda *a: None)
    resume = {"tokens_equal": g2.tokens == g3.tokens, "logits_identical": resumed_logits == gpu.output("logits").tobytes(),
              "resumed_from": len(first) + len(g1.tokens) - 1, "prompt": len(seq)}
    print(f"GPU resume: {resume}")
    report = {"turns": rows, "all_equal": all(r["equal"] for r in rows), "streamed": streamed, "resume": resume}
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    for r in rows:
        print(f"turn {r['turn']}: reused {r['reused_tokens']} of {r['prompt_tokens']} prompt tokens; "
              f"interactive == fresh GPU == fresh CPU: {r['equal']}")
    print(f"streamed run rc {s.returncode}, printable {streamed['printable']}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
