"""Code generation, the stage after the passes: the selected Triton kernels compiled ahead of time to
cubins for the target, on a machine with no GPU, and the kernel table the launch plan refers to.

The kernel ABI (the contract between select_kernels, these kernels and the GPU runtime): a launch
of op ``op`` with ``op.launch = {kernel, grid, num_warps, CONSTEXPRS...}`` passes, in order,
  1. one pointer per operand, then one per result (``op.ins + op.outs``): values, weights, states
     and dyn slots alike (a dyn slot is a pointer to its 4-byte slot in the dyn buffer, so kernels
     read per-token values from device memory, never from their arguments);
  2. one scalar per op attribute, in attribute order (floats as fp32, ints as i32);
  3. Triton's two trailing pointers (global scratch, profile scratch; 0 when their sizes are 0).
The UPPER-case launch keys are the kernel's constexpr parameters, by name; codegen adds one more,
``PDL`` (kernels/pdl.py: true from sm_90), to every kernel that takes it, and records it in the
kernel table, where the runtime reads whether the step's graph may chain its nodes programmatically.
Pointer element types follow the buffer's dtype (f32 -> *fp32, bf16 -> *bf16, q4 -> *u8, i32 dyn -> *i32).
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kestrel.artifacts.errors import BackendMissingError
from kestrel.compiler.ir import Dyn, Op, Program, is_q4
from kestrel.compiler.ops import OPS, is_view, scalar_attrs
from kestrel.kernels import bandwidth, fill
from kestrel.kernels.pdl import PDL_MIN_CC
from kestrel.kernels.q4_mma import CudaKernel
from kestrel.kernels.targets import TARGETS

PTR_TYPES = {"f32": "*fp32", "bf16": "*bf16", "f16": "*fp16", "i32": "*i32"}
NO_LINE_INFO = "TRITON_DISABLE_LINE_INFO"


def jit_name(fn) -> str:
    """``module:function`` of a Triton kernel (jit or interpreted) or a CUDA C kernel (``CudaKernel``):
    how the kernel table names it."""
    if isinstance(fn, CudaKernel):
        return fn.jit_name
    py = fn.fn
    return f"{py.__module__}:{py.__name__}"


def jit_function(name: str):
    """The Triton kernel a kernel table entry names (``jit_name``)."""
    module, _, fn = name.partition(":")
    return getattr(importlib.import_module(module), fn)


def param_types(op: Op) -> list[str]:
    """Triton signature types of the runtime parameters of ``op``'s launch, in ABI order."""
    types = []
    for x in list(op.ins) + list(op.outs):
        dtype = x.dtype if isinstance(x, Dyn) else x.type.dtype
        types.append("*u8" if is_q4(dtype) else PTR_TYPES[dtype])
    for v in scalar_attrs(op):
        types.append("fp32" if isinstance(v, float) else "i32")
    return types


def constexprs(launch: dict) -> dict:
    return {k: v for k, v in launch.items() if k.isupper()}


def with_pdl(fn, consts: dict, cc: int) -> dict:
    """``consts`` plus ``PDL`` where the kernel ``fn`` takes it and it is not given: true on targets with
    programmatic dependent launch (kernels/pdl.py)."""
    takes = fn.constexprs if isinstance(fn, CudaKernel) else inspect.signature(fn.fn).parameters
    if "PDL" in consts or "PDL" not in takes:
        return dict(consts)
    return dict(consts) | {"PDL": cc >= PDL_MIN_CC}


def op_constexprs(op: Op, cc: int) -> dict:
    """The constexprs ``op``'s kernel is compiled with: its launch rule's, and ``PDL`` (``with_pdl``)."""
    return with_pdl(OPS[op.kind].kernel.jit_for(op), constexprs(op.launch), cc)


@dataclass
class CompiledKernel:
    kernel_id: str
    jit: str  # the Triton kernel it was compiled from (jit_name)
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


def compile_kernel(kernel_id: str, jit, types: list[str], consts: dict, num_warps: int, cc: int,
                   aligned: list[bool] | None = None, fp_fusion: bool = True) -> CompiledKernel:
    """Compile the Triton kernel ``jit`` (a function or its ``jit_name``) as ``kernel_id``.
    ``aligned[i]``: runtime parameter i is a pointer known to be 16-byte aligned (lets Triton
    vectorise its loads); the arena base is 256-byte aligned, so this follows from placements.
    ``fp_fusion``: Triton's ``enable_fp_fusion`` (products contracted into adds; a launch's ``fp_fusion`` key)."""
    fn = jit_function(jit) if isinstance(jit, str) else jit
    # (a list-valued constexpr, the RoPE kernels' YARN as the IR's text form and JSON hold it, as the hashable tuple
    # Triton needs)
    consts = with_pdl(fn, {k: tuple(v) if isinstance(v, list) else v for k, v in consts.items()}, cc)
    if isinstance(fn, CudaKernel):
        if not fp_fusion:
            raise ValueError(f"{kernel_id}: a CUDA C kernel takes no fp_fusion option")
        return compile_cuda(kernel_id, fn, types, consts, num_warps, cc)
    if not isinstance(fn, JITFunction):  # TRITON_INTERPRET=1 (the test suite): compile in a clean process
        return _compile_in_subprocess(kernel_id, jit_name(fn), types, consts, num_warps, cc, aligned, fp_fusion)
    consts = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()  # defaulted constexprs (YARN)
              if n.isupper() and n not in consts and p.default is not inspect.Parameter.empty} | consts
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
    with _no_line_info():
        c = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                           options={"num_warps": num_warps, "enable_fp_fusion": fp_fusion})
    md = c.metadata
    return CompiledKernel(kernel_id, jit_name(fn), md.name, c.asm["cubin"], list(zip(names, types)), md.num_warps,
                          md.shared, md.global_scratch_size, md.global_scratch_align, md.profile_scratch_size,
                          f"sm_{cc}{'a' if cc >= 90 else ''}", f"triton {triton.__version__}")


def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"nvrtc {major}.{minor}"


def compile_cuda(kernel_id: str, fn: CudaKernel, types: list[str], consts: dict, num_warps: int,
                 cc: int) -> CompiledKernel:
    """Compile the CUDA C kernel ``fn`` with NVRTC (pip's nvidia-cuda-nvrtc, through cuda.bindings), one
    ``#define`` per constexpr, for exactly ``sm_<cc>``. Same ABI as the Triton kernels (the two trailing
    scratch pointers included); no line info, so the bytes do not depend on the machine."""
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()
    except Exception as e:  # noqa: BLE001 - no cuda-bindings, or no libnvrtc for it to load
        raise BackendMissingError(f"{kernel_id} is CUDA C and compiling it needs cuda-bindings and "
                                  f"nvidia-cuda-nvrtc ({type(e).__name__}): pip install -e '.[compile]'") from None
    if len(fn.params) != len(types):
        raise ValueError(f"{kernel_id}: kernel takes {len(fn.params)} runtime parameters {list(fn.params)}, the op "
                         f"passes {len(types)}")
    missing = [n for n in fn.constexprs if n not in consts]
    if missing:
        raise ValueError(f"{kernel_id}: constexprs {missing} are not given by the launch rule")
    defines = "".join(f"#define {k} {int(v)}\n" for k, v in consts.items()) + f"#define ENTRY {fn.name}\n"
    arch = f"sm_{cc}"

    def ok(result, what):
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{kernel_id}: {what} failed ({result[0]})")
        return result[1] if len(result) > 1 else None

    prog = ok(nvrtc.nvrtcCreateProgram((defines + fn.source).encode(), f"{fn.name}.cu".encode(), 0, [], []),
              "nvrtcCreateProgram")
    try:
        (r,) = nvrtc.nvrtcCompileProgram(prog, 3, [f"--gpu-architecture={arch}".encode(), b"-default-device",
                                                    b"--std=c++17"])
        if r != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = ok(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"{kernel_id}: NVRTC compile for {arch} failed:\n{log.decode(errors='replace')[-3000:]}")
        size = ok(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        ok(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CompiledKernel(kernel_id, fn.jit_name, fn.name, bytes(cubin), list(zip(fn.params, types)), num_warps,
                          fn.shared(consts), 0, 1, 0, arch, nvrtc_version())


@contextlib.contextmanager
def _no_line_info():
    """Cubins without debug line info: with it, a cubin holds the absolute path of the kernel's source
    file (or of another checkout's, from Triton's shared cache), so the same build would give different
    bytes on different machines. The setting is part of Triton's cache key."""
    old = os.environ.get(NO_LINE_INFO)
    os.environ[NO_LINE_INFO] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[NO_LINE_INFO]
        else:
            os.environ[NO_LINE_INFO] = old


def pointer_alignment(op: Op) -> list[bool]:
    args = list(op.ins) + list(op.outs)
    return [x.loc is not None and x.loc[1] % 16 == 0 for x in args] + [False] * len(scalar_attrs(op))


def compile_op(op: Op, cc: int, consts: dict | None = None) -> CompiledKernel:
    """``op``'s kernel for cc, with its constexprs (``op_constexprs``) or ``consts``."""
    return compile_kernel(op.launch["kernel"], OPS[op.kind].kernel.jit_for(op), param_types(op),
                          op_constexprs(op, cc) if consts is None else consts, op.launch["num_warps"], cc,
                          pointer_alignment(op), op.launch.get("fp_fusion", True))


_REPLY = "kestrel-compiled "


class _CompileServer:
    """One clean process (no TRITON_INTERPRET) that compiles kernels sent to it, one JSON job a line:
    Triton's interpreter mode (the test suite) replaces @triton.jit functions, so AOT compiles run
    there. Started on first use and kept for the life of this process (starting Python with torch and
    Triton costs seconds: more than most compiles)."""

    proc: subprocess.Popen | None = None

    @classmethod
    def compile(cls, job: list) -> dict:
        if cls.proc is None or cls.proc.poll() is not None:
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            cls.proc = subprocess.Popen(
                [sys.executable, "-c", "from kestrel.compiler.codegen import _compile_main; _compile_main()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        cls.proc.stdin.write(json.dumps(job) + "\n")
        cls.proc.stdin.flush()
        while True:  # (skipping anything else the compiler may print)
            line = cls.proc.stdout.readline()
            if not line:
                cls.proc = None
                raise RuntimeError(f"AOT compile of {job[0]} for cc {job[5]}: the compile process died")
            if line.startswith(_REPLY):
                return json.loads(line[len(_REPLY):])


def _compile_in_subprocess(kernel_id, jit, types, consts, num_warps, cc, aligned, fp_fusion) -> CompiledKernel:
    d = _CompileServer.compile([kernel_id, jit, types, consts, num_warps, cc, aligned, fp_fusion])
    if "error" in d:
        raise RuntimeError(f"AOT compile of {kernel_id} for cc {cc} failed:\n{d['error'][-3000:]}")
    d["cubin"] = base64.b64decode(d["cubin"])
    d["params"] = [tuple(p) for p in d["params"]]
    return CompiledKernel(**d)


def _compile_main() -> None:
    """The compile server's loop: a job a line in, its CompiledKernel (or the error) a line out."""
    for line in sys.stdin:
        try:
            k = compile_kernel(*json.loads(line))
            d = dataclasses.asdict(k)
            d["cubin"] = base64.b64encode(k.cubin).decode()
        except Exception:
            d = {"error": traceback.format_exc()}
        sys.stdout.write(_REPLY + json.dumps(d) + "\n")
        sys.stdout.flush()


def _table_entry(k: CompiledKernel, part: str, consts: dict, fp_fusion: bool = True) -> dict:
    return {**({} if fp_fusion else {"fp_fusion": False}), "id": k.kernel_id, "jit": k.jit, "part": part,
            "name": k.name, "params": [list(p) for p in k.params],
            "num_warps": k.num_warps, "block": 32 * k.num_warps, "shared": k.shared,
            "global_scratch_size": k.global_scratch_size, "global_scratch_align": k.global_scratch_align,
            "profile_scratch_size": k.profile_scratch_size, "arch": k.arch, "compiler": k.compiler,
            "constexprs": consts}


def compile_kernels(programs: list[Program], target: str, log) -> tuple[list[dict], list[list[int]], dict[str, bytes]]:
    """AOT-compile every distinct kernel configuration the programs launch (the one-token step and the
    M-row step share one table), for ``target``. Returns the kernel table, each program's launches'
    indices into it, and the cubin parts.

    The late variants: a kernel of the first program (the one-token step) that lets the next kernel launch at
    its start (``PDL_LATE`` false: kernels/pdl.py) is compiled a second time with the trigger after its K loop,
    and its table entry names that one (``"late"``: its index). The runtime times the step's programmatic graph
    with either at load and keeps the faster (runtime/gpu.py): which one wins depends on the plan, not on a
    rule of size this compiler could apply (H200, bench/results/stop37 calls 4-5: the trigger after the loop from
    1 MiB of weight made 2B-9B q4 2-7% faster and 0.8B, 27B q4 and 80B-A3B 2-14% slower). A matvec late by its
    bytes (``PDL_LATE`` true; q4 only with ``pdl_early_q4_only``) that comes right before an op of the matvec rule's
    ``pdl_early_before`` kinds triggers at its start instead (its late variant is then its launch rule's own form):
    on the H200 the 27B q4 step 5.078 -> 5.004 ms/token with its in_proj and attention projections so
    (bench/results/stop38 call 10); bf16 ones too only when asked (27B, 9B, 4B bf16 0.2-1% faster so, 2B 2.4% slower:
    bench/results/stop39 calls 1, 5). A q4 matvec of the one-token step right after an op of the rule's
    ``q4_preload_after`` kinds (few programs: moe_down_add, gdn_norm, attn_step), of at least ``q4_preload_min_bytes``,
    loads its first weight tile before its PDL wait (``PRELOAD``, which the launch rule gives only floating-point
    matrices): its programs become resident while that op runs on few SMs (H200, bench/results/stop42 calls 2-4:
    80B-A3B q4 1.760 -> 1.728 ms/token, 2B 0.748 -> 0.731, 4B 1.414 -> 1.402, 27B 4.997 -> 4.981).

    In a plan with routed experts (a ``moe_topk``) every entry carries the moe rule's ``carveout``, the shared-memory
    carveout the runtime asks the driver to prefer for it (runtime/cuda.py; the rule's provenance: 80B-A3B q4 -2.9%,
    the dense plans slower)."""
    cc = TARGETS[target].cc
    table, index, of_launch, cubins = [], {}, [], {}

    def entry(op, consts) -> int:
        key = (op.launch["kernel"], json.dumps(consts, sort_keys=True), op.launch["num_warps"],
               tuple(param_types(op)), tuple(pointer_alignment(op)), op.launch.get("fp_fusion", True))
        if key not in index:
            k = compile_op(op, cc, consts)
            part = f"__kestrel__/cubin/{len(table):03d}"
            cubins[part] = k.cubin
            index[key] = len(table)
            table.append(_table_entry(k, part, consts, key[-1]))
        return index[key]

    rule = TARGETS[target].rules["matvec"]
    for n, program in enumerate(programs):
        of_launch.append([])
        ops = [op for op in program.ops if not is_view(op)]
        for j, op in enumerate(ops):
            consts = op_constexprs(op, cc)
            if (n == 0 and consts.get("PDL_LATE") and (consts.get("GROUP") or not rule.pdl_early_q4_only)
                    and j + 1 < len(ops) and ops[j + 1].kind in rule.pdl_early_before):
                consts = consts | {"PDL_LATE": False}  # (the rule's pdl_early_before)
            if (n == 0 and consts.get("GROUP") and consts.get("PRELOAD") is False and j > 0
                    and ops[j - 1].kind in rule.q4_preload_after
                    and consts["N"] * consts["K"] // 2 >= rule.q4_preload_min_bytes):
                consts = consts | {"PRELOAD": True}  # (the rule's q4_preload_after)
            i = entry(op, consts)
            if n == 0 and consts.get("PDL") and consts.get("PDL_LATE") is False:
                table[i]["late"] = entry(op, consts | {"PDL_LATE": True})
            of_launch[-1].append(i)
    carveout = TARGETS[target].rules["moe"].carveout
    if carveout >= 0 and any(op.kind == "moe_topk" for program in programs for op in program.ops):
        for k in table:  # (the moe rule's carveout: a plan with routed experts)
            k["carveout"] = carveout
    late = sum("late" in k for k in table)
    log(f"kernels: compiled {len(table)} distinct kernels for {target} ({table[0]['arch'] if table else '-'}, "
        f"{table[0]['compiler'] if table else '-'}) for {' + '.join(str(len(o)) for o in of_launch)} launches"
        + (f" ({late} with a late-trigger variant)" if late else ""))
    return table, of_launch, cubins


def probe_kernels(kernels: list[dict], cubins: dict, target: str) -> dict:
    """The measuring kernels ``kestrel-run --bench`` / ``--profile`` launch besides the step (today the
    read-only bandwidth stream of kernels/bandwidth.py), compiled into the kernel table: name ->
    {kernel_index, programs_per_sm, block}."""
    k = compile_kernel("read_stream", bandwidth.read_stream_kernel, bandwidth.READ_TYPES,
                       {"BLOCK": bandwidth.READ_BLOCK}, bandwidth.READ_WARPS, TARGETS[target].cc,
                       bandwidth.READ_ALIGNED)
    part = f"__kestrel__/cubin/{len(kernels):03d}"
    cubins[part] = k.cubin
    kernels.append(_table_entry(k, part, {"BLOCK": bandwidth.READ_BLOCK}))
    return {"read_stream": {"kernel_index": len(kernels) - 1, "programs_per_sm": bandwidth.READ_PROGRAMS_PER_SM,
                            "block": bandwidth.READ_BLOCK}}


def fill_launches(kernels: list[dict], cubins: dict, target: str, weights_bytes: int, seed: int,
                  q4_weights: list[tuple[int, int, int, int]]) -> list[dict]:
    """The random-weights fill (``--weights random``) as launches the runtime makes once at load: the
    fill kernel compiled into the kernel table, and one launch per run of kernels/fill.py's fill_runs
    (the region chunk by chunk, then each q4 weight's scales), with its seed, mask and bits computed
    here, so the runtime needs nothing but the plan."""
    block = fill.FILL_BLOCK
    k = compile_kernel("fill_random", fill.fill_random_kernel, fill.FILL_TYPES, {"BLOCK": block}, 4,
                       TARGETS[target].cc)
    part = f"__kestrel__/cubin/{len(kernels):03d}"
    cubins[part] = k.cubin
    kernels.append(_table_entry(k, part, {"BLOCK": block}))
    return [{"op": "fill_random", "kernel": k.kernel_id, "kernel_index": len(kernels) - 1,
             "grid": [-(-n // block), 1, 1], "args": [{"region": "weights", "offset": 4 * lo}],
             "scalars": [s, n, fill.as_i32(mask), fill.as_i32(bits)]}
            for lo, n, s, mask, bits in fill.fill_runs(weights_bytes // 4, seed, q4_weights)]
