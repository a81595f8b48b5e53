"""The build driver: ``kestrelc build``, ``kestrelc export-onnx`` and ``build --backend tensorrt``.

All three resolve their input the same way (``open_model``: a checkpoint folder or a preset, its
max_seq, its tokenizer) and check their options and output location the same way, before anything
is written. Then:
  * ``build``: lower -> the passes (passes/pipeline.py) -> codegen (cubins, GPU targets) -> the
    .plan, written under a temporary name and renamed only when complete;
  * ``export_onnx``: lower -> the passes up to ``quantize`` (``step_program``) -> ONNX
    (compiler/onnx_export.py);
  * ``build_tensorrt``: the ONNX step next to the plan, then a TensorRT engine inside the plan where
    TensorRT and the target GPU are present (compiler/tensorrt_build.py).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field

from tqdm import tqdm

from kestrel.artifacts.errors import (BackendMissingError, ConfigError, DeviceError, DoesNotFitError, InputError,
                                     NoDraftHeadError, UnsupportedError)
from kestrel.artifacts.output import not_an_input, output_file
from kestrel.artifacts.plan import (ENGINE_PART, PREFILL_PROGRAM_PART, SPEC_PREFILL_PROGRAM_PART, SPEC_PROGRAM_PART,
                                    PlanInfo, write_plan)
from kestrel.compiler import codegen, onnx_export, tensorrt_build
from kestrel.compiler.frontend import (Checkpoint, find_checkpoint, mtp_layers_in, open_checkpoint, parse_config,
                                      read_chat_template, read_config, read_generation_config)
from kestrel.compiler.ir import Program, q4_placements
from kestrel.compiler.ir_text import print_program
from kestrel.compiler.launch_plan import SPEC_ROW_STATES, launch_plan
from kestrel.compiler.ops import verify
from kestrel.compiler.presets import PRESETS, SHAPES, byte_level_tokenizer_json, synthesize
from kestrel.compiler.qwen3_5 import lower, lower_speculative
from kestrel.compiler.weights import storage, weight_bytes
from kestrel.kernels.targets import (ALL_TARGETS, RULES_ENV, TARGETS, exact_verify_rules, override_rules,
                                     overridden_rules, untuned_note)
from kestrel.passes.hoist_dynamic import check_dyn_invariance, check_routing
from kestrel.passes.pipeline import PASS_NAMES, PassOptions, run_passes
from kestrel.passes.plan_memory import memory_report
from kestrel.passes.quantize import DEFAULT_Q4_GROUP, DRAFT_QUANT_MODES, QUANT_MODES

DEFAULT_MAX_SEQ = 4096
DEFAULT_PREFILL_ROWS = 64  # the CPU reference path
DEFAULT_PREFILL_ROWS_GPU = 256  # H200, bench/results/stop17: 0.8B 25.2k tokens/s at 256 rows, 23.1k at 128, 15.4k
# at 64; 27B q4 1.70k at 256, 1.39k at 128 (2048-token prompts)
ONNX_PASSES = PASS_NAMES[:PASS_NAMES.index("quantize") + 1]  # the ONNX step is made before hoist_dynamic
SPECULATIVE_METHODS = ("mtp",)
DEFAULT_DRAFT_TOKENS = 3


def default_quant(target: str) -> str:
    return "none" if target == "cpu" else "bf16"


# --- options, output, model ------------------------------------------------------------------------

def check_options(target: str, quant: str, dump_ir_after: str | None, passes: tuple[str, ...] = PASS_NAMES):
    if target not in ALL_TARGETS:
        raise UnsupportedError(f"--target {target}: unknown target; choose one of {', '.join(ALL_TARGETS)}")
    if quant not in QUANT_MODES:
        raise UnsupportedError(f"--quant {quant}: unknown precision; choose one of {', '.join(QUANT_MODES)}")
    if dump_ir_after not in (None, "all", "lower") + passes:
        raise InputError(f"--dump-ir-after {dump_ir_after}: choose one of lower, {', '.join(passes)}, all")


def ir_dumper(dump_ir_after: str | None, dump):
    """``on_pass(name, program)`` that prints the IR after the pass ``--dump-ir-after`` names."""
    def on_pass(name, program):
        if dump_ir_after in (name, "all"):
            dump(f"# IR after {name}\n" + print_program(program))
    return on_pass


class ShapesOnly:
    """A model known by its config alone (``--weights random``): no tensors are read."""

    def __init__(self, cfg, config_path: str | None = None):
        self.cfg, self.folder, self.notices = cfg, None, []
        self.config_path = config_path

    def files(self) -> list[str]:
        return [self.config_path] if self.config_path else []

    def close(self):
        pass


@dataclass
class Model:
    """An opened model source: the checkpoint (or its shapes only), where it came from, the KV rows
    the step gets and the tokenizer to store (or None)."""

    ck: Checkpoint | ShapesOnly
    source: dict
    max_seq: int
    tokenizer_json: str | None
    chat: dict  # {"chat_template", "special_tokens"} from the checkpoint, or {}
    generation_eos: tuple[int, ...] = ()  # generation_config.json's stop tokens (read_generation_config)
    sampling: dict = field(default_factory=dict)  # and its recommended sampling, or {}

    @property
    def eos_token_ids(self) -> list[int]:
        """config.json's stop tokens, then generation_config.json's others: what a run stops at."""
        return list(dict.fromkeys([*self.cfg.eos_token_ids, *self.generation_eos]))

    @property
    def cfg(self):
        return self.ck.cfg


def resolve_max_seq(cfg, max_seq: int | None) -> int:
    if max_seq is None:
        max_seq = min(DEFAULT_MAX_SEQ, cfg.max_positions)
    if not 2 <= max_seq <= cfg.max_positions:  # a request is at least one prompt and one new token
        raise InputError(f"--max-seq {max_seq}: must be between 2 (one prompt and one new token) and the model's "
                         + (f"positions with YaRN ({cfg.max_positions}: factor x original_max_position_embeddings)"
                            if cfg.rope_yarn else f"max_position_embeddings ({cfg.max_position_embeddings})"))
    rows = 2 ** 31 // (cfg.num_key_value_heads * cfg.head_dim)  # the attention kernels' offsets are 32-bit
    if max_seq >= rows:
        raise InputError(f"--max-seq {max_seq}: the KV cache's 32-bit offsets allow at most {rows - 1} rows for this "
                         f"model ({cfg.num_key_value_heads} kv heads of {cfg.head_dim}); lower --max-seq")
    return max_seq


@contextlib.contextmanager
def open_model(model: str, max_seq: int | None = None, weights: str = "checkpoint",
               no_weights: str = "add --weights random (for benchmarking), or give a checkpoint folder",
               mtp: bool = False):
    """A checkpoint folder or a preset as a ``Model`` (presets with weights are synthesized into a
    temporary folder). ``weights="random"``: only the config is read. ``no_weights`` finishes the
    error for a shapes-only preset when weights are needed. ``mtp``: the model's MTP head is read
    too (NoDraftHeadError if it has none; with random weights: if its config names none)."""
    with contextlib.ExitStack() as stack:
        if weights == "random":
            if model in PRESETS or model in SHAPES:
                raw = (PRESETS | SHAPES)[model]
                ck = ShapesOnly(parse_config(raw, f"preset {model}"))
                source = {"kind": "preset", "name": model}
            else:
                folder, hub = find_checkpoint(model)
                raw, cfg = read_config(folder)
                ck = ShapesOnly(cfg, os.path.join(folder, "config.json"))
                source = {"kind": "checkpoint-config", "path": os.path.abspath(folder), **(hub or {})}
            if mtp and not mtp_layers_in(raw):
                raise NoDraftHeadError(f"{model}: --speculative mtp needs the model's multi-token-prediction head "
                                       f"and its config names none (mtp_num_hidden_layers): build without "
                                       f"--speculative")
        elif model in SHAPES:
            raise InputError(f"preset {model} has shapes but no weights: {no_weights}")
        elif model in PRESETS:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix=f"kestrel-{model}-"))
            try:
                ck, source = open_checkpoint(synthesize(model, tmp), mtp), {"kind": "preset", "name": model}
            except NoDraftHeadError as e:
                raise NoDraftHeadError(e.message.replace(tmp, f"preset {model}")) from None
        else:
            folder, hub = find_checkpoint(model)
            ck = open_checkpoint(folder, mtp)
            source = {"kind": "checkpoint", "path": os.path.abspath(folder), **(hub or {})}
        stack.callback(ck.close)
        tokenizer_json = None
        tok_path = os.path.join(ck.folder, "tokenizer.json") if ck.folder else None
        if tok_path and os.path.exists(tok_path):
            with open(tok_path, encoding="utf-8") as f:
                tokenizer_json = f.read()
        elif source["kind"] == "preset":
            tokenizer_json = byte_level_tokenizer_json()
        chat = read_chat_template(ck.folder) if ck.folder and tokenizer_json else {}
        stops, sampling = read_generation_config(ck.folder) if ck.folder and tokenizer_json else ((), {})
        bad = [i for i in stops if i >= ck.cfg.vocab_size]
        if bad:
            raise ConfigError(f"{os.path.join(ck.folder, 'generation_config.json')}: eos_token_id {bad[0]} is outside "
                              f"the vocabulary ({ck.cfg.vocab_size} tokens)")
        yield Model(ck, source, resolve_max_seq(ck.cfg, max_seq), tokenizer_json, chat, stops, sampling)


def _plan_info(m: Model, target: str, quant: str, **kw) -> PlanInfo:
    return PlanInfo(target=target, quant=quant, max_seq=m.max_seq, model=m.cfg.to_json(), source=m.source,
                    tokenizer={"eos_token_ids": m.eos_token_ids, **m.chat,
                               **({"sampling": m.sampling} if m.sampling else {})} if m.tokenizer_json else {},
                    **kw)


# --- kestrelc build ----------------------------------------------------------------------------------

@dataclass
class BuildResult:
    path: str
    nbytes: int
    weight_bytes: int
    state_bytes: int
    n_ops: int
    notices: list[str]


def default_prefill_rows(target: str, max_seq: int) -> int:
    """The M-row step's rows by default: 64 on the CPU reference path, 256 on GPU targets (measured), at
    most max_seq."""
    return min(DEFAULT_PREFILL_ROWS if target == "cpu" else DEFAULT_PREFILL_ROWS_GPU, max_seq)


def build(model: str, out: str, target: str = "cpu", quant: str | None = None, max_seq: int | None = None,
          log=print, progress: bool = True, q4_group: int = DEFAULT_Q4_GROUP, dump_ir_after: str | None = None,
          dump=print, weights: str = "checkpoint", seed: int = 0, prefill_rows: int | None = None,
          prefill_logits: str = "last", speculative: str | None = None,
          draft_tokens: int | None = None, draft_quant: str | None = None) -> BuildResult:
    quant = quant or default_quant(target)
    check_options(target, quant, dump_ir_after)
    if speculative is not None and speculative not in SPECULATIVE_METHODS:
        raise InputError(f"--speculative {speculative}: choose {', '.join(SPECULATIVE_METHODS)}")
    if draft_tokens is not None and speculative is None:
        raise InputError("--draft-tokens goes with --speculative mtp")
    if draft_quant is not None and speculative is None:
        raise InputError("--draft-quant goes with --speculative mtp")
    if draft_quant is not None and draft_quant not in DRAFT_QUANT_MODES:
        raise InputError(f"--draft-quant {draft_quant}: choose {', '.join(DRAFT_QUANT_MODES)}")
    if draft_quant == quant:
        draft_quant = None  # the drafts have the model's precision anyway
    if speculative is not None:
        draft_tokens = DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens
        if not 1 <= draft_tokens <= 4:
            raise InputError(f"--draft-tokens {draft_tokens}: 1 to 4 drafts an iteration")
        if prefill_rows == 0:
            raise InputError("--speculative mtp drafts from the M-row prefill: give --prefill-rows N > 0 (or leave "
                             "the default)")
    if prefill_rows is not None and prefill_rows < 0:
        raise InputError(f"--prefill-rows {prefill_rows}: must be 0 (no M-row step) or more")
    if prefill_logits not in ("last", "all"):
        raise InputError(f"--prefill-logits {prefill_logits}: choose last or all")
    if weights not in ("checkpoint", "random"):
        raise InputError(f"--weights {weights}: choose checkpoint or random")
    if not 0 <= seed < 2 ** 31:
        raise InputError(f"--seed {seed}: must be in [0, 2^31)")
    real = output_file(out)
    with open_model(model, max_seq, weights, mtp=speculative is not None) as m:
        not_an_input(real, m.ck.files())
        prefill_rows = default_prefill_rows(target, m.max_seq) if prefill_rows is None else prefill_rows
        if speculative is not None and m.max_seq < 2 * draft_tokens + 3:
            raise InputError(f"--max-seq {m.max_seq}: a speculative iteration of {draft_tokens} drafts needs at least "
                             f"{2 * draft_tokens + 3} rows")
        exact = speculative is not None and target != "cpu"  # (the verify's rows the one-token step's, bit for bit)
        rules = overridden_rules(target, exact_verify_rules(draft_tokens + 1)) if exact else contextlib.nullcontext()
        with rules as done:
            if done:
                log(f"note: speculative plan: its one-token step and verify are built so that each verified row is "
                    f"the one-token step's bit for bit (greedy speculation emits plain decoding's tokens): "
                    f"{' '.join(done)}")
            return _build(m, out, real, target, quant, log, progress, q4_group, ir_dumper(dump_ir_after, dump),
                          seed if weights == "random" else None, prefill_rows, prefill_logits,
                          draft_tokens if speculative is not None else 0, draft_quant)


def _build(m: Model, out: str, real: str, target: str, quant: str, log, progress: bool, q4_group: int, on_pass,
           random_seed: int | None, prefill_rows: int = 0, prefill_logits: str = "last",
           draft_tokens: int = 0, draft_quant: str | None = None) -> BuildResult:
    """Compile the opened model ``m`` into the plan at ``real`` (``out`` as the user wrote it, for the log)."""
    cfg = m.cfg
    n_layers = {k: cfg.layer_types.count(k) for k in ("linear_attention", "full_attention")}
    log(f"kestrelc: {m.source.get('name') or m.source.get('path')} ({cfg.model_type}, {cfg.num_hidden_layers} "
        f"layers: {n_layers['linear_attention']} gated-deltanet + {n_layers['full_attention']} attention) -> {out}  "
        f"[target {target}, quant {quant}, max_seq {m.max_seq}]")
    for notice in m.ck.notices:
        log(f"note: {notice}")
    if target != "cpu" and os.environ.get(RULES_ENV):
        try:
            done = override_rules(target, os.environ[RULES_ENV])
        except ValueError as e:
            raise InputError(f"{e}: fix or unset {RULES_ENV}") from None
        log(f"note: launch rules for {target} changed by {RULES_ENV}: {' '.join(done)}")
    note = untuned_note(TARGETS[target]) if target != "cpu" else None
    if note:
        log(f"note: {note}")
    program = lower(cfg, m.max_seq)
    verify(program)
    on_pass("lower", program)
    program = run_passes(program, PassOptions(target, quant, q4_group), on_pass=on_pass)
    rows_program = None
    if prefill_rows:
        rows_program = lower(cfg, m.max_seq, rows=prefill_rows, all_logits=prefill_logits == "all")
        verify(rows_program)
        rows_program = run_passes(rows_program, PassOptions(target, quant, q4_group, shares_arena_with=program))
        _share_arena(program, rows_program)
    spec_prefill = spec = None
    if draft_tokens:  # the speculative prefill and iteration, each planned in the arena of the one before
        own_head = draft_quant is not None and quant != "q4"  # a q4 plan's drafts read its q4 lm_head
        spec_prefill = lower_speculative(cfg, m.max_seq, draft_tokens, prefill_rows=prefill_rows, draft_head=own_head)
        verify(spec_prefill)
        spec_prefill = run_passes(spec_prefill, PassOptions(target, quant, q4_group, shares_arena_with=rows_program,
                                                            draft_quant=draft_quant))
        spec = lower_speculative(cfg, m.max_seq, draft_tokens, draft_head=own_head)
        verify(spec)
        spec = run_passes(spec, PassOptions(target, quant, q4_group, shares_arena_with=spec_prefill,
                                            draft_quant=draft_quant))
        _share_arena(program, rows_program, spec_prefill, spec)
    for name, prog in (("M=1 step", program), (f"M={prefill_rows} step", rows_program),
                       ("speculative prefill", spec_prefill), (f"speculative iteration, K={draft_tokens}", spec)):
        if prog is not None:
            n_launches = check_dyn_invariance(prog)
            n_routing = check_routing(prog)
            routed = f"; {n_routing} routing buffers read only as device data by the expert kernels" if n_routing \
                else ""
            log(f"dyn check ({name}): the launch list is identical at two token states ({n_launches} launches, no "
                f"per-token kernel argument{routed})")
    log(memory_report(program, rows_program))
    if target != "cpu":
        check_fits(program, target, quant, m.source.get("name") or m.source.get("path"))
    if spec is not None:
        log(speculative_memory_report(spec, spec_prefill))
    kernels, kernel_of_launch, cubins, fill, probes = None, None, {}, None, None
    weights_info = {"kind": "checkpoint"}
    if random_seed is not None:
        # q4_scales: each q4 weight's scales refilled to keep activations finite (kernels/fill.py)
        weights_info = {"kind": "random", "seed": random_seed, "q4_scales": True}
        log(f"note: --weights random: the plan records seed {random_seed}; the runtime fills the weights "
            f"(benchmarking only, never the default)")
    rows_of_launch = None
    spec_of_launch = (None, None)
    if target != "cpu":
        progs = [program] + ([rows_program] if rows_program else []) + ([spec_prefill, spec] if spec else [])
        kernels, of_launch, cubins = codegen.compile_kernels(progs, target, log)
        kernel_of_launch, rows_of_launch = of_launch[0], (of_launch[1] if rows_program else None)
        if spec is not None:
            spec_of_launch = (of_launch[2], of_launch[3])
        if random_seed is not None:
            placed = [w for p in progs for w in p.weights.values() if w.loc is not None and w.loc[0] == "weights"]
            fill = codegen.fill_launches(kernels, cubins, target, program.arena["weights"], random_seed,
                                         q4_placements(placed))
        probes = codegen.probe_kernels(kernels, cubins, target)
    extra = {"prefill_rows": prefill_rows, "prefill_logits": prefill_logits}
    if spec is not None:
        extra["speculative"] = {"method": "mtp", "draft_tokens": draft_tokens, "draft_quant": draft_quant or quant}
    info = _plan_info(m, target, quant, weights=weights_info, extra=extra)
    extra_parts = dict(cubins)
    if rows_program is not None:
        extra_parts[PREFILL_PROGRAM_PART] = print_program(rows_program).encode()
    if spec is not None:
        extra_parts[SPEC_PREFILL_PROGRAM_PART] = print_program(spec_prefill).encode()
        extra_parts[SPEC_PROGRAM_PART] = print_program(spec).encode()
    all_weights = plan_weights(program, spec_prefill, spec)
    weights = [] if random_seed is not None else [(w.name, *storage(w)) for w in all_weights.values()]

    def produce(name: str):
        return weight_bytes(all_weights[name], m.ck.read)

    # tqdm hides itself when stderr is not a terminal (disable=None)
    bar = tqdm(total=program.weight_bytes(), unit="B", unit_scale=True, desc="weights",
               disable=None if progress else True, leave=False)
    try:
        write_plan(real, info, print_program(program), weights, produce, m.tokenizer_json,
                   launch_plan=launch_plan(program, kernels, kernel_of_launch, fill,
                                           (rows_program, rows_of_launch) if rows_program else None, probes,
                                           speculative=(spec_prefill, spec_of_launch[0], spec, spec_of_launch[1],
                                                        draft_tokens) if spec else None),
                   extra_parts=extra_parts, progress=lambda name, n: bar.update(n))
    finally:
        bar.close()
    state_bytes = sum(st.type.nbytes for st in plan_states(program, spec_prefill, spec).values())
    result = BuildResult(out, os.path.getsize(real), sum(w.type.nbytes for w in all_weights.values()), state_bytes,
                         len(program.ops), m.ck.notices)
    log(f"kestrelc: wrote {out}: {result.nbytes / 1e6:.1f} MB ({len(program.ops)} ops, weights "
        f"{result.weight_bytes / 1e6:.1f} MB, state {result.state_bytes / 1e6:.1f} MB at max_seq {m.max_seq})")
    return result


CONTEXT_RESERVE = 1 << 30  # what the CUDA context, the cubins and the graphs take beside the arena


def check_fits(program: Program, target: str, quant: str, name: str) -> None:
    """DoesNotFitError (exit 12) unless the plan's arena (weights, states at max_seq, dyn, activations,
    scratch) plus CONTEXT_RESERVE fits the largest GPU of the target class: said at build time with the
    numbers, instead of an allocation failing at load."""
    t = TARGETS[target]
    need, have = sum(program.arena.values()), t.memory_mib << 20
    if not have or need + CONTEXT_RESERVE <= have:
        return
    a = program.arena
    hint = "build with --quant q4" if quant != "q4" else "lower --max-seq or target a larger GPU"
    raise DoesNotFitError(f"{name} at --quant {quant} needs a {need / 1e9:.1f} GB arena (weights "
                          f"{a['weights'] / 1e9:.1f} GB + state {a['state'] / 1e9:.2f} GB + the rest) + "
                          f"{CONTEXT_RESERVE / 1e9:.1f} GB for the CUDA context, and the largest {target} GPU "
                          f"({t.part.split('/')[-1].strip()}) has {have / 1e9:.1f} GB: {hint}")


def _share_arena(program: Program, rows_program: Program, *speculative: Program) -> None:
    """The M-row step shares the M=1 step's arena: the same weights (checked: same names, types, recipes
    and placements), states and dyn slots, and one act region the size of the largest. The speculative
    programs (``speculative``) hold the step's weights (checked the same way) and the MTP head's besides."""
    same = [(n, w.type, w.source, w.loc) for n, w in program.weights.items()]
    if same != [(n, w.type, w.source, w.loc) for n, w in rows_program.weights.items()]:
        raise UnsupportedError("the M-row step's weights differ from the one-token step's (an internal error): "
                               "build with --prefill-rows 0")
    for spec in speculative:
        theirs = {n: (w.type, w.source, w.loc) for n, w in spec.weights.items()}
        if any(theirs.get(n) != (w.type, w.source, w.loc) for n, w in program.weights.items()):
            raise UnsupportedError("the speculative programs' weights differ from the one-token step's (an internal "
                                   "error): build without --speculative")
    progs = (program, rows_program) + speculative
    arena = {r: max(p.arena[r] for p in progs) for r in program.arena}
    for p in progs:
        p.arena = dict(arena)


def plan_weights(program: Program, *more: Program | None) -> dict:
    """Every weight a plan stores, by name: the step's, then those only the speculative programs read
    (the MTP head's), in placement order."""
    out = dict(program.weights)
    extra = {n: w for p in more if p is not None for n, w in p.weights.items() if n not in out}
    out.update(sorted(extra.items(), key=lambda nw: nw[1].loc[1]))
    return out


def plan_states(program: Program, *more: Program | None) -> dict:
    """Every state of a plan's programs, by name (the step's first)."""
    out = dict(program.states)
    for p in more:
        if p is not None:
            for n, st in p.states.items():
                out.setdefault(n, st)
    return out


def speculative_memory_report(spec: Program, spec_prefill: Program) -> str:
    """What the speculative programs add to the arena: the MTP head's weights and KV caches, and the
    verify's per-row states (per Gated DeltaNet layer, each verified row's update of the recurrent state and the
    conv window after each row but the last)."""
    states = plan_states(spec_prefill, spec)
    snaps = sum(st.type.nbytes for n, st in states.items() if n.endswith(SPEC_ROW_STATES))
    head_kv = sum(st.type.nbytes for n, st in states.items() if n.startswith("mtp."))
    head_w = sum(w.type.nbytes for n, w in spec.weights.items() if n.startswith("mtp."))
    sampling = sum(st.type.nbytes for n, st in states.items() if n.startswith("spec."))
    return (f"memory: speculative decoding adds the MTP head's weights {head_w / 1e6:.2f} MB + its KV caches "
            f"{head_kv / 1e6:.2f} MB + the verify's row states {snaps / 1e6:.2f} MB + the drafts' distributions "
            f"and the replay buffer {sampling / 1e6:.2f} MB")


# --- kestrelc export-onnx ----------------------------------------------------------------------------

def step_program(cfg, max_seq: int, quant: str = "none", q4_group: int | None = None, on_pass=None) -> Program:
    """The program the ONNX graph is made from: lower, then the passes up to quantize (before
    hoist_dynamic: dyn slots are host inputs and the host advances pos)."""
    program = lower(cfg, max_seq)
    verify(program)
    if on_pass is not None:
        on_pass("lower", program)
    return run_passes(program, PassOptions("cpu", quant, q4_group or DEFAULT_Q4_GROUP), until=ONNX_PASSES[-1],
                      on_pass=on_pass)


@dataclass
class ExportResult:
    path: str
    data_path: str | None  # the external data file, if any
    nbytes: int  # model file + external data
    n_nodes: int
    signature: object  # onnx_export.StepSignature
    program_text: str
    model: Model


def export_onnx(model: str, out: str, quant: str = "none", q4_group: int | None = None, max_seq: int | None = None,
                external: bool | None = None, log=print, dump_ir_after: str | None = None, dump=print,
                check: bool = True, progress: bool = True) -> ExportResult:
    """``kestrelc export-onnx``: checkpoint or preset -> step.onnx (+ step.onnx.data for large models).

    ``external``: None decides by size (weights above 1 GiB go to ``OUT.data``), True / False force it.
    Options and the checkpoint are validated before anything is written; files appear under their
    names only when complete. With ``check``, the written model passes onnx.checker (full check)."""
    check_options("cpu", quant, dump_ir_after, ONNX_PASSES)
    real = output_file(out)
    output_file(real + ".data")  # where external data would go
    onnx = onnx_export.import_onnx()
    with open_model(model, max_seq, no_weights="ONNX export needs weights; give a checkpoint folder") as m:
        for path in (real, real + ".data"):
            not_an_input(path, m.ck.files())
        for notice in m.ck.notices:
            log(f"note: {notice}")
        program = step_program(m.cfg, m.max_seq, quant, q4_group, on_pass=ir_dumper(dump_ir_after, dump))
        # the weights as they are read, made and written, one at a time (as the build's bar; hidden off a terminal)
        bar = tqdm(total=program.weight_bytes(), unit="B", unit_scale=True, desc="weights",
                   disable=None if progress else True, leave=False)

        def produce(name: str):
            data = weight_bytes(program.weights[name], m.ck.read)
            bar.update(program.weights[name].type.nbytes)
            return data

        try:
            proto, sig, data_path = onnx_export.write_onnx(
                program, produce, real, external,
                metadata={"kestrel.quant": quant, "kestrel.max_seq": m.max_seq, "kestrel.source": m.source,
                          "kestrel.model": m.cfg.to_json()})
        finally:
            bar.close()
    if check:
        onnx.checker.check_model(real, full_check=True)
    nbytes = os.path.getsize(real) + (os.path.getsize(data_path) if data_path else 0)
    n_nodes = len(proto.graph.node)
    log(f"kestrelc: wrote {out}{' + ' + os.path.basename(data_path) if data_path else ''}: {nbytes / 1e6:.1f} MB "
        f"({n_nodes} ONNX nodes, opset {proto.opset_import[0].version}, quant {quant}, max_seq {m.max_seq}; inputs "
        f"{', '.join(list(sig.inputs)[:2])} + {len(sig.states)} states){'; onnx.checker: ok' if check else ''}")
    return ExportResult(out, data_path, nbytes, n_nodes, sig, print_program(program), m)


# --- kestrelc build --backend tensorrt ---------------------------------------------------------------

def onnx_path_for(plan_path: str) -> str:
    """Where ``build --backend tensorrt`` writes the ONNX step: next to the plan, as NAME.onnx."""
    return os.path.splitext(plan_path)[0] + ".onnx"


def build_tensorrt(model: str, out: str, target: str, quant: str | None = None, q4_group: int | None = None,
                   max_seq: int | None = None, log=print, dump_ir_after: str | None = None, dump=print,
                   weights: str = "checkpoint"):
    """The ONNX step next to the plan (OUT.onnx); then, where TensorRT and the target GPU are present, a
    TensorRT engine built from it (fixed shapes, strongly typed: the precision is the graph's) and
    stored in the .plan container with its TensorRT version and compute capability. Without TensorRT
    it stops after the ONNX with BackendMissingError (exit 9); without a matching GPU, DeviceError."""
    quant = quant or default_quant(target)
    check_options(target, quant, None)
    if target == "cpu":
        raise UnsupportedError("--backend tensorrt: a TensorRT engine runs on a GPU: give --target sm_XX (the GPU "
                               "that builds and runs the engine)")
    if weights != "checkpoint":
        raise UnsupportedError("--backend tensorrt: --weights random is for the kernels backend (the engine "
                               "holds its weights)")
    real = output_file(out)
    onnx_path = onnx_path_for(out)
    if os.path.abspath(onnx_path) == os.path.abspath(out):
        raise InputError(f"-o {out}: the plan needs its own name (the ONNX step is written to NAME.onnx next to it)")
    res = export_onnx(model, onnx_path, quant, q4_group, max_seq, log=log, dump_ir_after=dump_ir_after, dump=dump)
    not_an_input(real, res.model.ck.files())
    wrote = f"wrote the ONNX step to {onnx_path}"
    try:
        tensorrt_build.import_tensorrt()
    except BackendMissingError as e:
        raise BackendMissingError(f"--backend tensorrt: {e.message}; {wrote}: build the engine where TensorRT >= 10 "
                                  f"and an {target} GPU are present") from None
    cc = tensorrt_build.gpu_compute_capability(f"--backend tensorrt: TensorRT builds the engine on the GPU that runs "
                                               f"it; {wrote}")
    if cc != TARGETS[target].cc:
        raise DeviceError(f"--backend tensorrt --target {target}: this GPU is sm_{cc} and TensorRT builds for the GPU "
                          f"it runs on: use --target sm_{cc} or build on an {target} GPU; {wrote}")
    engine, version = tensorrt_build.build_engine(onnx_path, log=log)
    extra = {"backend": "tensorrt", "tensorrt_version": version, "compute_capability": f"{cc // 10}.{cc % 10}",
             "tensorrt": {"engine_part": ENGINE_PART, "onnx": os.path.basename(onnx_path),
                          "signature": res.signature.to_json(), "network": "strongly typed, fixed shapes"}}
    write_plan(real, _plan_info(res.model, target, quant, extra=extra), res.program_text, [], None,
               res.model.tokenizer_json, extra_parts={ENGINE_PART: engine})
    log(f"kestrelc: wrote {out}: {os.path.getsize(real) / 1e6:.1f} MB (TensorRT {version} engine for sm_{cc}, "
        f"{len(engine) / 1e6:.1f} MB)")
    return out
