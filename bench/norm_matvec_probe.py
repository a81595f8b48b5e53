"""The normed q4 matvec (kernels/matvec.py rmsnorm_matvec_kernel) at the 27B q4 step's shapes, where the step's
profile puts it at 64% of the read bandwidth against matvec_add's 89% (bench/results/stop35 call 6: 63 launches,
992 us in the graph): the launch rule's split (the many-rows regime: 16 rows x 512 inputs, one warp) against other
splits, and the plain matvec_kernel at the same splits (what the norm costs), each checked against
rmsnorm_matvec_ref on the device and timed chained with programmatic edges over weight copies larger than L2.

Here:            python bench/norm_matvec_probe.py compile bench/norm-matvec-probe
On the device:   cd bench && python3 norm_matvec_probe.py time norm-matvec-probe $OUT/norm-matvec.json
(NMP_MODEL=80b, both here and there: Qwen3-Next-80B-A3B's shapes at hidden 2048 and a wider sweep of splits;
NMP_MODEL=swiglu: the normed gate / up pair, rmsnorm_matvec_swiglu_kernel, at the 0.8B, 2B, 4B and 9B q4 MLPs (27B
runs it on q4_stream), where stop 40's profiles put the 2B pair at 9.1 us a launch in the graph for 12.6 MB;
NMP_MODEL=small: matvec_add_kernel at the 0.8B-9B output projections and down projections, rmsnorm_matvec_kernel
at their GDN in_proj, where the q4 rules were read off other shapes)
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys

GROUP, EPS = 128, 1e-6
if os.environ.get("NMP_MODEL") == "80b":  # (stop 38) Qwen3-Next-80B-A3B's hidden 2048: the GDN in_proj, attention
    # q|gate|k|v, the out_proj (matvec_add's shape; the plain matvec times it); P: moe_down_add's programs
    SHAPES = {"in_proj": (12352, 2048), "attn_qkv": (9216, 2048), "out_proj": (2048, 4096)}
    P = 128
    SPLITS = [(bn, bk, nw) for bn in (2, 4, 8, 16, 32) for bk in (512, 1024, 2048) for nw in (1, 2, 4, 8)
              if 1 <= bn * bk // 256 // nw <= 32]
elif os.environ.get("NMP_MODEL") == "swiglu":  # (stop 40) the gate / up pair [I, H] of each small Qwen3.5 MLP
    SHAPES = {"0.8b": (3584, 1024), "2b": (6144, 2048), "4b": (9216, 2560), "9b": (12288, 4096)}
    P = 256  # (the producer's partials: any count; the probe puts the whole sum in the first)
    SPLITS = [(bn, bk, nw) for bn in (2, 4, 8, 16, 32) for bk in (512, 1024, 2048, 4096) for nw in (1, 2, 4, 8)
              if 1 <= bn * bk // 256 // nw <= 32]
elif os.environ.get("NMP_MODEL") == "small":  # (stop 40) the 0.8B-9B one-row q4 products but the gate / up pair
    SHAPES = {"0.8b_out": (1024, 2048), "2b_out": (2048, 2048), "4b_out": (2560, 4096), "9b_out": (4096, 4096),
              "0.8b_down": (1024, 3584), "2b_down": (2048, 6144), "4b_down": (2560, 9216), "9b_down": (4096, 12288),
              "0.8b_in": (8224, 1024), "2b_in": (8224, 2048), "4b_in": (12352, 2560), "9b_in": (12352, 4096)}
    P = 256
    SPLITS = [(bn, bk, nw) for bn in (2, 4, 8, 16, 32) for bk in (512, 1024, 2048, 4096) for nw in (1, 2, 4, 8)
              if 1 <= bn * bk // 256 // nw <= 16]
else:
    SHAPES = {"in_proj": (16480, 5120), "attn_qkv": (14336, 5120)}  # the 27B GDN in_proj, attention q|gate|k|v
    P = 640  # the producer's partial sums of squares (matvec_add's programs at 5120 rows)
    SPLITS = [(16, 512, 1), (16, 512, 2), (16, 1024, 2), (16, 1024, 4), (8, 1024, 4), (8, 512, 2), (32, 512, 2),
              (32, 1024, 4), (4, 1024, 4)]  # (BLOCK_N, BLOCK_K, warps)


def _rule_split(n: int, k: int, kind: str) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, warps) the sm_90 launch rule gives ``kind`` at [n, k]: rmsnorm_matvec_launch's for the
    normed product (its own many-rows and short-K splits), matvec_launch's for the plain one."""
    from kestrel.kernels.matvec import matvec_launch, rmsnorm_matvec_launch
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    r = (rmsnorm_matvec_launch(n, k, GROUP, P, t, pair=kind == "rmsnorm_matvec_swiglu")
         if kind.startswith("rmsnorm_matvec") else matvec_launch(n, k, GROUP, t))
    return r["constexprs"]["BLOCK_N"], r["constexprs"]["BLOCK_K"], r["num_warps"]


KINDS = ("rmsnorm_matvec_swiglu",) if os.environ.get("NMP_MODEL") == "swiglu" else ("rmsnorm_matvec", "matvec")


def _kinds(shape: str) -> tuple[str, ...]:
    """The kernels timed at a shape: NMP_MODEL=small's by the shape's name (the products with the residual add
    at the output and down projections, the normed one at in_proj), else KINDS."""
    if os.environ.get("NMP_MODEL") == "small":
        return ("rmsnorm_matvec",) if shape.endswith("_in") else ("matvec_add",)
    return KINDS


def _jobs():
    for shape, (n, k) in SHAPES.items():
        for kind in _kinds(shape):
            rule = _rule_split(n, k, kind)
            for bn, bk, nw in SPLITS + ([rule] if rule not in SPLITS else []):
                if bk < 2 * k:  # (up to the whole input in one tile)
                    yield shape, n, k, kind, bn, bk, nw


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels.matvec import (matvec_add_kernel, matvec_kernel, matvec_launch, norm_mode,
                                        rmsnorm_matvec_kernel, rmsnorm_matvec_swiglu_kernel)
    from kestrel.kernels.targets import TARGETS, pow2_at_least

    shape, n, k, kind, bn, bk, nw = job
    pair = kind == "rmsnorm_matvec_swiglu"
    rule = matvec_launch(n, k, GROUP, TARGETS["sm_90"], pair=pair)["constexprs"]  # (its PDL_LATE and PRELOAD)
    consts = rule | {"N": n, "K": k, "GROUP": GROUP, "BLOCK_N": bn, "BLOCK_K": bk}  # (its PDL_LATE, PRELOAD, ...)
    if kind == "matvec":
        fn, types = matvec_kernel, ["*fp32", "*u8", "*fp32"]
    elif kind == "matvec_add":
        fn, types = matvec_add_kernel, ["*fp32", "*u8", "*fp32", "*fp32", "*fp32", "i32"]
    elif pair:
        fn, types = rmsnorm_matvec_swiglu_kernel, ["*fp32", "*fp32", "*fp32", "*u8", "*u8", "*fp32", "fp32"]
        consts |= {"P": P, "BLOCK_P": pow2_at_least(P), "NORM": norm_mode(k, bk, GROUP)}
    else:
        fn, types = rmsnorm_matvec_kernel, ["*fp32", "*fp32", "*fp32", "*u8", "*fp32", "fp32"]
        consts |= {"P": P, "BLOCK_P": pow2_at_least(P), "NORM": norm_mode(k, bk, GROUP)}
    try:
        ck = compile_kernel(f"{kind}_q4g{GROUP}", fn, types, consts, nw, 90, [t.startswith("*") for t in types])
    except Exception as e:  # noqa: BLE001
        return None, f"skip {job}: {type(e).__name__} {str(e)[:200]}"
    return (ck, {"grid": [-(-n // bn), 1, 1]}), None


def _describe(job, ck, launch) -> dict:
    shape, n, k, kind, bn, bk, nw = job
    return {"shape": shape, "N": n, "K": k, "kind": kind, "BLOCK_N": bn, "BLOCK_K": bk, "warps": nw,
            "rule": _rule_split(n, k, kind) == (bn, bk, nw)}


def compile_all(folder: str) -> None:
    from cubin_folder import compile_to_folder

    compile_to_folder(folder, list(_jobs()), _compile, _describe, prefix="m")


def time_all(folder: str, out: str) -> None:
    import torch

    from graph_timing import chain_times_us, rotating_copies
    from kestrel.kernels.matvec import (matvec_add_ref, matvec_ref, q4_pack, q4_unpack, rmsnorm_matvec_ref,
                                        rmsnorm_matvec_swiglu_ref)
    from kestrel.runtime import cuda as kc

    index = json.load(open(os.path.join(folder, "index.json")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    stream = torch.cuda.current_stream().cuda_stream
    rows = []
    for shape, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)
        buf = q4_pack(w, GROUP)
        deq = q4_unpack(buf, n, k, GROUP)
        pair = "rmsnorm_matvec_swiglu" in KINDS  # (the up matrix: a second one, its copies rotating alike)
        up = q4_pack(torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k), GROUP) if pair else buf
        copies = [buf] + [buf.clone() for _ in range(rotating_copies(buf.numel() * (2 if pair else 1)) - 1)]
        ups = [up] + [up.clone() for _ in copies[1:]]
        x = torch.randn(k, generator=gen, device="cuda")
        nw = 0.1 * torch.randn(k, generator=gen, device="cuda")
        ss = torch.zeros(P, device="cuda")
        ss[0] = (x.double() ** 2).sum().float()  # the mean square in one partial, the rest zero
        r = torch.randn(n, generator=gen, device="cuda")
        refs = {"rmsnorm_matvec": rmsnorm_matvec_ref(x, ss, nw, deq, EPS), "matvec": matvec_ref(x, deq),
                "matvec_add": matvec_add_ref(x, deq, r, n)[0]}
        if pair:
            refs["rmsnorm_matvec_swiglu"] = rmsnorm_matvec_swiglu_ref(x, ss, nw, deq, q4_unpack(up, n, k, GROUP), EPS)
        for e in (e for e in index if e["shape"] == shape):
            kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"],
                               e["shared"])
            outs = [torch.full((n,), float("nan"), device="cuda") for _ in copies]
            if e["kind"] == "matvec":
                sets = [kc.PackedArgs(e["params"], [x.data_ptr(), b.data_ptr(), o.data_ptr()])
                        for b, o in zip(copies, outs)]
            elif e["kind"] == "matvec_add":
                sq = torch.zeros(e["grid"][0], device="cuda")
                sets = [kc.PackedArgs(e["params"], [x.data_ptr(), b.data_ptr(), r.data_ptr(), o.data_ptr(),
                                                    sq.data_ptr(), e["BLOCK_N"]]) for b, o in zip(copies, outs)]
            elif pair:
                sets = [kc.PackedArgs(e["params"], [x.data_ptr(), ss.data_ptr(), nw.data_ptr(), b.data_ptr(),
                                                    u.data_ptr(), o.data_ptr(), EPS])
                        for b, u, o in zip(copies, ups, outs)]
            else:
                sets = [kc.PackedArgs(e["params"], [x.data_ptr(), ss.data_ptr(), nw.data_ptr(), b.data_ptr(),
                                                    o.data_ptr(), EPS]) for b, o in zip(copies, outs)]
            kc.launch(kernel, e["grid"], sets[0], stream)
            torch.cuda.synchronize()
            ref = refs[e["kind"]]
            err = ((outs[0] - ref).abs().max() / ref.abs().max()).item()
            us = statistics.median(chain_times_us(kernel, e["grid"], sets, replays=7, launches=64))
            gbps = buf.numel() * (2 if pair else 1) / us / 1e3
            rows.append({**e, "us": us, "GBps": gbps, "rel_err": err})
            print(f"{shape:>8} {e['kind']:<15} {e['BLOCK_N']:>3} x {e['BLOCK_K']:>5} {e['warps']} warps "
                  f"{us:8.2f} us {gbps:7.0f} GB/s err {err:.1e}{'  (rule)' if e['rule'] else ''}", flush=True)
    json.dump({"rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
