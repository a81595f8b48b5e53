"""On the GPU: every kernel the real-shape sm_90 programs select, against its torch reference, and
the bandwidth of the hot ones as a fraction of the copy bandwidth measured in the same run.

Inputs come from bench/prepare_kernels.py (cubins compiled on a machine with no GPU). Kernels are
launched from their cubins through kestrel.runtime.cuda (cuda.bindings); torch is used here only
to make test buffers and run the references on the GPU. Timing: each kernel is captured in a CUDA
graph of many launches rotating over copies of its large operands (more bytes than the 50 MB L2),
the graph is replayed several times, and the median time per launch is reported.

    python bench/device_kernels.py bench/cubins $OUT/kernels.json
    (ONLY_SHAPE=qwen3.5-27b, ONLY_OP=attn_step, POS=1000: a subset / the position the kernels see)
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import torch

from kestrel.compiler.ir import SCRATCH_PREFIX, Dyn, State, Weight, is_q4, q4_group
from kestrel.compiler.ir_text import parse_program
from kestrel.compiler.ops import OPS, scalar_attrs
from kestrel.kernels.matvec import q4_pack, q4_unpack
from kestrel.runtime import cuda as kc

from graph_timing import launch_times_us  # bench/, next to this script

TD = {"f32": torch.float32, "bf16": torch.bfloat16, "i32": torch.int32}
DYN = {"pos": int(os.environ.get("POS", 1000)), "token": int(os.environ.get("TOKEN", 1234)), "sampled": 0, "temperature": 0.0, "top_p": 1.0, "seed": 1, "n_prompt": 3}
TIMED = ("matmul", "matmul_swiglu", "gdn_delta", "gdn_norm", "attn_step", "embedding", "add_rmsnorm", "sample",
         "matmul_add", "rmsnorm_matmul", "rmsnorm_matmul_swiglu")
L2_BYTES = 50 << 20


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return 2 * a.numel() / statistics.median(times)


def make(x, gen):
    """(kernel tensor, reference tensor or number) for one operand."""
    if isinstance(x, Dyn):
        v = DYN[x.name]
        return torch.tensor([v], dtype=TD[x.dtype], device="cuda"), v
    shape, dtype = x.type.shape, x.type.dtype
    name = getattr(x, "name", "") or ""
    if isinstance(x, Weight) and is_q4(dtype):
        w = torch.randn(shape, generator=gen, device="cuda") / math.sqrt(shape[1])
        buf = q4_pack(w, q4_group(dtype))
        return buf, q4_unpack(buf, *shape, q4_group(dtype))
    if name.startswith(SCRATCH_PREFIX):  # attention partials / tickets: zero, as the runtime leaves them
        t = torch.zeros(shape, dtype=TD[dtype], device="cuda")
        return t, t.clone()
    if name.endswith("A_log"):
        t = torch.rand(shape, generator=gen, device="cuda").mul(15).add(1).log()
    elif name.endswith("dt_bias") or "conv" in name:
        t = 0.5 * torch.randn(shape, generator=gen, device="cuda")
    elif name.endswith("recurrent_state"):
        t = 0.1 * torch.randn(shape, generator=gen, device="cuda")
    elif isinstance(x, Weight) and len(shape) == 2 and "embed" not in name:
        t = torch.randn(shape, generator=gen, device="cuda") / math.sqrt(shape[1])
    elif isinstance(x, Weight) and len(shape) == 1:
        t = 0.1 * torch.randn(shape, generator=gen, device="cuda")
    else:
        t = torch.randn(shape, generator=gen, device="cuda")
    t = t.to(TD[dtype]).contiguous()
    return t, t.clone()


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def bytes_moved(op, tensors) -> int:
    """Bytes the kernel must move: every operand read once, results written, states read + written;
    for attention only the cache rows 0..pos."""
    total = 0
    for x, t in zip(op.ins + op.outs, tensors):
        if isinstance(x, Dyn):
            continue
        n = nbytes(t)
        if isinstance(x, State) and x.name.endswith(("k_cache", "v_cache")):
            n = n * (DYN["pos"] + 1) // x.type.shape[0]
        elif isinstance(x, State):
            n *= 2
        total += n
    if op.kind == "embedding":
        total = 2 * nbytes(tensors[-1])  # one row read, one written
    return total


def check_one(entry, op, kern) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(entry["op_index"])
    made = [make(x, gen) for x in op.ins + op.outs]
    if op.kind in ("rmsnorm_matmul", "rmsnorm_matmul_swiglu"):  # the partials are those of the input s
        s, ss = made[0][1], made[1][0]
        ss.copy_((s.float() ** 2).reshape(ss.numel(), -1).sum(dim=1))  # (partial_rows divides the rows)
        made[1] = (ss, ss.clone())
    ktens = [m[0] for m in made]
    refs = [m[1] for m in made]
    ref_out = OPS[op.kind].reference(*refs[:len(op.ins)], **op.attrs)
    ref_outs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    types = [p[1] for p in entry["params"]]
    scalars = scalar_attrs(op)
    args = kc.PackedArgs(types, [t.data_ptr() for t in ktens] + scalars)
    stream = torch.cuda.current_stream().cuda_stream
    kc.launch(kern, entry["grid"], args, stream)
    torch.cuda.synchronize()
    errs = {}
    n_in = len(op.ins)
    if OPS[op.kind].writes_dyn:  # sample, step_end: their results are dyn slots
        for o, t, r in zip(op.outs, ktens[n_in:], ref_outs):
            errs[o.name] = float(int(t.item()) != int(r))
    else:
        for i, (o, r) in enumerate(zip(op.outs, ref_outs)):
            got = ktens[n_in + i].float()
            errs[f"out{i}"] = ((got - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
        for j in OPS[op.kind].inout:  # states updated in place (scratch: only the tickets' reset)
            if op.ins[j].name.startswith(SCRATCH_PREFIX):
                if op.ins[j].type.dtype == "i32":
                    errs["tickets_reset"] = float(bool(ktens[j].any()))
                continue
            r, got = refs[j].float(), ktens[j].float()
            errs[op.ins[j].name.split(".")[-1]] = ((got - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
    res = {"max_rel_err": max(errs.values()) if errs else 0.0, "errors": errs}
    if op.kind == "sample":  # seeded top-p sampling: agreement with the reference over many seeds
        agree = 0
        for seed in range(32):
            want = OPS["sample"].reference(refs[0], 0.8, 0.9, seed, DYN["pos"])
            ktens[1].fill_(0.8), ktens[2].fill_(0.9), ktens[3].fill_(seed)
            kc.launch(kern, entry["grid"], args, stream)
            torch.cuda.synchronize()
            agree += int(ktens[5].item()) == want
        res["top_p_sampling_agreement"] = agree / 32
    if op.kind in TIMED:
        res.update(time_one(entry, op, kern, ktens, types, scalars))
    return res


def time_one(entry, op, kern, ktens, types, scalars) -> dict:
    moved = bytes_moved(op, ktens)
    copies = max(1, min(32, math.ceil(4 * L2_BYTES / max(moved, 1))))
    big = [i for i, t in enumerate(ktens) if nbytes(t) >= 1 << 16]
    sets = [ktens] + [[t.clone() if i in big else t for i, t in enumerate(ktens)] for _ in range(copies - 1)]
    packed = [kc.PackedArgs(types, [t.data_ptr() for t in s] + scalars) for s in sets]
    times = launch_times_us(kern, entry["grid"], packed, replays=12)
    us = statistics.median(times)
    return {"us": us, "us_min": min(times), "bytes": moved, "GBps": moved / us / 1e3, "copies": copies}


def main(cubin_dir: str, out_path: str):
    torch.zeros(1, device="cuda")
    dev, _ = kc.init(0)
    bw = copy_bandwidth()
    index = json.load(open(os.path.join(cubin_dir, "index.json")))
    programs = {}
    kernels = {}
    rows = []
    only = os.environ.get("ONLY_SHAPE")
    only_op = os.environ.get("ONLY_OP")
    for e in index:
        if (only and e["shape"] != only) or (only_op and e["op"] not in only_op.split(",")):
            continue
        prog = programs.get(e["program"]) or programs.setdefault(
            e["program"], parse_program(open(os.path.join(cubin_dir, e["program"])).read()))
        op = prog.ops[e["op_index"]]
        if e["cubin"] not in kernels:
            kernels[e["cubin"]] = kc.Kernel(open(os.path.join(cubin_dir, e["cubin"]), "rb").read(), e["name"],
                                            e["num_warps"], e["shared"])
        t0 = time.time()
        try:
            r = check_one(e, op, kernels[e["cubin"]])
        except Exception as ex:  # report and go on: one broken kernel must not hide the others
            r = {"error": f"{type(ex).__name__}: {ex}"}
        r.update(shape=e["shape"], quant=e["quant"], kernel=e["kernel"], op=e["op"], grid=e["grid"],
                 constexprs=e["constexprs"], wall_s=round(time.time() - t0, 2))
        if "GBps" in r:
            r["bw_fraction"] = r["GBps"] * 1e9 / bw
        rows.append(r)
        print(json.dumps(r), flush=True)
    report = {"device": torch.cuda.get_device_name(), "cc": kc.compute_capability(dev),
              "copy_bandwidth_GBps": bw / 1e9, "torch": torch.__version__, "kernels": rows,
              "method": "median over 12 replays of a CUDA graph of >= 64 launches rotating over copies of the "
                        "large operands (>= 4x the 50 MB L2); bytes = operands read once + results written "
                        "+ states read and written (attention: cache rows 0..pos, pos=1000)"}
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\ncopy bandwidth {bw / 1e9:.0f} GB/s on {report['device']}")
    print(f"{'shape':14} {'quant':5} {'kernel':22} {'N/K or shape':28} {'err':>9} {'us':>8} {'GB/s':>7} {'frac':>6}")
    for r in rows:
        cx = r["constexprs"]
        dims = ",".join(f"{k}={cx[k]}" for k in ("N", "K", "HV", "NH", "S", "V", "H") if k in cx)
        if "error" in r:
            print(f"{r['shape']:14} {r['quant']:5} {r['kernel']:22} {dims:28} ERROR {r['error'][:60]}")
            continue
        t = f"{r['us']:8.2f} {r['GBps']:7.0f} {r['bw_fraction']:6.1%}" if "us" in r else ""
        print(f"{r['shape']:14} {r['quant']:5} {r['kernel']:22} {dims:28} {r['max_rel_err']:9.2e} {t}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
