"""``kestrel-run``: generate tokens from a .plan."""
from __future__ import annotations

import json
import sys

import click

from kestrel.artifacts.errors import InputError, UnsupportedError, exit_on_error
from kestrel.artifacts.plan import load_plan
from kestrel.runtime import bench as gpu_bench
from kestrel.runtime.generate import SamplingParams, check_lengths, generate
from kestrel.runtime.gpu import GpuStep, graph_enabled
from kestrel.runtime.tensorrt import TrtStep
from kestrel.runtime.tokenizer import PlanTokenizer


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise InputError(f"--prompt-ids {text!r}: expected comma-separated integers like 1,2,3") from None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("plan_path", metavar="PLAN")
@click.option("--prompt", help="Prompt text (needs a plan with a tokenizer).")
@click.option("--prompt-ids", help="Prompt as comma-separated token ids.")
@click.option("--max-new-tokens", type=int, default=32, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="gpu runs the plan's cubins (auto: gpu for GPU plans); cpu runs the torch reference path (any plan).")
@click.option("--no-graph", is_flag=True, help="GPU: launch kernel by kernel instead of replaying the CUDA graph "
              "(same as KESTREL_GRAPH=0).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--dump", "dump_dir", help="Write per-step logits and hidden states (float32) with index.json here.")
@click.option("--bench", "bench_out", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
              help="GPU: interleaved graph off/on rounds; prints a table and the JSON (to FILE if given).")
@click.option("--rounds", type=int, default=3, show_default=True, help="--bench rounds (at least 3).")
@click.option("--verify", is_flag=True, help="GPU: run graph and streaming, byte-compare every step's dumps.")
@exit_on_error
def main(plan_path, prompt, prompt_ids, max_new_tokens, temperature, top_p, seed, device, no_graph, as_json,
         dump_dir, bench_out, rounds, verify):
    """Run PLAN: prefill the prompt, then generate up to --max-new-tokens tokens."""
    if (prompt is None) == (prompt_ids is None):
        raise InputError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    plan = load_plan(plan_path)
    tok = PlanTokenizer(plan.tokenizer_json)
    ids = tok.encode(prompt) if prompt is not None else _parse_ids(prompt_ids)
    model = plan.manifest["model"]
    check_lengths(len(ids), max_new_tokens, plan.manifest["max_seq"])  # before loading weights
    bad = [t for t in ids if not 0 <= t < model["vocab_size"]]
    if bad:  # checked here too, so no path (--bench, --verify) lets a kernel read outside the table
        raise InputError(f"prompt token id {bad[0]} is outside the vocabulary [0, {model['vocab_size']})")
    if plan.backend == "tensorrt":  # the engine holds the weights: no CPU path, no launch list to bench
        if device == "cpu" or bench_out is not None or verify:
            raise UnsupportedError("this plan holds a TensorRT engine: run it on its GPU (without --device cpu, "
                                   "--bench or --verify), or rebuild with --backend kernels")
        device = "tensorrt"
    if device == "auto":
        device = "cpu" if plan.manifest["target"] == "cpu" else "gpu"
    if bench_out is not None or verify:
        if device != "gpu":
            raise InputError("--bench and --verify run on the GPU: use a plan built with --target sm_XX")
        if verify:
            r = gpu_bench.verify(plan, ids, max_new_tokens)
            click.echo(json.dumps(r) if as_json else f"verified: graph and streaming byte-identical over "
                       f"{r['steps']} steps ({r['files_compared']} files)")
            return
        r = gpu_bench.bench(plan, ids, max_new_tokens, max(3, rounds), log=lambda m: click.echo(m, err=True))
        text = json.dumps(r, indent=1)
        if bench_out != "-":
            with open(bench_out, "w") as f:
                f.write(text)
        click.echo(text if as_json else
                   f"ms/token  graph {r['ms_per_token']['graph']:.3f}  streaming {r['ms_per_token']['stream']:.3f}"
                   f"  (x{r['graph_speedup']:.2f}; saving {r['paired_saving_ms']:.3f} ms, paired range "
                   f"{r['paired_range_ms']:.3f}: {'claimed' if r['gain_claimed'] else 'not claimed'})\n"
                   f"p50/p99 graph {r['latency_ms']['graph']['p50']:.3f}/{r['latency_ms']['graph']['p99']:.3f} ms; "
                   f"first request graph {r['first_request_ms']['graph']:.1f} ms vs streaming "
                   f"{r['first_request_ms']['stream']:.1f} ms (graph built at load in {r['graph_build_ms_at_load']:.0f} ms)\n"
                   f"bytes/token {r['bytes_per_token'] / 1e6:.1f} MB; copy bandwidth {r['copy_bandwidth_GBps']:.0f} GB/s; "
                   f"roofline {r['roofline_ms']:.3f} ms; graph at {r['fraction_of_roofline']:.1%} of it")
        return
    if device == "tensorrt":
        step = TrtStep(plan, use_graph=graph_enabled(no_graph), log=lambda m: click.echo(m, err=True))
    elif device == "gpu":
        step = GpuStep(plan, use_graph=graph_enabled(no_graph), log=lambda m: click.echo(m, err=True))
    else:
        from kestrel.runtime.cpu import CpuStep  # the CPU reference path needs torch; nothing else here does

        step = CpuStep(plan)
    plan.close()
    eos = plan.manifest.get("tokenizer", {}).get("eos_token_ids") or model.get("eos_token_ids") or []
    gen = generate(step, ids, max_new_tokens, SamplingParams(temperature, top_p, seed), eos_ids=set(eos),
                   max_seq=step.max_seq, vocab_size=model["vocab_size"], dump_dir=dump_dir)
    text = tok.decode(gen.tokens)
    if as_json:
        click.echo(json.dumps({
            "tokens": gen.tokens, "text": text, "mode": step.mode, "ms_per_token": round(gen.ms_per_token, 4),
            "prompt_tokens": len(ids), "prefill_ms": round(gen.prefill_ms, 3), "stopped_by": gen.stopped_by,
            "graph_fallbacks": getattr(step, "graph_fallbacks", 0),
            "weights": "random" if plan.random_weights else "checkpoint",
        }))
    else:
        click.echo(text if text is not None else " ".join(map(str, gen.tokens)))
        click.echo(f"[{step.mode}] {len(ids)} prompt tokens, {len(gen.tokens)} generated "
                   f"({gen.stopped_by}), {gen.ms_per_token:.2f} ms/token", err=True)


if __name__ == "__main__":
    sys.exit(main())
