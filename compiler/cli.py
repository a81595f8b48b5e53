"""``kestrelc``: build a .plan from a checkpoint or preset; inspect a plan."""
from __future__ import annotations

import json
import os
from collections import Counter

import click

from kestrel.artifacts.errors import UnsupportedError, exit_on_error, run_command
from kestrel.artifacts.plan import load_plan
from kestrel.compiler import build as driver
from kestrel.compiler.ir_text import parse_program
from kestrel.compiler.presets import PRESETS, SHAPES
from kestrel.passes.pipeline import PASS_NAMES


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kestrel", prog_name="kestrelc", message="%(prog)s %(version)s")
def cli():
    """Kestrel ahead-of-time compiler for hybrid (Gated DeltaNet + attention) LLMs."""


@cli.command(help=f"""Compile MODEL into a .plan. MODEL is a Hugging Face checkpoint folder (config.json +
    *.safetensors) or a preset: {', '.join(PRESETS)} (with weights), or one of the published Qwen3.5 /
    Qwen3-Next shapes {', '.join(SHAPES)} (shapes only: they need --weights random).""")
@click.argument("model")
@click.option("-o", "--output", "out", required=True, help="Path of the .plan file to write.")
@click.option("--target", default="cpu", show_default=True, help="cpu, sm_80, sm_86, sm_89, sm_90, sm_100 or sm_120.")
@click.option("--quant", default=None, help="Weight precision: none (fp32), bf16 or q4. Default: none on cpu, bf16 on GPUs.")
@click.option("--q4-group", type=click.Choice(["32", "64", "128"]), default="128", show_default=True,
              help="Inputs per f16 scale for --quant q4.")
@click.option("--max-seq", type=int, default=None, help="KV-cache rows (prompt + generated tokens), at most the model's positions (max_position_embeddings; with YaRN factor x original_max_position_embeddings). Default: min(4096, that).")
@click.option("--dump-ir-after", metavar="PASS", default=None,
              help=f"Print the IR after PASS ({', '.join(('lower',) + PASS_NAMES)}) or 'all'.")
@click.option("--weights", "weights", type=click.Choice(["checkpoint", "random"]), default="checkpoint",
              show_default=True, help="random: store a seed, not weights; the runtime fills them (benchmarking only).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for --weights random, in [0, 2^31).")
@click.option("--backend", type=click.Choice(["kernels", "tensorrt"]), default="kernels", show_default=True,
              help="tensorrt: write the step as OUT.onnx, then (where TensorRT and the target GPU are present) a "
                   "TensorRT engine inside the .plan.")
@click.option("--prefill-rows", type=int, default=None,
              help="Rows of the M-row step that prefills prompts M tokens a run (0: none, prompts go through the "
                   "one-token step). Default: 256 on GPU targets, 64 on cpu (at most --max-seq).")
@click.option("--prefill-logits", type=click.Choice(["last", "all"]), default="last", show_default=True,
              help="The M-row step's logits: of the chunk's last valid row (what prefill samples from), or of every "
                   "row (for verifying drafted tokens; costs the lm_head over every row).")
@click.option("--speculative", type=click.Choice(["mtp"]), default=None,
              help="Also compile speculative decoding with the model's multi-token-prediction head (mtp): a prefill "
                   "that drafts and one static program per iteration (drafts, verify, acceptance on the device). "
                   "Greedy runs use it; the model must have an MTP head (exit 11 if not).")
@click.option("--draft-tokens", type=int, default=None,
              help="--speculative: drafts an iteration, 1 to 4 (default 3).")
@click.option("--draft-quant", type=click.Choice(["q4"]), default=None,
              help="--speculative: the draft model's precision (the MTP head and a copy of lm_head for its drafts), "
                   "when not --quant's. The output is the same (the verify decides with the model's own weights); "
                   "how many drafts are accepted may change.")
@click.option("--quiet", is_flag=True, help="No progress bar and no log lines (errors are still printed).")
def build(model, out, target, quant, q4_group, max_seq, dump_ir_after, weights, seed, backend, prefill_rows,
          prefill_logits, speculative, draft_tokens, draft_quant, quiet):
    log = (lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True))
    if backend == "tensorrt":
        if speculative is not None:
            exit_on_error(_refuse)("--speculative is for the kernels backend (the TensorRT engine is the one-token "
                                   "step)")
        exit_on_error(driver.build_tensorrt)(model, out, target, quant=quant, q4_group=int(q4_group), max_seq=max_seq,
                                      log=log, dump_ir_after=dump_ir_after, dump=click.echo, weights=weights)
        return
    exit_on_error(driver.build)(model, out, target=target, quant=quant, max_seq=max_seq, log=log, progress=not quiet,
                            q4_group=int(q4_group), dump_ir_after=dump_ir_after, dump=click.echo, weights=weights,
                            seed=seed, prefill_rows=prefill_rows, prefill_logits=prefill_logits,
                            speculative=speculative, draft_tokens=draft_tokens, draft_quant=draft_quant)


def _refuse(message: str):
    raise UnsupportedError(message)


@cli.command("export-onnx")
@click.argument("model")
@click.option("-o", "--output", "out", required=True, help="Path of the .onnx file to write.")
@click.option("--quant", type=click.Choice(["none", "bf16", "q4"]), default="none", show_default=True,
              help="Weight precision: none (fp32), bf16 (bf16 initializers, fp32 math) or q4 (4-bit codes and scales, "
                   "dequantized in the graph; opset 21).")
@click.option("--q4-group", type=click.Choice(["32", "64", "128"]), default="128", show_default=True,
              help="Inputs per f16 scale for --quant q4.")
@click.option("--max-seq", type=int, default=None, help="KV-cache rows, at most the model's positions (with YaRN factor x original_max_position_embeddings). Default: min(4096, that).")
@click.option("--external-data/--inline-data", "external", default=None,
              help="Weights in OUT.data next to the model (default: when they exceed 1 GiB).")
@click.option("--dump-ir-after", metavar="PASS", default=None,
              help=f"Print the IR after PASS ({', '.join(('lower',) + driver.ONNX_PASSES)}) or 'all'.")
@exit_on_error
def export_onnx(model, out, quant, q4_group, max_seq, external, dump_ir_after):
    """Write one decode step of MODEL as an ONNX graph (checked with onnx.checker)."""
    driver.export_onnx(model, out, quant=quant, q4_group=int(q4_group), max_seq=max_seq, external=external,
           log=lambda msg: click.echo(msg, err=True), dump_ir_after=dump_ir_after, dump=click.echo)


def _source(src: dict) -> str:
    """A plan's source for inspect: a preset's name, a checkpoint's folder, and a Hugging Face repository's id and
    snapshot revision when the build found it in the cache."""
    where = src.get("name") or src.get("path")
    if src.get("repo"):
        return f"{src['repo']}@{src.get('revision', '?')} ({src['kind']}: {where})"
    return f"{where} ({src['kind']})"


def _sampling(d: dict) -> str:
    """The recommended sampling, in kestrel-run's order of its options."""
    return ", ".join(f"{k.replace('_', '-')} {d[k]}" for k in ("temperature", "top_p", "top_k", "min_p") if k in d)


def _size(n: int) -> str:
    """Bytes as MB, or kB where MB would round to 0.00."""
    return f"{n / 1e6:.2f} MB" if n >= 5e3 else f"{n / 1e3:.2f} kB"


def plan_summary(plan) -> dict:
    m = plan.manifest
    prog = parse_program(plan.program_text)
    return {
        "path": plan.path, "bytes": os.path.getsize(plan.path), "content_sha256": plan.content_sha256,
        "prefill_rows": plan.prefill_rows, "speculative": plan.speculative,
        "format_version": m["format_version"], "producer": m["producer"], "target": m["target"],
        "quant": m["quant"], "max_seq": m["max_seq"], "source": m["source"], "model": m["model"],
        "tokenizer": "tokenizer.json" if plan.tokenizer_json else None,
        "sampling": plan.manifest.get("tokenizer", {}).get("sampling"),
        "weights": m.get("weights", {"kind": "checkpoint"}),
        "backend": {k: m[k] for k in ("backend", "tensorrt_version", "compute_capability") if k in m} or
                   {"backend": "kernels"},
        "program": {
            "ops": len(prog.ops), "op_counts": dict(Counter(op.kind for op in prog.ops)),
            "dyn_slots": {d.name: d.dtype for d in prog.dyn.values()},
            "weights": len(prog.weights), "weight_bytes": prog.weight_bytes(),
            "states": len(prog.states), "state_bytes": prog.state_bytes(),
        },
        "parts": len(m["parts"]),
        "launch_plan": None if plan.launch_plan is None else {
            "launches": len(plan.launch_plan["launches"]), "arena": plan.launch_plan["arena"],
            "kernels": dict(Counter(l["kernel"] for l in plan.launch_plan["launches"])),
            "compiled": [{"id": k["id"], "entry": k["name"], "arch": k["arch"], "compiler": k["compiler"],
                          "num_warps": k["num_warps"], "shared": k["shared"], "carveout": k.get("carveout", -1),
                          "global_scratch_size": k["global_scratch_size"],
                          "cubin_bytes": m["parts"][k["part"]]["shape"][0], "constexprs": k["constexprs"]}
                         for k in plan.launch_plan.get("kernels", [])]},
    }


@cli.command()
@click.argument("plan_path", metavar="PLAN")
@click.option("--json", "as_json", is_flag=True, help="One JSON object for machines.")
@click.option("--verify", is_flag=True, help="Also check every part's sha256 (reads the whole file).")
@exit_on_error
def inspect(plan_path, as_json, verify):
    """Summarize a .plan: versions, target, model, program, sizes."""
    plan = load_plan(plan_path)
    s = plan_summary(plan)
    if verify:
        s["verified_bytes"] = plan.verify_all()
    plan.close()
    if as_json:
        click.echo(json.dumps(s, indent=2))
        return
    m, p = s["model"], s["program"]
    kinds = Counter(m["layer_types"])
    lines = [
        f"plan      {s['path']}  ({_size(s['bytes'])}, format v{s['format_version']}, {s['producer']})",
        f"content   sha256:{s['content_sha256']}",
        f"target    {s['target']}   quant {s['quant']}   max_seq {s['max_seq']}",
        f"source    {_source(s['source'])}",
        f"model     {m['model_type']}: {m['num_hidden_layers']} layers ({kinds['linear_attention']} gated-deltanet, "
        f"{kinds['full_attention']} attention), hidden {m['hidden_size']}, mlp {m['intermediate_size'] or 'none'}, "
        f"vocab {m['vocab_size']}",
        f"          attention {m['num_attention_heads']}/{m['num_key_value_heads']} heads of {m['head_dim']}; "
        f"gdn {m['linear_num_key_heads']}/{m['linear_num_value_heads']} heads of "
        f"{m['linear_key_head_dim']}/{m['linear_value_head_dim']}; tied embeddings: {m['tie_word_embeddings']}",
        *([f"          mixture of experts in {m['mlp_types'].count('moe')} of {m['num_hidden_layers']} layers: "
           f"{m['num_experts']} experts of {m['moe_intermediate_size']}, top {m['num_experts_per_tok']}"
           f"{' (weights renormalised)' if m.get('norm_topk_prob') else ''}, shared expert "
           f"{m['shared_expert_intermediate_size']}"] if m.get("num_experts") else []),
        *([f"          YaRN RoPE: factor {m['rope_yarn'][0]:g} (positions to {m['rope_max_positions']}), attention "
           f"factor {m['rope_yarn'][3]:.4f}"] if m.get("rope_yarn") else []),
        f"tokenizer {s['tokenizer'] or 'none (use --prompt-ids)'}",
        *([f"sampling  {_sampling(s['sampling'])} (generation_config.json; kestrel-run's default)"]
          if s.get("sampling") else []),
        *([f"backend   TensorRT {s['backend']['tensorrt_version']} engine for compute capability "
           f"{s['backend']['compute_capability']}"] if s["backend"]["backend"] == "tensorrt" else []),
        "weights   " + ("RANDOM (benchmarking plan: seed %d, filled by the runtime)" % s["weights"]["seed"]
                         if s["weights"]["kind"] == "random" else "from the checkpoint"),
        "prefill   " + (f"M-row step of {s['prefill_rows']} rows (prompts prefilled {s['prefill_rows']} tokens a run)"
                         if s["prefill_rows"] else "none (prompts go through the one-token step)"),
        "speculate " + (f"{s['speculative']['method']}: {s['speculative']['draft_tokens']} drafts an iteration "
                        f"(drafts in {s['speculative'].get('draft_quant', '?')}; greedy requests; a speculative "
                        f"prefill and one iteration program)"
                        if s["speculative"] else "no"),
        f"program   {p['ops']} ops, {p['weights']} weights ({_size(p['weight_bytes'])}), "
        f"{p['states']} states ({_size(p['state_bytes'])}), dyn slots {', '.join(p['dyn_slots'])}",
        "ops       " + ", ".join(f"{k} x{v}" for k, v in sorted(p["op_counts"].items())),
    ]
    lp = s["launch_plan"]
    if lp:
        lines.append(f"launches  {lp['launches']} per token; arena " + ", ".join(
            f"{k} {_size(v)}" for k, v in lp["arena"].items()))
        lines.append("kernels   " + ", ".join(f"{k} x{v}" for k, v in sorted(lp["kernels"].items())))
        for k in lp["compiled"]:
            tiles = " ".join(f"{n}={v}" for n, v in k["constexprs"].items())
            carve = f"  carveout {k['carveout']}%" if k["carveout"] >= 0 else ""
            lines.append(f"  cubin   {k['id']:<22} {k['arch']:<7} {k['num_warps']:>2} warps  smem {k['shared']:>6}{carve}  "
                         f"{k['cubin_bytes'] / 1e3:6.1f} kB  {tiles}")
    if verify:
        lines.append(f"verified  {s['verified_bytes']} bytes: every checksum matches")
    click.echo("\n".join(lines))


def main():
    run_command(cli, "kestrelc")


if __name__ == "__main__":
    main()
