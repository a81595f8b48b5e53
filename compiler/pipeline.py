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
from kestrel.compiler.ir import verify
from kestrel.compiler.ir_text import print_program
from kestrel.compiler.presets import PRESETS, synthesize
from kestrel.compiler.qwen3_5 import lower

TARGETS = ("cpu",)
QUANTS = ("none",)
DEFAULT_MAX_SEQ = 4096


@dataclass
class BuildResult:
    path: str
    nbytes: int
    weight_bytes: int
    state_bytes: int
    n_ops: int
    notices: list[str]


def _check_options(target: str, quant: str):
    if target not in TARGETS:
        raise UnsupportedError(f"--target {target}: only 'cpu' plans can be built so far (GPU targets need the "
                               f"kernel library, not in this version); use --target cpu")
    if quant not in QUANTS:
        raise UnsupportedError(f"--quant {quant}: only 'none' (fp32) is available so far (bf16 and q4 come with "
                               f"the quantize pass); use --quant none")


def build(model: str, out: str, target: str = "cpu", quant: str = "none", max_seq: int | None = None,
          log=print, progress: bool = True) -> BuildResult:
    _check_options(target, quant)
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise InputError(f"-o {out}: folder {out_dir} does not exist")
    if model in PRESETS:
        with tempfile.TemporaryDirectory(prefix=f"kestrel-{model}-") as tmp:
            ck = open_checkpoint(synthesize(model, tmp))
            return _build(ck, {"kind": "preset", "name": model}, out, target, quant, max_seq, log, progress)
    ck = open_checkpoint(model)
    return _build(ck, {"kind": "checkpoint", "path": os.path.abspath(model)}, out, target, quant, max_seq, log,
                  progress)


def _build(ck: Checkpoint, source: dict, out: str, target: str, quant: str, max_seq: int | None, log,
           progress: bool) -> BuildResult:
    cfg = ck.cfg
    if max_seq is None:
        max_seq = min(DEFAULT_MAX_SEQ, cfg.max_position_embeddings)
    if not 1 <= max_seq <= cfg.max_position_embeddings:
        raise InputError(f"--max-seq {max_seq}: must be between 1 and the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    for notice in ck.notices:
        log(f"note: {notice}")

    program, sources = lower(cfg, max_seq)
    verify(program)

    tok_path = os.path.join(ck.folder, "tokenizer.json")
    tokenizer_json = None
    if os.path.exists(tok_path):
        with open(tok_path, encoding="utf-8") as f:
            tokenizer_json = f.read()
    info = PlanInfo(target=target, quant=quant, max_seq=max_seq, model=cfg.to_json(), source=source,
                    tokenizer={"eos_token_ids": list(cfg.eos_token_ids)} if tokenizer_json else {})
    weights = [(w.name, w.type.dtype, w.type.shape) for w in program.weights.values()]

    def produce(name: str):
        import torch

        w = program.weights[name]
        t = ck.read(sources[name]).to(torch.float32).reshape(w.type.shape).contiguous()
        return memoryview(t.numpy()).cast("B")

    n_layers = {k: cfg.layer_types.count(k) for k in ("linear_attention", "full_attention")}
    log(f"kestrelc: {source.get('name') or source.get('path')} ({cfg.model_type}, {cfg.num_hidden_layers} layers: "
        f"{n_layers['linear_attention']} gated-deltanet + {n_layers['full_attention']} attention) -> {out}  "
        f"[target {target}, quant {quant}, max_seq {max_seq}]")
    bar = _progress_bar(program.weight_bytes(), enabled=progress)
    try:
        write_plan(out, info, print_program(program), weights, produce, tokenizer_json,
                   progress=lambda name, n: bar.update(n))
    finally:
        bar.close()
        ck.close()
    result = BuildResult(out, os.path.getsize(out), program.weight_bytes(), program.state_bytes(),
                         len(program.ops), ck.notices)
    log(f"kestrelc: wrote {out}: {result.nbytes / 1e6:.1f} MB ({len(program.ops)} ops, weights "
        f"{result.weight_bytes / 1e6:.1f} MB, state {result.state_bytes / 1e6:.1f} MB at max_seq {max_seq})")
    return result


def _progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    # tqdm hides itself when stderr is not a terminal (disable=None)
    return tqdm(total=total, unit="B", unit_scale=True, desc="weights", disable=None if enabled else True,
                leave=False)
