"""On the GPU (Triton's JIT there): the decode kernels issue 13 changed, at the real shapes, against
their CPU references, and timed.

  * q4 matvec / matvec_swiglu (kernels/matvec.py, the f16x2 kernel at its launch rule) at the 27B and
    0.8B shapes: error against ``q4_matvec_ref`` (fp16 lanes emulated exactly: only fp32 summation
    order differs), us per launch (median of CUDA-graph replays rotating over weight copies larger
    than L2) and that as a fraction of the read-only bandwidth measured in the same run;
  * sample (kernels/sample.py) at the 248,320-token vocabulary: the token equal to ``sample_ref``'s for
    every seed, per setting (greedy, Qwen's 0.7 / 0.8 / top-k 20, plain temperature, top-p alone,
    min-p), us per launch.

    python3 bench/device_decode_kernels.py OUT.json
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton

from kestrel.kernels.bandwidth import read_stream_kernel
from kestrel.kernels.matvec import (matvec_kernel, matvec_launch, matvec_swiglu_kernel, q4_codes, q4_matvec_ref,
                                    q4_pack)
from kestrel.kernels.sample import sample_kernel, sample_launch, sample_ref, sample_scratch_shape
from kestrel.kernels.targets import TARGETS

T = TARGETS["sm_90"]
DEV = "cuda"


def time_launches(fn, reps=12, per_graph=24):
    """us per launch: median over ``reps`` replays of a CUDA graph of ``per_graph`` launches (fn(r) makes
    launch r), so no host launch latency is inside."""
    for r in range(3):
        fn(r)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            for r in range(per_graph):
                fn(r)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / per_graph)
    return sorted(ts)[len(ts) // 2]


def read_bandwidth() -> float:
    buf = torch.ones(1 << 28, dtype=torch.int32, device=DEV)
    part = torch.zeros(8 * 132, dtype=torch.int32, device=DEV)
    us = time_launches(lambda r: read_stream_kernel[(8 * 132,)](buf, part, buf.numel(), buf.numel() // 4096,
                                                                BLOCK=4096), 5, 4)
    return buf.numel() * 4 / (us * 1e-6)


CHECK_ROWS = 16384  # rows checked against the reference (all of them but the lm_head's)


def q4_ref_rows(buf, n, k, x, group=128, chunk=2048):
    q, scales = q4_codes(buf, n, k, group)
    m = min(n, CHECK_ROWS)
    return torch.cat([q4_matvec_ref(x, q[i:i + chunk], scales[i:i + chunk], group) for i in range(0, m, chunk)])[:m]


Q4_SHAPES = [("27b", "gdn_in_proj", 16480, 5120), ("27b", "mlp_gate_up", 17408, 5120), ("27b", "down", 5120, 17408),
             ("27b", "attn_q", 12288, 5120), ("27b", "o_proj", 5120, 6144), ("27b", "lm_head", 248320, 5120),
             ("0.8b", "mlp_gate_up", 3584, 1024), ("0.8b", "down", 1024, 3584), ("0.8b", "gdn_in_proj", 6144, 1024),
             ("0.8b", "lm_head", 248320, 1024)]


def q4_section(read_bw: float) -> list:
    out = []
    g = torch.Generator(device=DEV).manual_seed(0)
    for model, name, n, k in Q4_SHAPES:  # (quantised and checked on the GPU: the reference in float64 there)
        w = torch.randn(n, k, generator=g, device=DEV) * 0.02
        x = torch.randn(k, generator=g, device=DEV)
        buf = q4_pack(w, 128)
        del w
        want = q4_ref_rows(buf, n, k, x)
        copies = max(2, -(-150_000_000 // buf.numel()))
        bufs = [buf] + [None] * (copies - 1)
        for i in range(1, copies):
            bufs[i] = bufs[0].clone()
        xd, y = x, torch.empty(n, device=DEV)
        L = matvec_launch(n, k, 128, T)
        grid, c, nw = tuple(L["grid"]), L["constexprs"], L["num_warps"]
        matvec_kernel[grid](xd, bufs[0], y, num_warps=nw, **c)
        m = want.numel()
        err = ((y[:m] - want).abs().max() / want.abs().max()).item()
        us = time_launches(lambda r: matvec_kernel[grid](xd, bufs[r % copies], y, num_warps=nw, **c))
        nbytes = buf.numel() + 4 * k
        row = {"model": model, "matrix": name, "N": n, "K": k, "launch": L, "rel_err_vs_ref": err, "us": us,
               "bytes": nbytes, "fraction_of_read": nbytes / (us * 1e-6) / read_bw}
        if name == "mlp_gate_up":  # the swiglu kernel: gate and up, both q4, one launch
            wu = q4_pack(torch.randn(n, k, generator=g, device=DEV) * 0.02, 128)
            gate, up = want, q4_ref_rows(wu, n, k, x)
            ref = gate * torch.sigmoid(gate) * up
            wud = wu
            nw = matvec_launch(n, k, 128, T, pair=True)["num_warps"]  # (the pair's warps)
            matvec_swiglu_kernel[grid](xd, bufs[0], wud, y, num_warps=nw, **c)
            row["swiglu_rel_err_vs_ref"] = ((y[:m] - ref).abs().max() / ref.abs().max()).item()
            ups = [wud] + [wud.clone() for _ in range(copies - 1)]
            us2 = time_launches(lambda r: matvec_swiglu_kernel[grid](xd, bufs[r % copies], ups[r % copies], y,
                                                                     num_warps=nw, **c))
            row.update(swiglu_us=us2, swiglu_fraction_of_read=2 * nbytes / (us2 * 1e-6) / read_bw)
            del ups, wud
        out.append(row)
        print(f"q4 {model:5} {name:12} {n:6}x{k:<6} err {err:.1e}  {us:7.1f} us  {row['fraction_of_read']:6.1%}"
              + (f"  swiglu {row['swiglu_us']:.1f} us {row['swiglu_fraction_of_read']:.1%} err "
                 f"{row['swiglu_rel_err_vs_ref']:.1e}" if "swiglu_us" in row else ""), flush=True)
        del bufs
        torch.cuda.empty_cache()
    return out


SETTINGS = [("greedy", 0.0, 1.0, 0, 0.0), ("qwen 0.7/0.8/k20", 0.7, 0.8, 20, 0.0), ("temperature 1.0", 1.0, 1.0, 0, 0.0),
            ("top-p 0.9", 0.8, 0.9, 0, 0.0), ("top-p 0.95 T1", 1.0, 0.95, 0, 0.0), ("min-p 0.05", 1.0, 1.0, 0, 0.05),
            ("top-k 50", 1.0, 1.0, 50, 0.0), ("top-k 50 + min-p 0.1", 1.0, 1.0, 50, 0.1)]


def sample_section(seeds: int = 48, cand: int = 0) -> list:
    """``cand``: the rule's CAND replaced (SAMPLE_CANDS=32,64 runs the settings once per value)."""
    import dataclasses
    from types import MappingProxyType

    v = 248320
    t2 = T if not cand else dataclasses.replace(T, rules=MappingProxyType(
        {**T.rules, "sample": dataclasses.replace(T.rules["sample"], cand=cand)}))
    L = sample_launch(v, t2)
    grid, c, nw = tuple(L["grid"]), L["constexprs"], L["num_warps"]
    partials = torch.zeros(sample_scratch_shape(v, t2), dtype=torch.float32, device=DEV)
    ticket = torch.zeros(1, dtype=torch.int32, device=DEV)
    out = []
    g = torch.Generator().manual_seed(1)
    dists = {"random": torch.randn(v, generator=g) * 3,  # flat: large nuclei
             "peaked": torch.randn(v, generator=g) * 3 + torch.where(torch.rand(v, generator=g) < 1e-3, 12.0, 0.0)}
    for dname, logits in dists.items():
        ld = logits.to(DEV)
        for name, t, p, k, mp in SETTINGS:
            args = [torch.tensor([t], dtype=torch.float32, device=DEV), torch.tensor([p], dtype=torch.float32, device=DEV),
                    torch.tensor([k], dtype=torch.int32, device=DEV), torch.tensor([mp], dtype=torch.float32, device=DEV)]
            seed_t, pos_t = torch.zeros(1, dtype=torch.int32, device=DEV), torch.zeros(1, dtype=torch.int32, device=DEV)
            out_t = torch.zeros(1, dtype=torch.int32, device=DEV)
            agree = 0
            n_seeds = 1 if t == 0 else seeds
            for s in range(n_seeds):
                seed_t.fill_(s)
                pos_t.fill_(7 * s + 3)
                sample_kernel[grid](ld, *args, seed_t, pos_t, partials, ticket, out_t, num_warps=nw, **c)
                agree += int(out_t.item()) == sample_ref(logits, t, p, k, mp, s, 7 * s + 3)
            us = time_launches(lambda r: sample_kernel[grid](ld, *args, seed_t, pos_t, partials, ticket, out_t,
                                                            num_warps=nw, **c))
            path = int(partials[0, 5].view(torch.int32).item())  # the merge's path (sample_kernel)
            row = {"distribution": dname, "setting": name, "temperature": t, "top_p": p, "top_k": k, "min_p": mp,
                   "cand": c["CAND"], "seeds": n_seeds, "equal_to_reference": agree, "us": us, "path": path,
                   "ticket_after": int(ticket.item())}
            out.append(row)
            print(f"sample {dname:6} {name:22} cand {c['CAND']} equal {agree}/{n_seeds}  {us:7.1f} us  path {path}  "
                  f"ticket {row['ticket_after']}", flush=True)
    return out


def sample_sweep(seeds: int = 8) -> list:
    """The sample rule's (tile, cand, num_warps) around its pick, at Qwen's 0.7 / 0.8 / top-k 20 and
    greedy over the flat logits: equality with sample_ref for ``seeds`` seeds, us per launch."""
    import dataclasses
    from types import MappingProxyType

    v = 248320
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(v, generator=g) * 3
    ld = logits.to(DEV)
    out = []
    for tile in (2048, 4096, 8192, 16384):
        for cand in (32, 64):
            for nw in (4, 8, 16):
                rule = dataclasses.replace(T.rules["sample"], tile=tile, cand=cand, num_warps=nw)
                t2 = dataclasses.replace(T, rules=MappingProxyType({**T.rules, "sample": rule}))
                L = sample_launch(v, t2)
                grid, c = tuple(L["grid"]), L["constexprs"]
                partials = torch.zeros(sample_scratch_shape(v, t2), dtype=torch.float32, device=DEV)
                ticket = torch.zeros(1, dtype=torch.int32, device=DEV)
                for name, t, p, k in (("qwen", 0.7, 0.8, 20), ("greedy", 0.0, 1.0, 0)):
                    args = [torch.tensor([t], device=DEV), torch.tensor([p], device=DEV),
                            torch.tensor([k], dtype=torch.int32, device=DEV), torch.tensor([0.0], device=DEV)]
                    seed_t = torch.zeros(1, dtype=torch.int32, device=DEV)
                    pos_t = torch.zeros(1, dtype=torch.int32, device=DEV)
                    out_t = torch.zeros(1, dtype=torch.int32, device=DEV)
                    agree = 0
                    for sd in range(seeds if t else 1):
                        seed_t.fill_(sd)
                        pos_t.fill_(5 * sd + 1)
                        sample_kernel[grid](ld, *args, seed_t, pos_t, partials, ticket, out_t, num_warps=nw, **c)
                        agree += int(out_t.item()) == sample_ref(logits, t, p, k, 0.0, sd, 5 * sd + 1)
                    us = time_launches(lambda r: sample_kernel[grid](ld, *args, seed_t, pos_t, partials, ticket, out_t,
                                                                    num_warps=nw, **c))
                    out.append({"tile": tile, "cand": cand, "num_warps": nw, "setting": name, "us": us,
                                "equal_to_reference": agree, "seeds": seeds if t else 1})
                    print(f"sample sweep tile {tile:5} cand {cand:2} warps {nw:2} {name:6} {us:6.1f} us  equal {agree}",
                          flush=True)
    return out


def main():
    t0 = time.time()
    rb = read_bandwidth()
    print(f"read-only {rb / 1e9:.0f} GB/s", flush=True)
    cands = [int(c) for c in os.environ.get("SAMPLE_CANDS", "0").split(",")]
    rep = {"read_GBps": rb / 1e9, "sample": [r for c in cands for r in sample_section(cand=c)]}
    if os.environ.get("Q4", "1") == "1":
        rep["q4"] = q4_section(rb)
    if os.environ.get("SAMPLE_SWEEP") == "1":
        rep["sample_sweep"] = sample_sweep()
    json.dump(rep, open(sys.argv[1], "w"), indent=1)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
