"""``kestrel-run``: generate tokens from a .plan."""
from __future__ import annotations

import dataclasses
import json
import re
import sys

import click

from kestrel.artifacts.errors import DraftSourceError, InputError, UnsupportedError, exit_on_error, run_command
from kestrel.artifacts.output import output_file, output_folder, writing
from kestrel.artifacts.plan import load_plan
from kestrel.runtime import bench as gpu_bench
from kestrel.runtime.chat import ChatTemplate
from kestrel.runtime.cuda import NoGpuError
from kestrel.runtime.generate import (MIN_TEMPERATURE, Replay, SamplingParams, check_lengths, expected_accepted,
                                      generate)
from kestrel.runtime.gpu import GpuStep, graph_enabled, graph_m_enabled
from kestrel.runtime.profile import format_report, profile_plan
from kestrel.runtime.tensorrt import TrtStep
from kestrel.runtime.tokenizer import PlanTokenizer


_IDS = re.compile(r"[ ]*[0-9]+[ ]*(,[ ]*[0-9]+[ ]*)*")


def _parse_ids(text: str, option: str = "--prompt-ids") -> list[int]:
    """ASCII digits separated by commas, spaces allowed around the commas: ``1,2,3`` or ``1, 2, 3``."""
    if not _IDS.fullmatch(text):
        raise InputError(f"{option} {text!r}: expected comma-separated integers (ASCII digits, spaces around "
                         f"commas allowed) like 1,2,3")
    return [int(t) for t in text.split(",")]


def _read_prompt_file(path: str) -> str:
    try:
        if path == "-":
            return sys.stdin.buffer.read().decode("utf-8")
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise InputError(f"--prompt-file {path}: not UTF-8 text") from None
    except OSError as e:
        raise InputError(f"--prompt-file {path}: cannot be read ({e.strerror or e})") from None


class _TextStream:
    """Prints generated text as the tokens reach the host: the tokens since the last line break are
    decoded again at each batch and the new part printed (a token may end inside a multi-byte
    character: held back until the character is whole); at a line break the pending tokens are
    dropped, so the work per batch does not grow with the length of the output. Characters that are
    not printable (control bytes of a random-weight model) are printed escaped, like ``\\x07``."""

    def __init__(self, tok: PlanTokenizer):
        self.tok, self.ids, self.shown = tok, [], ""

    def __call__(self, new: list[int]) -> None:
        self.ids += new
        text = self.tok.decode(self.ids)
        if text is None:  # no tokenizer: the ids
            click.echo(" ".join(map(str, new)) + " ", nl=False)
            return
        if text.endswith("\ufffd"):
            return
        self._show(text)
        if text.endswith("\n"):  # a safe place to start over
            self.ids, self.shown = [], ""

    def _show(self, text: str) -> None:
        delta = text[len(self.shown):] if text.startswith(self.shown) else text
        click.echo(printable(delta), nl=False)
        self.shown = text

    def close(self) -> None:
        text = self.tok.decode(self.ids)
        if text is not None:
            self._show(text)
        click.echo("")


def printable(text: str) -> str:
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text)


# kestrel-run's sampling options, named as generation_config.json's keys the build stored
MODEL_SAMPLING = ("temperature", "top_p", "top_k", "min_p")


def _model_sampling(sampling: SamplingParams, plan, as_json: bool) -> SamplingParams:
    """The model's recommended sampling (its generation_config.json, stored by the build) for every sampling option
    not given on the command line, as vLLM does for a request that sets none; ``--temperature 0`` stays greedy."""
    recommended = plan.manifest.get("tokenizer", {}).get("sampling") or {}
    ctx = click.get_current_context(silent=True)
    taken = {k: recommended[k] for k in MODEL_SAMPLING if k in recommended and ctx is not None
             and ctx.get_parameter_source(k) is click.core.ParameterSource.DEFAULT}
    if not taken:
        return sampling
    merged = dataclasses.replace(sampling, **taken)
    merged.check()
    if merged.temperature > 0 and not as_json:
        said = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in taken.items())
        click.echo(f"note: sampling as the model's generation_config.json recommends ({said}); --temperature 0 for "
                   f"greedy", err=True)
    return merged


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kestrel", prog_name="kestrel-run", message="%(prog)s %(version)s")
@click.argument("plan_path", metavar="PLAN")
@click.option("--prompt", help="Prompt text (needs a plan with a tokenizer).")
@click.option("--prompt-ids", help="Prompt as token ids: digits separated by commas, like 1,2,3.")
@click.option("--prompt-file", metavar="PATH", help="Prompt text from a UTF-8 file (- for standard input).")
@click.option("--max-new-tokens", type=int, default=32, show_default=True,
              help="Generate at most this many tokens (fewer if an end-of-sequence token comes first).")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help=f"0 = greedy (argmax); otherwise softmax at this temperature (>= {MIN_TEMPERATURE}).")
@click.option("--top-p", type=float, default=1.0, show_default=True,
              help="Sample from the smallest set of tokens holding this much probability (0 < p <= 1).")
@click.option("--top-k", type=int, default=0, show_default=True,
              help="Sample from the k most likely tokens only (0: off); applied before --top-p.")
@click.option("--min-p", type=float, default=0.0, show_default=True,
              help="Drop tokens less likely than this fraction of the most likely one (0: off), after --top-p.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Random seed for sampling, in [0, 2^31): the same seed repeats a run exactly.")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="gpu runs the plan's cubins (auto: gpu for GPU plans); cpu runs the torch reference path (any plan).")
@click.option("--no-graph", is_flag=True, help="GPU: launch kernel by kernel instead of replaying the CUDA graphs "
              "(same as KESTREL_GRAPH=0 KESTREL_GRAPH_M=0).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end instead of streamed text.")
@click.option("--dump", "dump_dir", metavar="DIR",
              help="Write per-step logits and hidden states (float32) with index.json into DIR (made if missing; "
                   "an earlier dump there is replaced).")
@click.option("--bench", "bench_out", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
              help="GPU: interleaved graph off/on rounds; prints a table and the JSON (to FILE if given).")
@click.option("--rounds", type=int, default=3, show_default=True, help="--bench rounds (at least 3).")
@click.option("--prompt-lengths", metavar="N,N,...",
              help="--bench: also time the first token (prefill) at these prompt lengths (the prompt's ids "
                   "repeated): the M-row step with its graph on and off, and the one-token prefill.")
@click.option("--profile", "profile_out", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
              help="Time every launch of --max-new-tokens decode steps (GPU: kernel by kernel between events, "
                   "and the graph replay alone; cpu: each reference op): tables per kernel and per layer kind, "
                   "the JSON to FILE if given (with --json: the JSON on standard output).")
@click.option("--positions", metavar="N,N,...",
              help="--bench: also time decoding from these positions (the KV rows up to each are read; they are "
                   "not prefilled: timing only); --profile: profile from the first of them.")
@click.option("--verify", is_flag=True, help="GPU: run graph and streaming, byte-compare every step's dumps.")
@click.option("--chat", is_flag=True,
              help="Apply the checkpoint's chat template to --prompt as a user turn; without --prompt, chat "
                   "interactively: one user turn per line of standard input, the model's state kept between turns.")
@click.option("--system", help="--chat: a system message first.")
@click.option("--draft-source", metavar="mtp|replay:FILE", default="mtp", show_default=True,
              help="Speculative plans: where the drafts come from. replay:FILE (controlled acceptance, for "
                   "measuring): the tokens of FILE, a previous greedy --json run of this plan and prompt, each "
                   "corrupted with probability 1 - --draft-accept, so acceptance is set exactly.")
@click.option("--draft-accept", metavar="A[,A,...]",
              help="With --draft-source replay: the probability each replayed draft is left intact (default 1); "
                   "--bench takes a list (default 0,0.5,0.8,1) and reports ms/token at each.")
@exit_on_error
def command(plan_path, prompt, prompt_ids, prompt_file, max_new_tokens, temperature, top_p, top_k, min_p, seed, device,
            no_graph, as_json, dump_dir, bench_out, rounds, prompt_lengths, profile_out, positions, verify, chat,
            system, draft_source, draft_accept):
    """Run PLAN: prefill the prompt, then generate up to --max-new-tokens tokens."""
    if prompt_file is not None:
        if prompt is not None:
            raise InputError("give one of --prompt and --prompt-file")
        prompt = _read_prompt_file(prompt_file)
    interactive = chat and prompt is None and prompt_ids is None
    if chat and prompt_ids is not None:
        raise InputError("--chat renders text turns: give --prompt TEXT (or nothing, to chat interactively), "
                         "not --prompt-ids")
    if system is not None and not chat:
        raise InputError("--system needs --chat")
    if interactive and (bench_out is not None or verify or dump_dir is not None or profile_out is not None):
        raise InputError("interactive --chat does not combine with --bench, --profile, --verify or --dump: give "
                         "--prompt")
    if sum([bench_out is not None, profile_out is not None, verify]) > 1:
        raise InputError("give one of --bench, --profile and --verify")
    if not interactive and (prompt is None) == (prompt_ids is None):
        raise InputError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    sampling = SamplingParams(temperature, top_p, seed, top_k, min_p)
    sampling.check()
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    if dump_dir is not None:
        output_folder(dump_dir)
    if bench_out not in (None, "-"):
        bench_out = output_file(bench_out, "--bench")
    if profile_out not in (None, "-"):
        profile_out = output_file(profile_out, "--profile")
    lengths = None
    if prompt_lengths is not None:
        if bench_out is None:
            raise InputError("--prompt-lengths goes with --bench")
        lengths = _parse_ids(prompt_lengths, "--prompt-lengths")
        if not lengths or min(lengths) < 1:
            raise InputError(f"--prompt-lengths {prompt_lengths}: give positive lengths, e.g. 512,2048")
    seek = None
    if positions is not None:
        if bench_out is None and profile_out is None:
            raise InputError("--positions goes with --bench or --profile")
        seek = _parse_ids(positions, "--positions")
        if not seek or min(seek) < 1:
            raise InputError(f"--positions {positions}: give positive positions, e.g. 4096,32768")
    replay_path, accepts = _draft_source(draft_source, draft_accept, bench_out is not None)
    if replay_path is not None and (chat or verify or profile_out is not None or dump_dir is not None):
        raise InputError("--draft-source replay goes with a plain request or --bench, not --chat, --verify, "
                         "--profile or --dump")
    plan = load_plan(plan_path)
    if replay_path is None:  # (controlled acceptance measures what it is told)
        sampling = _model_sampling(sampling, plan, as_json)
    tok = PlanTokenizer(plan.tokenizer_json)
    template = ChatTemplate.from_manifest(plan.manifest) if chat else None
    messages = [{"role": "system", "content": system}] if system is not None else []
    if template is not None and not interactive:
        ids = tok.encode(template.render(messages + [{"role": "user", "content": prompt}]))
    elif ids is None and not interactive:
        ids = tok.encode(prompt)
    model = plan.manifest["model"]
    if interactive:
        ids = [0]  # the turns come later; what follows only needs a valid one-token request
    check_lengths(len(ids), max_new_tokens, plan.manifest["max_seq"])  # before loading weights
    bad = [t for t in ids if not 0 <= t < model["vocab_size"]]
    if bad:  # checked here too, so no path (--bench, --verify) lets a kernel read outside the table
        raise InputError(f"prompt token id {bad[0]} is outside the vocabulary [0, {model['vocab_size']})")
    replay_seq = None
    if replay_path is not None:
        replay_seq = _read_replay(replay_path, ids, plan)
        if bench_out is None and max_new_tokens > len(replay_seq) - len(ids):
            raise DraftSourceError(f"--draft-source {draft_source}: it holds {len(replay_seq) - len(ids)} generated "
                                   f"tokens and --max-new-tokens asks for {max_new_tokens}: lower --max-new-tokens "
                                   f"or replay a longer run")
    auto = device == "auto"
    if plan.backend == "tensorrt":  # the engine holds the weights: no CPU path, no launch list to bench
        if device == "cpu" or bench_out is not None or verify or profile_out is not None:
            raise UnsupportedError("this plan holds a TensorRT engine: run it on its GPU (without --device cpu, "
                                   "--bench, --profile or --verify), or rebuild with --backend kernels")
        device = "tensorrt"
    if device == "auto":
        device = "cpu" if plan.manifest["target"] == "cpu" else "gpu"
    if bench_out is not None or verify:
        if device != "gpu":
            raise InputError("--bench and --verify run on the GPU: use a plan built with --target sm_XX")
        if lengths:
            if not plan.prefill_rows:
                raise UnsupportedError("--prompt-lengths times the M-row step: this plan has none; rebuild it with "
                                       "--prefill-rows N")
            check_lengths(max(lengths), 1, plan.manifest["max_seq"])
        if seek:
            check_lengths(max(seek) + 1, max_new_tokens + 1, plan.manifest["max_seq"])
        if replay_seq is not None:
            _bench_controlled(plan, ids, replay_seq, replay_path, accepts, as_json, bench_out, rounds)
            return
        _bench_or_verify(plan, ids, max_new_tokens, as_json, bench_out, rounds, verify, lengths, seek)
        return
    if profile_out is not None:
        if seek:
            if device != "gpu":
                raise InputError("--profile --positions runs on the GPU")
            check_lengths(seek[0] + 1, 2 * max_new_tokens + 2, plan.manifest["max_seq"])
        _profile(plan, ids, max_new_tokens, device, auto, as_json, profile_out, seek[0] if seek else None)
        return
    try:
        if device == "tensorrt":
            step = TrtStep(plan, use_graph=graph_enabled(no_graph), log=lambda m: click.echo(m, err=True))
        elif device == "gpu":
            step = GpuStep(plan, use_graph=graph_enabled(no_graph), log=lambda m: click.echo(m, err=True),
                           use_graph_m=graph_m_enabled() and not no_graph)
        else:
            from kestrel.runtime.cpu import CpuStep  # the CPU reference path needs torch; nothing else here does

            step = CpuStep(plan)
    except NoGpuError as e:
        if not auto:
            raise
        raise NoGpuError(f"this plan needs an {plan.manifest['target']} GPU and none is usable here "
                         f"({e.message.split(';')[0]}): run it with --device cpu") from None
    plan.close()
    eos = set(plan.manifest.get("tokenizer", {}).get("eos_token_ids") or model.get("eos_token_ids") or [])
    if template is not None:  # the template's end-of-turn token ends a reply too
        eos |= {t for t in [tok.token_id(template.special_tokens.get("eos_token"))] if t is not None}
    if interactive:
        _chat_loop(step, tok, template, messages, sampling, eos, max_new_tokens, model["vocab_size"], as_json)
        return
    stream = None if as_json else _TextStream(tok)
    replay = Replay(replay_seq, accepts[0]) if replay_seq is not None else None
    gen = generate(step, ids, max_new_tokens, sampling, eos_ids=set(eos), max_seq=step.max_seq,
                   vocab_size=model["vocab_size"], dump_dir=dump_dir, on_tokens=stream, replay=replay)
    if as_json:
        click.echo(json.dumps({
            "tokens": gen.tokens, "text": tok.decode(gen.tokens), "mode": step.mode,
            "ms_per_token": round(gen.ms_per_token, 4), "prompt_tokens": len(ids),
            "prefill_ms": round(gen.prefill_ms, 3), "ttft_ms": round(gen.prefill_ms, 3),
            "prefill_tokens_per_s": round(len(ids) / max(gen.prefill_ms, 1e-9) * 1e3, 1),
            "prefill_rows": getattr(step, "prefill_rows", 0), "m_row_graph": getattr(step, "use_graph_m", False),
            "stopped_by": gen.stopped_by,
            "graph_fallbacks": getattr(step, "graph_fallbacks", 0),
            "weights": "random" if plan.random_weights else "checkpoint",
            "draft_tokens": gen.draft_tokens,
            "accepted_per_step": None if gen.accepted_per_step is None else round(gen.accepted_per_step, 4),
            "speculative_iterations": gen.spec_iterations,
            "prompt_ids": ids, "temperature": sampling.temperature,
            "controlled_acceptance": None if replay is None else {
                "label": CONTROLLED_LABEL, "draft_source": draft_source, "draft_accept": replay.accept,
                "expected_accepted_per_step": round(expected_accepted(replay.accept, gen.draft_tokens), 4),
                "tokens_equal_replay": gen.tokens == replay_seq[len(ids):len(ids) + len(gen.tokens)]},
        }))
    else:
        stream.close()
        spec = (f"; speculative: {gen.accepted_per_step:.2f} of {gen.draft_tokens} drafts accepted per iteration "
                f"({gen.spec_iterations} iterations)" if gen.spec_iterations else "")
        if replay is not None:
            spec += f" [controlled acceptance: replayed drafts intact with probability {replay.accept}]"
        click.echo(f"[{step.mode}] {len(ids)} prompt tokens, {len(gen.tokens)} generated "
                   f"({gen.stopped_by}), {gen.ms_per_token:.2f} ms/token{spec}", err=True)


CONTROLLED_LABEL = ("controlled-acceptance figures: the drafts are a previous greedy run's tokens replayed, each "
                    "corrupted with probability 1 - draft_accept; not the MTP head's own acceptance")


def _draft_source(source: str, accept: str | None, bench: bool) -> tuple[str | None, list[float]]:
    """(the replay file or None, the --draft-accept values)."""
    if source == "mtp":
        if accept is not None:
            raise InputError("--draft-accept goes with --draft-source replay:FILE")
        return None, []
    if not source.startswith("replay:") or not source[len("replay:"):]:
        raise InputError(f"--draft-source {source!r}: give mtp (the model's head) or replay:FILE")
    default = "0,0.5,0.8,1" if bench else "1"
    try:
        accepts = [float(a) for a in (accept if accept is not None else default).split(",")]
    except ValueError:
        raise InputError(f"--draft-accept {accept!r}: expected numbers in [0, 1] separated by commas") from None
    if not accepts or any(not 0 <= a <= 1 for a in accepts):
        raise InputError(f"--draft-accept {accept!r}: every value must be in [0, 1]")
    if len(accepts) > 1 and not bench:
        raise InputError("--draft-accept takes one value for a request (a list goes with --bench)")
    return source[len("replay:"):], accepts


def _read_replay(path: str, ids: list[int], plan) -> list[int]:
    """The replayed sequence (prompt + generated tokens) from a ``kestrel-run --json`` output, checked
    against this request and plan."""
    if plan.spec_programs is None:
        raise DraftSourceError("--draft-source replays drafts into speculative iterations: this plan has none; "
                               "rebuild it with --speculative mtp")
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except OSError as e:
        raise DraftSourceError(f"--draft-source replay:{path}: cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DraftSourceError(f"--draft-source replay:{path}: not the JSON of kestrel-run --json") from None
    if not isinstance(run, dict) or not isinstance(run.get("tokens"), list) or "prompt_ids" not in run:
        raise DraftSourceError(f"--draft-source replay:{path}: no tokens and prompt_ids: give the output of "
                               f"kestrel-run PLAN --prompt ... --json (greedy) of this Kestrel")
    vocab = plan.manifest["model"]["vocab_size"]
    seq = run["prompt_ids"] + run["tokens"]
    if not all(isinstance(t, int) and 0 <= t < vocab for t in seq):
        raise DraftSourceError(f"--draft-source replay:{path}: token ids outside this plan's vocabulary [0, {vocab})")
    if run["prompt_ids"] != ids:
        raise DraftSourceError(f"--draft-source replay:{path}: made for another prompt (its prompt ids differ from "
                               f"this request's): replay a --json run of this prompt")
    if run.get("temperature", 0) != 0:
        raise DraftSourceError(f"--draft-source replay:{path}: a sampled run (temperature {run['temperature']}): "
                               f"replay a greedy run's --json")
    if len(run["tokens"]) < 2:
        raise DraftSourceError(f"--draft-source replay:{path}: {len(run['tokens'])} generated tokens: replay a run "
                               f"of at least 2")
    return seq


def _bench_controlled(plan, ids, seq, path, accepts, as_json, bench_out, rounds) -> None:
    r = gpu_bench.bench_controlled(plan, ids, seq, accepts, max(3, rounds), log=lambda m: click.echo(m, err=True),
                                   source=f"replay:{path}")
    text = json.dumps(r, indent=1)
    if bench_out != "-":
        with writing(bench_out, "--bench"), open(bench_out, "w") as f:
            f.write(text)
    click.echo(text if as_json else gpu_bench.format_controlled(r))


def _chat_loop(step, tok, template, messages, sampling, eos, max_new_tokens, vocab_size, as_json) -> None:
    """One user turn per line of standard input. The step keeps its states between turns: a turn feeds
    only the tokens the conversation gained since the last one (when the rendered conversation still
    starts with what was fed; else it starts over), and replies are generated one step at a time so
    no step runs past the end of a reply (a recurrent state cannot be rolled back)."""
    fed: list[int] = []  # the tokens whose states the step holds
    for turn, line in enumerate(sys.stdin):
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tok.encode(template.render(messages))
        resume = len(fed) if fed and len(ids) > len(fed) and ids[:len(fed)] == fed else 0
        stream = None if as_json else _TextStream(tok)
        gen = generate(step, ids, max_new_tokens, sampling, eos_ids=eos, max_seq=step.max_seq, vocab_size=vocab_size,
                       on_step=lambda *a: None, on_tokens=stream, resume_from=resume)
        reply = gen.tokens[:-1] if gen.stopped_by == "eos" else gen.tokens
        messages.append({"role": "assistant", "content": tok.decode(reply)})
        fed = (ids + gen.tokens)[:-1]  # the last token sampled was never fed back
        if as_json:
            click.echo(json.dumps({"turn": turn, "tokens": gen.tokens, "text": tok.decode(reply),
                                   "prompt_tokens": len(ids), "reused_tokens": resume, "stopped_by": gen.stopped_by,
                                   "ms_per_token": round(gen.ms_per_token, 4)}))
        else:
            stream.close()


def _profile(plan, ids, steps, device, auto, as_json, out, position=None) -> None:
    # the steps run kernel by kernel, then as many graph replays, each after one more
    check_lengths(len(ids), 2 * steps + 2, plan.manifest["max_seq"])
    try:
        r = profile_plan(plan, ids, steps, device, log=lambda m: click.echo(m, err=True), position=position)
    except NoGpuError as e:
        if not auto:
            raise
        raise NoGpuError(f"this plan needs an {plan.manifest['target']} GPU and none is usable here "
                         f"({e.message.split(';')[0]}): profile it with --device cpu") from None
    text = json.dumps(r, indent=1)
    if out != "-":
        with writing(out, "--profile"), open(out, "w") as f:
            f.write(text)
    click.echo(text if as_json else format_report(r))


def _bench_or_verify(plan, ids, max_new_tokens, as_json, bench_out, rounds, verify, lengths=None,
                     positions=None) -> None:
    if verify:
        r = gpu_bench.verify(plan, ids, max_new_tokens)
        m_row = (f"; the M-row prefill and the steps after it: {r['m_row_outputs_compared']} outputs"
                 if "m_row_outputs_compared" in r else "")
        click.echo(json.dumps(r) if as_json else f"verified: graph and streaming byte-identical over "
                   f"{r['steps']} steps ({r['files_compared']} files){m_row}")
        return
    r = gpu_bench.bench(plan, ids, max_new_tokens, max(3, rounds), log=lambda m: click.echo(m, err=True),
                        prompt_lengths=lengths, positions=positions)
    text = json.dumps(r, indent=1)
    if bench_out != "-":
        with writing(bench_out, "--bench"), open(bench_out, "w") as f:
            f.write(text)
    click.echo(text if as_json else
               f"ms/token  graph {r['ms_per_token']['graph']:.3f}  streaming {r['ms_per_token']['stream']:.3f}"
               f"  sampled {r['ms_per_token']['graph_sampled']:.3f} ({r['sampled']})"
               f"  (x{r['graph_speedup']:.2f}; saving {r['paired_saving_ms']:.3f} ms, paired range "
               f"{r['paired_range_ms']:.3f}: {'claimed' if r['gain_claimed'] else 'not claimed'})\n"
               f"p50/p99 graph {r['latency_ms']['graph']['p50']:.3f}/{r['latency_ms']['graph']['p99']:.3f} ms; "
               f"first request graph {r['first_request_ms']['graph']:.1f} ms vs streaming "
               f"{r['first_request_ms']['stream']:.1f} ms (graph built at load in {r['graph_build_ms_at_load']:.0f} ms)\n"
               f"bytes/token {r['bytes_per_token'] / 1e6:.1f} MB; bandwidth {r['bandwidth_GBps']:.0f} GB/s (copy "
               f"{r['copy_bandwidth_GBps']:.0f}, read-only {r['read_bandwidth_GBps'] or float('nan'):.0f}); "
               f"roofline {r['roofline_ms']:.3f} ms; graph at {r['fraction_of_roofline']:.1%} of it")


def main():
    run_command(command, "kestrel-run")


if __name__ == "__main__":
    main()
