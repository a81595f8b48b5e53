"""Ahead-of-time compilation of the selected Triton kernels to cubins, on a machine with no GPU.

The kernel ABI (the contract between select_kernels, these kernels and the GPU runtime): a launch
of op ``op`` with ``op.launch = {kernel, grid, num_warps, CONSTEXPRS...}`` passes, in order,
  1. one pointer per operand, then one per result (``op.ins + op.outs``): values, weights, states
     and dyn slots alike (a dyn slot is a pointer to its 4-byte slot in the dyn buffer, so kernels
     read per-token values from device memory, never from their arguments);
  2. one scalar per op attribute, in attribute order (floats as fp32, ints as i32);
  3. Triton's two trailing pointers (global scratch, profile scratch; 0 when their sizes are 0).
The UPPER-case launch keys are the kernel's constexpr parameters, by name. Pointer element types
follow the buffer's dtype (f32 -> *fp32, bf16 -> *bf16, q4 -> *u8, i32 dyn -> *i32).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from kestrel.compiler.ir import Dyn, Op, is_q4

# kernel id (or id prefix ending in "_") -> (module in kestrel.kernels, jit function name)
REGISTRY = {
    "embedding_": ("embedding", "embedding_kernel"),
    "rmsnorm": ("rmsnorm", "rmsnorm_kernel"),
    "add_rmsnorm": ("rmsnorm", "add_rmsnorm_kernel"),
    "matvec_swiglu_": ("matvec", "matvec_swiglu_kernel"),
    "matvec_": ("matvec", "matvec_kernel"),
    "gdn_delta": ("gated_delta", "gdn_delta_kernel"),
    "gdn_norm": ("gated_delta", "gdn_norm_kernel"),
    "attn_step_": ("attention", "attn_step_kernel"),
    "sample": ("sample", "sample_kernel"),
    "step_end": ("sample", "step_end_kernel"),
    "fill_random": ("fill", "fill_random_kernel"),
}
PTR_TYPES = {"f32": "*fp32", "bf16": "*bf16", "f16": "*fp16", "i32": "*i32"}


def jit_function(kernel_id: str):
    for key, (module, name) in REGISTRY.items():
        if kernel_id == key or (key.endswith("_") and kernel_id.startswith(key)):
            return getattr(importlib.import_module(f"kestrel.kernels.{module}"), name)
    raise KeyError(f"no Triton kernel registered for {kernel_id!r}")


def param_types(op: Op) -> list[str]:
    """Triton signature types of the runtime parameters of ``op``'s launch, in ABI order."""
    types = []
    for x in list(op.ins) + list(op.outs):
        dtype = x.dtype if isinstance(x, Dyn) else x.type.dtype
        types.append("*u8" if is_q4(dtype) else PTR_TYPES[dtype])
    for v in op.attrs.values():
        types.append("fp32" if isinstance(v, float) else "i32")
    return types


def constexprs(launch: dict) -> dict:
    return {k: v for k, v in launch.items() if k.isupper()}


@dataclass
class CompiledKernel:
    kernel_id: str
    name: str  # the cubin's entry point
    cubin: bytes
    params: list[tuple[str, str]]  # (name, triton type), runtime parameters in order (scratch excluded)
    num_warps: int
    shared: int
    global_scratch_size: int
    global_scratch_align: int
    profile_scratch_size: int
    arch: str  # e.g. sm_90a: Triton emits the arch-specific variant for cc >= 9.0
    compiler: str


def compile_kernel(kernel_id: str, types: list[str], consts: dict, num_warps: int, cc: int,
                   aligned: list[bool] | None = None) -> CompiledKernel:
    """``aligned[i]``: runtime parameter i is a pointer known to be 16-byte aligned (lets Triton
    vectorise its loads); the arena base is 256-byte aligned, so this follows from placements."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = jit_function(kernel_id)
    if not isinstance(fn, JITFunction):  # TRITON_INTERPRET=1 (the test suite): compile in a clean process
        return _compile_in_subprocess(kernel_id, types, consts, num_warps, cc, aligned)
    names = [n for n in fn.arg_names if n not in consts]
    if len(names) != len(types):
        raise ValueError(f"{kernel_id}: kernel takes {len(names)} runtime parameters {names}, the op passes "
                         f"{len(types)}")
    missing = [n for n in fn.arg_names if n not in consts and n.isupper()]
    if missing:
        raise ValueError(f"{kernel_id}: constexprs {missing} are not given by the launch rule")
    signature = dict(zip(names, types)) | {k: "constexpr" for k in consts}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
             for n, ok in zip(names, aligned or []) if ok}
    src = ASTSource(fn=fn, signature=signature, constexprs=dict(consts), attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"num_warps": num_warps})
    md = c.metadata
    return CompiledKernel(kernel_id, md.name, c.asm["cubin"], list(zip(names, types)), md.num_warps, md.shared,
                          md.global_scratch_size, md.global_scratch_align, md.profile_scratch_size,
                          f"sm_{cc}{'a' if cc >= 90 else ''}", f"triton {triton.__version__}")


def pointer_alignment(op: Op) -> list[bool]:
    args = list(op.ins) + list(op.outs)
    return [x.loc is not None and x.loc[1] % 16 == 0 for x in args] + [False] * len(op.attrs)


def compile_op(op: Op, cc: int) -> CompiledKernel:
    return compile_kernel(op.launch["kernel"], param_types(op), constexprs(op.launch), op.launch["num_warps"], cc,
                          pointer_alignment(op))


def _compile_in_subprocess(kernel_id, types, consts, num_warps, cc, aligned) -> CompiledKernel:
    import base64
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    job = json.dumps([kernel_id, types, consts, num_warps, cc, aligned])
    r = subprocess.run([sys.executable, "-c", "from kestrel.kernels.aot import _compile_main; _compile_main()"],
                       input=job, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"AOT compile of {kernel_id} for cc {cc} failed:\n{r.stderr[-3000:]}")
    d = json.loads(r.stdout.strip().splitlines()[-1])
    d["cubin"] = base64.b64decode(d["cubin"])
    d["params"] = [tuple(p) for p in d["params"]]
    return CompiledKernel(**d)


def _compile_main() -> None:
    import base64
    import dataclasses
    import json
    import sys

    k = compile_kernel(*json.loads(sys.stdin.read()))
    d = dataclasses.asdict(k)
    d["cubin"] = base64.b64encode(k.cubin).decode()
    print(json.dumps(d))
