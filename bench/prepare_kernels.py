"""Compile, on this machine (no GPU), every kernel the sm_90 programs of the real Qwen3.5 shapes
select, for the device check (bench/device_kernels.py). Writes OUT_DIR/index.json, one
OUT_DIR/<shape>.ir per program and the cubins.

    python bench/prepare_kernels.py bench/cubins
    (PROGRAMS="qwen3-next-80b-a3b:q4 qwen3.5-0.8b:q4": those programs only; ONLY_OP=gdn_delta,gdn_norm: those ops
    only; KESTREL_RULES: the sm_90 rules changed as kestrelc build changes them)
"""
from __future__ import annotations

import json
import os
import sys

from kestrel.compiler.frontend import parse_config
from kestrel.compiler.codegen import compile_op, constexprs, param_types
from kestrel.compiler.ir import Dyn, State, Value, Weight
from kestrel.compiler.ir_text import print_program
from kestrel.compiler.ops import is_view
from kestrel.compiler.presets import PRESETS, SHAPES
from kestrel.compiler.qwen3_5 import lower
from kestrel.kernels.targets import RULES_ENV, override_rules
from kestrel.passes.pipeline import PassOptions, run_passes

MAX_SEQ = 4096
PROGRAMS = [("qwen3.5-27b", "bf16"), ("qwen3.5-27b", "q4"), ("qwen3.5-0.8b", "bf16"), ("qwen3.5-0.8b", "q4"),
            ("tiny", "bf16"), ("tiny", "q4")]


def describe(x):
    kind = {Value: "value", Weight: "weight", State: "state", Dyn: "dyn"}[type(x)]
    if isinstance(x, Dyn):
        return {"kind": kind, "name": x.name, "dtype": x.dtype, "shape": [1]}
    return {"kind": kind, "name": getattr(x, "name", None), "dtype": x.type.dtype, "shape": list(x.type.shape)}


def main(out_dir: str):
    os.makedirs(out_dir, exist_ok=True)
    index, compiled = [], {}
    if os.environ.get(RULES_ENV):
        print("rules changed:", *override_rules("sm_90", os.environ[RULES_ENV]))
    programs = [tuple(p.split(":")) for p in os.environ["PROGRAMS"].split()] if os.environ.get("PROGRAMS") else PROGRAMS
    only_op = os.environ.get("ONLY_OP", "").split(",") if os.environ.get("ONLY_OP") else None
    for shape, quant in programs:
        config = PRESETS["tiny"] if shape == "tiny" else SHAPES[shape]
        prog = run_passes(lower(parse_config(config), 256 if shape == "tiny" else MAX_SEQ), PassOptions("sm_90", quant))
        ir_name = f"{shape}-{quant}.ir"
        with open(os.path.join(out_dir, ir_name), "w") as f:
            f.write(print_program(prog))
        seen = set()
        for i, op in enumerate(prog.ops):
            if is_view(op) or (only_op and op.kind not in only_op):
                continue
            key = (op.launch["kernel"], json.dumps(constexprs(op.launch), sort_keys=True), tuple(param_types(op)))
            if key in seen:
                continue  # one entry per distinct kernel configuration in a program
            seen.add(key)
            if key not in compiled:
                k = compile_op(op, 90)
                fname = f"k{len(compiled):03d}.cubin"
                with open(os.path.join(out_dir, fname), "wb") as f:
                    f.write(k.cubin)
                compiled[key] = {"cubin": fname, "name": k.name, "num_warps": k.num_warps, "shared": k.shared,
                                 "global_scratch_size": k.global_scratch_size, "arch": k.arch,
                                 "compiler": k.compiler, "params": k.params}
                print(f"compiled {op.launch['kernel']} {constexprs(op.launch)}", flush=True)
            index.append({"program": ir_name, "shape": shape, "quant": quant, "op_index": i, "op": op.kind,
                          "kernel": op.launch["kernel"], "grid": op.launch["grid"],
                          "constexprs": constexprs(op.launch), "args": [describe(x) for x in op.ins + op.outs],
                          "attrs": op.attrs, **compiled[key]})
    with open(os.path.join(out_dir, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    print(f"{len(index)} launches, {len(compiled)} cubins in {out_dir}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/cubins")
