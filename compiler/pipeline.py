"""``kestrelc build``: checkpoint or preset -> validated frontend -> step program -> .plan.

Order matters for the "bad input loses nothing" rule: the checkpoint, the config and every build
option are validated before the first byte is written, and the plan is written under a temporary
name and renamed only when complete.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from kestrel.artifacts.errors import InputError, UnsupportedError
from kestrel.artifacts.plan import PlanInfo, write_plan
from kestrel.compiler.frontend import Checkpoint, open_checkpoint
from kestrel.compiler.ir import Program, verify
from kestrel.compiler.ir_text import print_program
from kestrel.compiler.launch_plan import launch_plan
from kestrel.compiler.frontend import read_config
from kestrel.compiler.presets import PRESETS, QWEN35_SHAPES, byte_level_tokenizer_json, synthesize
from kestrel.compiler.qwen3_5 import lower
from kestrel.compiler.weights import storage, weight_bytes
from kestrel.kernels.targets import ALL_TARGETS
from kestrel.passes.fuse import fuse
from kestrel.passes.hoist_dynamic import check_dyn_invariance, hoist_dynamic
from kestrel.passes.plan_memory import memory_report, plan_memory
from kestrel.passes.quantize import DEFAULT_Q4_GROUP, QUANT_MODES, quantize
from kestrel.passes.select_kernels import select_kernels

PASS_NAMES = ("fuse", "quantize", "hoist_dynamic", "plan_memory", "select_kernels")
DEFAULT_MAX_SEQ = 4096


def default_quant(target: str) -> str:
    return "none" if target == "cpu" else "bf16"


def run_passes(program: Program, target: str, quant: str, q4_group: int = DEFAULT_Q4_GROUP,
               until: str | None = None, on_pass=None, skip_done: bool = False) -> Program:
    """The pass pipeline, each pass followed by the verifier. ``on_pass(name, program)`` sees the
    program after each pass; ``until`` stops after that pass; ``skip_done`` skips plan_memory on a
    program that already has an arena (hand-written golden inputs)."""
    passes = {"fuse": fuse, "quantize": lambda p: quantize(p, quant, q4_group), "hoist_dynamic": hoist_dynamic,
              "plan_memory": plan_memory, "select_kernels": lambda p: select_kernels(p, target)}
    for name in PASS_NAMES:
        if skip_done and name == "plan_memory" and program.arena:
            continue
        program = passes[name](program)
        verify(program)
        if on_pass is not None:
            on_pass(name, program)
        if name == until:
            break
    return program


@dataclass
class BuildResult:
    path: str
    nbytes: int
    weight_bytes: int
    state_bytes: int
    n_ops: int
    notices: list[str]


def _check_options(target: str, quant: str, dump_ir_after: str | None):
    if target not in ALL_TARGETS:
        raise UnsupportedError(f"--target {target}: unknown target; choose one of {', '.join(ALL_TARGETS)}")
    if quant not in QUANT_MODES:
        raise UnsupportedError(f"--quant {quant}: unknown precision; choose one of {', '.join(QUANT_MODES)}")
    if dump_ir_after not in (None, "all", "lower") + PASS_NAMES:
        raise InputError(f"--dump-ir-after {dump_ir_after}: choose one of lower, {', '.join(PASS_NAMES)}, all")


class ShapesOnly:
    """A model known by its config alone (``--weights random``): no tensors are read."""

    def __init__(self, cfg, folder=None):
        self.cfg, self.folder, self.notices = cfg, folder, []

    def close(self):
        pass


def build(model: str, out: str, target: str = "cpu", quant: str | None = None, max_seq: int | None = None,
          log=print, progress: bool = True, q4_group: int = DEFAULT_Q4_GROUP, dump_ir_after: str | None = None,
          dump=print, weights: str = "checkpoint", seed: int = 0) -> BuildResult:
    quant = quant or default_quant(target)
    _check_options(target, quant, dump_ir_after)
    if weights not in ("checkpoint", "random"):
        raise InputError(f"--weights {weights}: choose checkpoint or random")
    opts = dict(q4_group=q4_group, dump_ir_after=dump_ir_after, dump=dump,
                random_seed=seed if weights == "random" else None)
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise InputError(f"-o {out}: folder {out_dir} does not exist")
    if weights == "random":
        from kestrel.compiler.frontend import parse_config

        if model in PRESETS or model in QWEN35_SHAPES:
            cfg = parse_config((PRESETS | QWEN35_SHAPES)[model], f"preset {model}")
            source = {"kind": "preset", "name": model}
        else:
            source = {"kind": "checkpoint-config", "path": os.path.abspath(model)}
            cfg = read_config(model)[1]
        return _build(ShapesOnly(cfg), source, out, target, quant, max_seq, log, progress, **opts)
    if model in QWEN35_SHAPES:
        raise InputError(f"preset {model} has shapes but no weights: add --weights random (for benchmarking), "
                         f"or give a checkpoint folder")
    if model in PRESETS:
        with tempfile.TemporaryDirectory(prefix=f"kestrel-{model}-") as tmp:
            ck = open_checkpoint(synthesize(model, tmp))
            return _build(ck, {"kind": "preset", "name": model}, out, target, quant, max_seq, log, progress, **opts)
    ck = open_checkpoint(model)
    return _build(ck, {"kind": "checkpoint", "path": os.path.abspath(model)}, out, target, quant, max_seq, log,
                  progress, **opts)


def _build(ck: Checkpoint, source: dict, out: str, target: str, quant: str, max_seq: int | None, log,
           progress: bool, q4_group: int, dump_ir_after: str | None, dump, random_seed: int | None) -> BuildResult:
    cfg = ck.cfg
    if max_seq is None:
        max_seq = min(DEFAULT_MAX_SEQ, cfg.max_position_embeddings)
    if not 1 <= max_seq <= cfg.max_position_embeddings:
        raise InputError(f"--max-seq {max_seq}: must be between 1 and the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    for notice in ck.notices:
        log(f"note: {notice}")

    program = lower(cfg, max_seq)
    verify(program)

    def on_pass(name, prog):
        if dump_ir_after in (name, "all"):
            dump(f"# IR after {name}\n" + print_program(prog))

    on_pass("lower", program)
    program = run_passes(program, target, quant, q4_group, on_pass=on_pass)
    n_launches = check_dyn_invariance(program)
    log(f"dyn check: the launch list is identical at two token states ({n_launches} launches, no per-token "
        f"kernel argument)")
    log(memory_report(program))
    kernels, kernel_of_launch, cubins = (None, None, {})
    weights_info = {"kind": "checkpoint"}
    if random_seed is not None:
        weights_info = {"kind": "random", "seed": random_seed}
        log(f"note: --weights random: the plan records seed {random_seed}; the runtime fills the weights "
            f"(benchmarking only, never the default)")
    if target != "cpu":
        kernels, kernel_of_launch, cubins = compile_kernels(program, target, log)
        if random_seed is not None:
            weights_info["fill_kernel"] = add_fill_kernel(kernels, cubins, target)

    tokenizer_json = None
    tok_path = os.path.join(ck.folder, "tokenizer.json") if ck.folder else None
    if tok_path and os.path.exists(tok_path):
        with open(tok_path, encoding="utf-8") as f:
            tokenizer_json = f.read()
    elif source["kind"] == "preset":
        tokenizer_json = byte_level_tokenizer_json()
    info = PlanInfo(target=target, quant=quant, max_seq=max_seq, model=cfg.to_json(), source=source,
                    tokenizer={"eos_token_ids": list(cfg.eos_token_ids)} if tokenizer_json else {},
                    weights=weights_info)
    weights = [] if random_seed is not None else [(w.name, *storage(w)) for w in program.weights.values()]

    def produce(name: str):
        return weight_bytes(program.weights[name], ck.read)

    n_layers = {k: cfg.layer_types.count(k) for k in ("linear_attention", "full_attention")}
    log(f"kestrelc: {source.get('name') or source.get('path')} ({cfg.model_type}, {cfg.num_hidden_layers} layers: "
        f"{n_layers['linear_attention']} gated-deltanet + {n_layers['full_attention']} attention) -> {out}  "
        f"[target {target}, quant {quant}, max_seq {max_seq}]")
    bar = _progress_bar(program.weight_bytes(), enabled=progress)
    try:
        write_plan(out, info, print_program(program), weights, produce, tokenizer_json,
                   launch_plan=launch_plan(program, kernels, kernel_of_launch), extra_parts=cubins,
                   progress=lambda name, n: bar.update(n))
    finally:
        bar.close()
        ck.close()
    result = BuildResult(out, os.path.getsize(out), program.weight_bytes(), program.state_bytes(),
                         len(program.ops), ck.notices)
    log(f"kestrelc: wrote {out}: {result.nbytes / 1e6:.1f} MB ({len(program.ops)} ops, weights "
        f"{result.weight_bytes / 1e6:.1f} MB, state {result.state_bytes / 1e6:.1f} MB at max_seq {max_seq})")
    return result


def compile_kernels(program: Program, target: str, log) -> tuple[list[dict], list[int], dict[str, bytes]]:
    """AOT-compile every distinct kernel configuration the program launches, for ``target``.
    Returns the kernel table, each launch's index into it, and the cubin parts."""
    import json

    from kestrel.compiler.ir import is_view
    from kestrel.kernels.aot import compile_op, constexprs, param_types, pointer_alignment
    from kestrel.kernels.targets import TARGETS

    cc = TARGETS[target].cc
    table, index, of_launch, cubins = [], {}, [], {}
    for op in program.ops:
        if is_view(op):
            continue
        key = (op.launch["kernel"], json.dumps(constexprs(op.launch), sort_keys=True), op.launch["num_warps"],
               tuple(param_types(op)), tuple(pointer_alignment(op)))
        if key not in index:
            k = compile_op(op, cc)
            part = f"__kestrel__/cubin/{len(table):03d}"
            cubins[part] = k.cubin
            index[key] = len(table)
            table.append({"id": k.kernel_id, "part": part, "name": k.name, "params": [list(p) for p in k.params],
                          "num_warps": k.num_warps, "block": 32 * k.num_warps, "shared": k.shared,
                          "global_scratch_size": k.global_scratch_size,
                          "global_scratch_align": k.global_scratch_align,
                          "profile_scratch_size": k.profile_scratch_size, "arch": k.arch, "compiler": k.compiler,
                          "constexprs": constexprs(op.launch)})
        of_launch.append(index[key])
    log(f"kernels: compiled {len(table)} distinct kernels for {target} ({table[0]['arch'] if table else '-'}, "
        f"{table[0]['compiler'] if table else '-'}) for {len(of_launch)} launches")
    return table, of_launch, cubins


def add_fill_kernel(kernels: list[dict], cubins: dict, target: str) -> int:
    """Compile the random-weights fill kernel into the kernel table; returns its index."""
    from kestrel.kernels.aot import compile_kernel
    from kestrel.kernels.fill import FILL_BLOCK, FILL_TYPES
    from kestrel.kernels.targets import TARGETS

    k = compile_kernel("fill_random", FILL_TYPES, {"BLOCK": FILL_BLOCK}, 4, TARGETS[target].cc)
    part = f"__kestrel__/cubin/{len(kernels):03d}"
    cubins[part] = k.cubin
    kernels.append({"id": k.kernel_id, "part": part, "name": k.name, "params": [list(p) for p in k.params],
                    "num_warps": k.num_warps, "block": 32 * k.num_warps, "shared": k.shared,
                    "global_scratch_size": k.global_scratch_size, "global_scratch_align": k.global_scratch_align,
                    "profile_scratch_size": k.profile_scratch_size, "arch": k.arch, "compiler": k.compiler,
                    "constexprs": {"BLOCK": FILL_BLOCK}})
    return len(kernels) - 1


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    # tqdm hides itself when stderr is not a terminal (disable=None)
    return tqdm(total=total, unit="B", unit_scale=True, desc="weights", disable=None if enabled else True,
                leave=False)
