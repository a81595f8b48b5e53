"""kernels/q4_mma.py (the tensor-core q4 product for 1-16 rows, CUDA C through NVRTC) over its work
splits (RB row blocks x KS warps per CTA, CS CTAs per cluster, DEPTH groups in flight), at the 27B,
0.8B and Qwen3-Next shapes, against the Triton kernels the launch rules pick today in the same call:
the one-row matvec (M = 1), the few-rows matvec (M <= 8), the GEMM (M = 16). Every variant's result
is checked against ``q4_mma_ref`` (float64 on the device); the Triton kernels against theirs.

Here:            python bench/q4mma_sweep.py compile bench/q4mma-sweep        (nvidia-cuda-nvrtc, Triton)
On the device:   cd bench && python3 q4mma_sweep.py time q4mma-sweep $OUT/q4mma-sweep.json
The folder's name picks the sweep: "grouped" (Qwen3-Next's experts), "bf16" (kernels/bf16_mma.py), "pipe"
(the ring and persistence), else the plain splits.
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import sys

GROUP = 128
CASES = [("27b in_proj", 16480, 5120, False), ("27b attn qkv", 14336, 5120, False),
         ("27b out_proj", 5120, 6144, False), ("27b mlp down", 5120, 17408, False),
         ("27b mlp gate+up", 17408, 5120, True), ("0.8b in_proj", 6144, 1024, False),
         ("0.8b mlp gate+up", 3584, 1024, True), ("0.8b mlp down", 1024, 3584, False),
         ("next in_proj_qkvz", 12288, 2048, False), ("next attn out", 2048, 4096, False)]
ROWS = (1, 4, 8, 16)
# Qwen3-Next 80B-A3B's grouped experts: E experts of I x H (gate / up) and H x I (down), M rows x TOPK pairs
NEXT_E, NEXT_I, NEXT_H, NEXT_TOPK = 512, 512, 2048, 10
GROUPED_M = (256, 512)
GROUPED_SPLITS = [(1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]
GROUPED_PIPES = [(2, 0), (4, 0), (2, 2), (2, 3), (2, 4)]  # (DEPTH, STAGES): registers, or the cp.async ring
SPLITS = [(1, 4), (1, 8), (2, 2), (2, 4), (2, 8), (4, 1), (4, 2), (4, 4)]  # (RB, KS)
CLUSTERS = (1, 2, 4)
DEPTHS = (2, 4)
# a folder named "...pipe...": the cp.async ring (STAGES) against the register form (STAGES 0), at the 27B,
# 0.8B and Qwen3-Next projection shapes, M = 1 (against the one-row matvec) and 4 (the verify's rows)
PIPE_CASES = [c for c in CASES if c[0].startswith("27b")] + [CASES[5], CASES[8]]
if "lmhead" in sys.argv[-1]:  # a folder named "...pipe-lmhead...": the 27B lm_head alone (the verify's 4 rows)
    PIPE_CASES = [("27b lm_head", 248320, 5120, False)]
if "san" in sys.argv[-1]:  # "...pipe-san...": a few splits of each form, for compute-sanitizer
    PIPE_CASES = [CASES[4], CASES[2]]
PIPE_ROWS = tuple(int(m) for m in os.environ.get("KESTREL_PIPE_ROWS", "1 4").split())
PIPE_SPLITS = [(1, 8), (2, 4), (4, 2), (4, 4)]
PIPE_STAGES = (0, 3)
PIPE_PERSIST = (0, 1, 2)  # PERSIST: 0 (a cluster per row-block group), or this many CTAs per SM, looping
if "san" in sys.argv[-1]:
    PIPE_SPLITS, PIPE_PERSIST = [(2, 4), (4, 2)], (0, 2)
# KESTREL_CHAINED=1: "us" is each kernel timed in a chain of programmatic edges, as in the step's graph
# (bench/graph_timing.py chain_times_us); "us_plain" the plain graph's
CHAINED = os.environ.get("KESTREL_CHAINED") == "1"


def _pipe_jobs():
    from kestrel.kernels import q4_mma
    from kestrel.kernels.matvec import matvec_launch, matvec_rows_launch
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    for (name, n, k, pair), m in itertools.product(PIPE_CASES, PIPE_ROWS):
        if m == 1:
            yield name, n, k, pair, m, "matvec", matvec_launch(n, k, GROUP, t, pair=pair)
        else:
            yield name, n, k, pair, m, "rows", matvec_rows_launch(m, n, k, GROUP, t, pair=pair)
        for (rb, ks), cs, stages, per_sm in itertools.product(PIPE_SPLITS, CLUSTERS, PIPE_STAGES, PIPE_PERSIST):
            if (q4_mma.fits(m, n, k, GROUP, rb, ks, cs, t, pair, stages, persist=per_sm > 0) is None
                    and k // GROUP // cs >= ks):
                yield name, n, k, pair, m, "mma", q4_mma.launch(m, n, k, GROUP, rb, ks, cs, 2, pair, stages,
                                                                per_sm * t.sms // cs)


def _jobs():
    from kestrel.kernels import q4_mma
    from kestrel.kernels.gemm import gemm_launch
    from kestrel.kernels.matvec import matvec_launch, matvec_rows_launch
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    for (name, n, k, pair), m in itertools.product(CASES, ROWS):
        if m == 16 and not name.startswith("27b"):
            continue
        if m == 1:
            yield name, n, k, pair, m, "matvec", matvec_launch(n, k, GROUP, t, pair=pair)
        elif m <= t.rules["gemm"].few_rows_matvec:
            yield name, n, k, pair, m, "rows", matvec_rows_launch(m, n, k, GROUP, t, pair=pair)
        else:
            yield name, n, k, pair, m, "gemm", gemm_launch(m, n, k, GROUP, t, swiglu=pair)
        for (rb, ks), cs, depth in itertools.product(SPLITS, CLUSTERS, DEPTHS):
            if q4_mma.fits(m, n, k, GROUP, rb, ks, cs, t, pair) is None and k // GROUP // cs >= ks:
                yield name, n, k, pair, m, "mma", q4_mma.launch(m, n, k, GROUP, rb, ks, cs, depth, pair)


def _grouped_jobs():
    from kestrel.kernels import moe, q4_mma
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    for m, gate_up in itertools.product(GROUPED_M, (True, False)):
        pairs = m * NEXT_TOPK
        n, k = (NEXT_I, NEXT_H) if gate_up else (NEXT_H, NEXT_I)
        name = f"next {'gate+up' if gate_up else 'down'} grouped"
        yield name, n, k, gate_up, m, "grouped_triton", moe.moe_grouped_launch(pairs, NEXT_E, n, k, GROUP,
                                                                               moe.GROUPED_CHUNK, t, pair=gate_up)
        chunks = moe.grouped_chunks(pairs, NEXT_E, 16)
        for (rb, ks), (depth, stages) in itertools.product(GROUPED_SPLITS, GROUPED_PIPES):
            if q4_mma.fits(16, n, k, GROUP, rb, ks, 1, t, gate_up, stages) is None and k // GROUP >= ks:
                c = q4_mma.launch(16, n, k, GROUP, rb, ks, 1, depth, gate_up, stages)
                c["grid"][1] = chunks
                c["constexprs"] |= {"GROUPED": 1 if gate_up else 2, "E": NEXT_E, "P": pairs}
                yield name, n, k, gate_up, m, "grouped_mma", c


# a folder named "...bf16...": the bf16 form (kernels/bf16_mma.py, WBF16) at the 27B and 0.8B shapes and the 27B
# lm_head, M = 4 and 8, against the few-rows matvec the rules picked before it and the one-row matvec (M = 1)
BF16_CASES = [c for c in CASES if not c[0].startswith("next")] + [("27b lm_head", 248320, 5120, False)]
BF16_ROWS = tuple(int(m) for m in os.environ.get("KESTREL_BF16_ROWS", "4").split())
BF16_SPLITS = [(1, 8), (2, 4), (4, 2), (4, 4), (8, 2)]
BF16_PIPES = [(2, 0), (4, 0), (2, 3)]  # (DEPTH, STAGES)
BF16_PERSIST = (0, 1, 2)
if os.environ.get("KESTREL_BF16_GRID"):  # another grid: "shape prefix; splits; pipes; persist" (Python literals)
    _pre, _sp, _pp, _pe = os.environ["KESTREL_BF16_GRID"].split(";")
    BF16_CASES = [c for c in BF16_CASES if c[0].startswith(_pre.strip())]
    BF16_SPLITS, BF16_PIPES, BF16_PERSIST = eval(_sp), eval(_pp), eval(_pe)  # noqa: S307 - the bench's own input


def _bf16_jobs():
    from kestrel.kernels import q4_mma
    from kestrel.kernels.matvec import matvec_launch, matvec_rows_launch
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    for name, n, k, pair in BF16_CASES:
        yield name, n, k, pair, 1, "matvec", matvec_launch(n, k, 0, t, pair=pair)
        for m in BF16_ROWS:
            yield name, n, k, pair, m, "rows", matvec_rows_launch(m, n, k, 0, t, pair=pair)
            for (rb, ks), cs, (depth, stages), per_sm in itertools.product(BF16_SPLITS, CLUSTERS, BF16_PIPES,
                                                                           BF16_PERSIST):
                if per_sm and (cs > 1 or stages or n // (16 * rb) <= per_sm * t.sms):
                    continue  # (persistence: registers, no clusters, more row blocks than CTAs)
                if (q4_mma.fits(m, n, k, 32, rb, ks, cs, t, pair, stages, persist=per_sm > 0, bf16=True) is None
                        and k // 32 // cs >= ks):
                    yield name, n, k, pair, m, "mma", q4_mma.launch(m, n, k, 32, rb, ks, cs, depth, pair, stages,
                                                                    per_sm * t.sms, bf16=True)


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels import gemm, matvec, q4_mma

    name, n, k, pair, m, kind, launch = job
    if kind.startswith("grouped"):
        from kestrel.kernels import moe

        jit = {("grouped_triton", True): moe.moe_gate_up_grouped_kernel,
               ("grouped_triton", False): moe.moe_down_grouped_kernel,
               ("grouped_mma", True): q4_mma.q4mma_gate_up_grouped,
               ("grouped_mma", False): q4_mma.q4mma_down_grouped}[kind, pair]
        types = (["*fp32", "*i32", "*i32", "*u8", "*u8", "*fp32", "i32", "i32"] if pair
                 else ["*fp32", "*i32", "*u8", "*fp32", "i32", "i32"])
        try:
            ck = compile_kernel(kind, jit, types, launch["constexprs"], launch["num_warps"], 90, [True] * 6 + [False] * 2)
        except Exception as e:  # noqa: BLE001
            return None, f"skip {name} {kind} {launch['constexprs']}: {type(e).__name__} {str(e)[:300]}"
        return (ck, launch), None
    jit = {("gemm", False): gemm.gemm_kernel, ("gemm", True): gemm.gemm_swiglu_kernel,
           ("matvec", False): matvec.matvec_kernel, ("matvec", True): matvec.matvec_swiglu_kernel,
           ("rows", False): matvec.matvec_rows_kernel, ("rows", True): matvec.matvec_rows_swiglu_kernel,
           ("mma", False): q4_mma.q4mma_rows, ("mma", True): q4_mma.q4mma_rows_swiglu}[kind, pair]
    wt = "*u8"
    if launch["constexprs"].get("WBF16") or launch["constexprs"].get("GROUP") == 0:  # bf16 weights
        from kestrel.kernels import bf16_mma

        wt = "*bf16"
        if kind == "mma":
            jit = bf16_mma.bf16mma_rows_swiglu if pair else bf16_mma.bf16mma_rows
    types = ["*fp32", wt] + ([wt] if pair else []) + ["*fp32"]
    try:
        ck = compile_kernel(kind, jit, types, launch["constexprs"], launch["num_warps"], 90, [True] * len(types))
    except Exception as e:  # noqa: BLE001 - a configuration that does not compile is skipped
        return None, f"skip {name} {kind} {launch['constexprs']}: {type(e).__name__} {str(e)[:300]}"
    return (ck, launch), None


def _describe(job, ck, launch) -> dict:
    name, n, k, pair, m, kind, _ = job
    c = launch["constexprs"]
    return {"shape": name, "M": m, "N": n, "K": k, "pair": pair, "kind": kind,
            "config": {x: c[x] for x in ("RB", "KS", "CS", "DEPTH", "STAGES", "PERSIST", "BLOCK_N", "BLOCK_K", "BLOCK_M")
                       if x in c} | ({"grid": launch["grid"][0]} if c.get("PERSIST") else {})}


def compile_all(folder: str) -> None:
    from cubin_folder import compile_to_folder

    jobs = list(_grouped_jobs() if "grouped" in folder else _bf16_jobs() if "bf16" in folder
                else _pipe_jobs() if "pipe" in folder else _jobs())
    compile_to_folder(folder, jobs, _compile, _describe, prefix="q")


def time_all(folder: str, out: str) -> None:
    import torch

    from graph_timing import chain_times_us, launch_times_us, rotating_copies
    from kestrel.artifacts.errors import DeviceError
    from kestrel.kernels.matvec import matvec_ref, q4_codes, q4_pack, q4_unpack
    from kestrel.runtime import cuda as kc

    rows, operands = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    stream = torch.cuda.current_stream().cuda_stream
    for e in json.load(open(os.path.join(folder, "index.json"))):
        n, k, pair = e["N"], e["K"], e["pair"]
        key = e["shape"]
        if key not in operands:
            operands.clear()
            torch.cuda.empty_cache()
            x = torch.randn(max(ROWS), k, device="cuda", generator=g)
            ws, refs, mma_refs = [], [], []
            xh = (x / 64).half().double()
            for _ in range(2 if pair else 1):
                wf = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
                w = q4_pack(wf, GROUP)
                ws.append(w)
                q, sc = q4_codes(w, n, k, GROUP)
                deq = (q.double().reshape(n, k // GROUP, GROUP) * sc.double()[:, :, None]).reshape(n, k)
                mma_refs.append((xh @ deq.T * 64))
                refs.append(q4_unpack(w, n, k, GROUP))
                del deq
            if pair:
                gt, up = mma_refs
                mma_ref = (gt / (1 + torch.exp(-gt)) * up).float()
                ref = torch.nn.functional.silu(matvec_ref(x[:4], refs[0])) * matvec_ref(x[:4], refs[1])
            else:
                mma_ref = mma_refs[0].float()
                ref = matvec_ref(x[:4], refs[0])
            nbytes = sum(v.numel() for v in ws)
            copies = [[v.clone() for v in ws] for _ in range(rotating_copies(nbytes) - 1)]
            operands[key] = (x, [ws] + copies, mma_ref, ref, nbytes)
        x, wsets, mma_ref, ref, nbytes = operands[key]
        m = e["M"]
        y = torch.full((m, n), float("nan"), device="cuda")
        try:
            kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"],
                               e["shared"])
        except DeviceError:
            continue
        sets = [kc.PackedArgs(e["params"], [x.data_ptr()] + [v.data_ptr() for v in ws] + [y.data_ptr()])
                for ws in wsets]
        try:
            kc.launch(kernel, e["grid"], sets[0], stream)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a launch the device refuses (cluster too large) is reported
            rows.append({**e, "error": str(exc)[:200]})
            print(f"{e['shape']:<20} M={m:<2} {e['kind']:<6} {e['config']} launch failed: {str(exc)[:120]}", flush=True)
            continue
        err = ((y - mma_ref[:m]).abs().max() / mma_ref[:m].abs().max()).item()
        r4 = min(m, 4)
        err_cpu = ((y[:r4] - ref[:r4]).abs().max() / ref[:r4].abs().max()).item()
        reps = (1, 1) if os.environ.get("KESTREL_SWEEP_QUICK") == "1" else (7, 32)  # (under compute-sanitizer)
        us = statistics.median(launch_times_us(kernel, e["grid"], sets, replays=reps[0], launches=reps[1]))
        extra = {}
        if CHAINED:  # as the step graph chains them: programmatic edges (the PDL wait in every kernel)
            extra["us_plain"] = us
            us = statistics.median(chain_times_us(kernel, e["grid"], sets, replays=reps[0], launches=reps[1]))
        rows.append({**e, "us": us, "rel_err_vs_mma_ref": err, "rel_err_vs_matvec_ref": err_cpu,
                     "weight_GBps": nbytes / us / 1e3, **extra})
        print(f"row {e['shape']:<20} M={m:<2} {e['kind']:<6} {json.dumps(e['config'])} {us:8.2f} us "
              f"err {err:.1e} cpu {err_cpu:.1e}", flush=True)
    best = {}
    for r in rows:
        if "us" not in r:
            continue
        key = (r["shape"], r["M"], r["kind"])
        good = r["rel_err_vs_mma_ref"] < 1e-5 if r["kind"] == "mma" else r["rel_err_vs_matvec_ref"] < 2e-2
        if good and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("\nshape                 M   Triton (kind)           mma best (RB KS CS DEPTH STAGES)  speed-up  GB/s")
    for (shape, m, kind), r in sorted(best.items()):
        if kind == "mma":
            continue
        b = best.get((shape, m, "mma"))
        if b is None:
            print(f"{shape:<20} {m:>2}  {r['us']:7.1f} us ({kind})   no valid mma variant")
            continue
        c = b["config"]
        print(f"{shape:<20} {m:>2}  {r['us']:7.1f} us ({kind:<6})   {b['us']:7.1f} us ({c['RB']} {c['KS']} {c['CS']} "
              f"{c['DEPTH']} {c.get('STAGES', 0)})   {r['us'] / b['us']:5.2f}x  {b['weight_GBps']:5.0f}  err {b['rel_err_vs_mma_ref']:.1e} "
              f"/ cpu {b['rel_err_vs_matvec_ref']:.1e}")
    stages = sorted({r["config"].get("STAGES", 0) for r in rows if r["kind"] == "mma"})
    if len(stages) > 1:  # the cp.async ring against the register form: the best split at each STAGES
        print("\nshape                 M   best us at STAGES " + " ".join(f"{s:>7}" for s in stages))
        for shape, m in dict.fromkeys((r["shape"], r["M"]) for r in rows):
            ok = [r for r in rows if (r["shape"], r["M"], r["kind"]) == (shape, m, "mma") and "us" in r
                  and r["rel_err_vs_mma_ref"] < 1e-5]
            cells = [min((r["us"] for r in ok if r["config"].get("STAGES", 0) == s), default=float("nan"))
                     for s in stages]
            print(f"{shape:<20} {m:>2}  {'':17}" + " ".join(f"{c:7.1f}" for c in cells))
    json.dump({"rows": rows}, open(out, "w"), indent=1)


def time_bf16(folder: str, out: str) -> None:
    """The bf16 folder: every variant chained (as the step's graph runs them) against ``bf16_mma_ref`` (the
    tensor-core form) and the fp32 matvec product (every kernel)."""
    import torch

    from graph_timing import chain_times_us, rotating_copies
    from kestrel.runtime import cuda as kc

    rows, operands = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    stream = torch.cuda.current_stream().cuda_stream
    for e in json.load(open(os.path.join(folder, "index.json"))):
        n, k, pair, m = e["N"], e["K"], e["pair"], e["M"]
        if e["shape"] not in operands:
            operands.clear()
            torch.cuda.empty_cache()
            x = torch.randn(16, k, device="cuda", generator=g)
            hi = x.bfloat16()
            xs = (hi.double() + (x - hi.float()).bfloat16().double(), x.double())
            ws = [(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16() for _ in range(2 if pair else 1)]
            refs = []
            for xx in xs:  # the tensor-core form's product, then the fp32 one
                ys = [(xx @ w.double().T) for w in ws]
                refs.append((ys[0] / (1 + torch.exp(-ys[0])) * ys[1] if pair else ys[0]).float())
                del ys
            nbytes = sum(w.numel() * 2 for w in ws)
            copies = [[w.clone() for w in ws] for _ in range(rotating_copies(nbytes) - 1)]
            operands[e["shape"]] = (x, [ws] + copies, refs, nbytes)
        x, wsets, (mma_ref, ref), nbytes = operands[e["shape"]]
        y = torch.full((m, n), float("nan"), device="cuda")
        kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"], e["shared"])
        sets = [kc.PackedArgs(e["params"], [x.data_ptr()] + [w.data_ptr() for w in ws] + [y.data_ptr()]) for ws in wsets]
        try:
            kc.launch(kernel, e["grid"], sets[0], stream)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a launch the device refuses is reported
            rows.append({**e, "error": str(exc)[:200]})
            print(f"{e['shape']:<20} M={m:<2} {e['kind']:<6} {e['config']} launch failed: {str(exc)[:120]}", flush=True)
            continue
        err = ((y - mma_ref[:m]).abs().max() / mma_ref[:m].abs().max()).item()
        err_f32 = ((y - ref[:m]).abs().max() / ref[:m].abs().max()).item()
        reps = (1, 1) if os.environ.get("KESTREL_SWEEP_QUICK") == "1" else (7, 32)
        us = statistics.median(chain_times_us(kernel, e["grid"], sets, replays=reps[0], launches=reps[1]))
        rows.append({**e, "us": us, "rel_err_vs_mma_ref": err, "rel_err_vs_fp32": err_f32, "weight_GBps": nbytes / us / 1e3,
                     "chained": True})
        print(f"row {e['shape']:<20} M={m:<2} {e['kind']:<6} {json.dumps(e['config'])} {us:8.2f} us "
              f"err {err:.1e} fp32 {err_f32:.1e}", flush=True)
    print("\nshape                 M=1 matvec  M  few-rows matvec   mma best (RB KS CS DEPTH STAGES PERSIST)  vs rows  vs M=1")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        one = next((r["us"] for r in rows if r["shape"] == shape and r["kind"] == "matvec" and "us" in r), float("nan"))
        for m in BF16_ROWS:
            tri = next((r for r in rows if (r["shape"], r["M"], r["kind"]) == (shape, m, "rows") and "us" in r), None)
            ok = [r for r in rows if (r["shape"], r["M"], r["kind"]) == (shape, m, "mma") and "us" in r
                  and r["rel_err_vs_mma_ref"] < 1e-5]
            if tri is None or not ok:
                print(f"{shape:<20} {m:>2}  no valid variant")
                continue
            b = min(ok, key=lambda r: r["us"])
            c = b["config"]
            print(f"{shape:<20} {one:8.1f} us  {m:>2} {tri['us']:8.1f} us      {b['us']:8.1f} us ({c['RB']} {c['KS']} {c['CS']} "
                  f"{c['DEPTH']} {c.get('STAGES', 0)} {c.get('PERSIST', 0)})  {tri['us'] / b['us']:5.2f}x  "
                  f"{b['us'] / one:5.2f}x  err {b['rel_err_vs_fp32']:.1e}")
    json.dump({"rows": rows}, open(out, "w"), indent=1)


def time_grouped(folder: str, out: str) -> None:
    """The grouped experts (folder compiled from a name containing "grouped"): a random routing of M rows
    (NEXT_TOPK distinct experts each), sorted and chunked by moe_group_ref (16 pairs a chunk for the
    tensor-core kernel, 4 for the Triton one); every result row against q4_mma_ref of its expert."""
    import torch

    from graph_timing import chain_times_us, launch_times_us, rotating_copies
    from kestrel.kernels import moe, q4_mma
    from kestrel.kernels.matvec import q4_codes, q4_pack
    from kestrel.runtime import cuda as kc

    g = torch.Generator(device="cuda").manual_seed(0)
    cg = torch.Generator().manual_seed(0)
    stream = torch.cuda.current_stream().cuda_stream
    rows, data = [], {}
    for e in json.load(open(os.path.join(folder, "index.json"))):
        m, pair, n, k = e["M"], e["pair"], e["N"], e["K"]
        pairs = m * NEXT_TOPK
        if (m, pair) not in data:
            data.clear()
            torch.cuda.empty_cache()
            ids = torch.stack([torch.randperm(NEXT_E, generator=cg)[:NEXT_TOPK] for _ in range(m)]).int()
            tables = {c: [t.cuda() for t in moe.moe_group_ref(ids, NEXT_E, c)] for c in (moe.GROUPED_CHUNK, 16)}
            x = torch.randn(m if pair else pairs, k, device="cuda", generator=g)
            ws = [q4_pack(torch.randn(NEXT_E * n, k, device="cuda", generator=g) / k ** 0.5, GROUP)
                  for _ in range(2 if pair else 1)]
            codes = [q4_codes(w, NEXT_E * n, k, GROUP) for w in ws]
            src, _, chunks = tables[16]
            ref = torch.zeros(pairs, n, device="cuda")
            for ex, first, cnt, _ in chunks.tolist():
                if cnt <= 0:
                    continue
                xr = x[src[first:first + cnt].long()] if pair else x[first:first + cnt]
                part = [(q[ex * n:(ex + 1) * n], sc[ex * n:(ex + 1) * n]) for q, sc in codes]
                ref[first:first + cnt] = (q4_mma.q4_mma_swiglu_ref(xr, *part[0], *part[1], GROUP) if pair
                                          else q4_mma.q4_mma_ref(xr, *part[0], GROUP))
            del codes
            nbytes = sum(w.numel() for w in ws)
            copies = [[w.clone() for w in ws] for _ in range(rotating_copies(nbytes) - 1)]
            data[(m, pair)] = (tables, x, [ws] + copies, ref)
        tables, x, wsets, ref = data[(m, pair)]
        chunk = 16 if e["kind"] == "grouped_mma" else moe.GROUPED_CHUNK
        src, _, chunks = tables[chunk]
        y = torch.full((pairs, n), float("nan"), device="cuda")
        kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"], e["shared"])
        if pair:
            sets = [kc.PackedArgs(e["params"], [x.data_ptr(), src.data_ptr(), chunks.data_ptr(), w[0].data_ptr(),
                                                w[1].data_ptr(), y.data_ptr(), NEXT_E, chunk]) for w in wsets]
        else:
            sets = [kc.PackedArgs(e["params"], [x.data_ptr(), chunks.data_ptr(), w[0].data_ptr(), y.data_ptr(),
                                                NEXT_E, chunk]) for w in wsets]
        kc.launch(kernel, e["grid"], sets[0], stream)
        torch.cuda.synchronize()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        us = statistics.median((chain_times_us if CHAINED else launch_times_us)(kernel, e["grid"], sets, replays=5,
                                                                                 launches=16))
        rows.append({**e, "us": us, "rel_err_vs_mma_ref": err, "chained": CHAINED})
        print(f"{e['shape']:<24} M={m:<4} {e['kind']:<15} {e['config']} {us:9.1f} us  err {err:.1e}", flush=True)
    print("\nbest grouped:")
    for key in dict.fromkeys((r["shape"], r["M"], r["kind"]) for r in rows):
        ok = [r for r in rows if (r["shape"], r["M"], r["kind"]) == key
              and r["rel_err_vs_mma_ref"] < (1e-5 if r["kind"] == "grouped_mma" else 2e-2)]
        if ok:
            b = min(ok, key=lambda r: r["us"])
            print(f"{key[0]:<24} M={key[1]:<4} {key[2]:<15} {b['config']} {b['us']:9.1f} us")
    json.dump({"rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    elif "grouped" in sys.argv[2]:
        time_grouped(sys.argv[2], sys.argv[3])
    elif "bf16" in sys.argv[2]:
        time_bf16(sys.argv[2], sys.argv[3])
    else:
        time_all(sys.argv[2], sys.argv[3])
