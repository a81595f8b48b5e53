"""Probe (stop 49): where the time of kernels/gdn_cluster.py's launch goes. Each CTA's thread 0 stamps clock64 at
the kernel's phases (the source's TIMING: slots 0-11 of 16 a CTA in the scratch0 buffer, 12 and 13 the globaltimer
at its start and end), for the 80B-A3B and 0.8B shapes and a few forms (scales by plain loads or bulk copies, 8 or
16 warps, clusters of 8, 4 or 2 CTAs, 1 or 4 rows a warp at once, the words by bulk copies or cp.async); each form's output checked against ``rmsnorm_gdn_ref``, its launch timed alone (CUDA events over
back-to-back launches, no PDL).

Here (no GPU):   python bench/gdn_cluster_probe.py compile bench/plans/gdn-probe
On the device:   python3 bench/gdn_cluster_probe.py run bench/plans/gdn-probe $OUT/gdn-probe.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys

SHAPES = {"80b": (2048, 16, 32, 128, 128, 128), "0.8b": (1024, 16, 16, 128, 128, 256)}  # K, Hk, Hv, Dk, Dv, NP
# (SB, NW, CS, RU, WL): CS 4 and 2 where the rows fit; WL: the words by cp.async, not bulk copies
FORMS = [(0, 8, 8, 1, 0), (1, 8, 8, 1, 0), (1, 8, 8, 4, 0), (1, 16, 8, 4, 0), (1, 8, 4, 4, 0), (1, 8, 2, 4, 0),
         (1, 8, 8, 4, 1)]
PHASES = ["issue + preload", "x + partials", "weights' wait", "projection", "conv + q/k pushed", "q/k wait",
          "l2 norms", "delta rule", "norm sums exchanged", "norm + store", "(end)"]
TYPES = ["*fp32", "*fp32", "*fp32", "*u8"] + ["*fp32"] * 7 + ["fp32"] * 4


def compile_all(out_dir: str) -> None:
    import dataclasses

    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels import gdn_cluster
    from kestrel.kernels.targets import TARGETS

    os.makedirs(out_dir, exist_ok=True)
    index = []
    for name, (k, hk, hv, dk, dv, np_) in SHAPES.items():
        for sb, nw, cs, ru, wl in FORMS:
            t = TARGETS["sm_90"]
            t = dataclasses.replace(t, rules={**t.rules, "gdn_cluster": dataclasses.replace(
                t.rules["gdn_cluster"], on=True, num_warps=nw, cs=cs)})
            launch = gdn_cluster.gdn_cluster_launch(k, 128, hk, hv, dk, dv, 4, np_, t)
            if launch is None:
                continue
            consts = launch["constexprs"] | {"SB": sb, "RU": ru, "WL": wl, "TIMING": 1, "PDL": False}
            ck = compile_kernel("gdn_cluster_q4g128", gdn_cluster.gdn_cluster, TYPES, consts, nw, 90)
            fname = f"{name}-sb{sb}-nw{nw}-cs{cs}-ru{ru}-wl{wl}.cubin"
            open(os.path.join(out_dir, fname), "wb").write(ck.cubin)
            index.append({"shape": name, "sb": sb, "nw": nw, "cs": cs, "ru": ru, "wl": wl, "cubin": fname, "name": ck.name, "grid": launch["grid"],
                          "shared": ck.shared, "consts": consts})
            print("compiled", fname, ck.shared)
    json.dump(index, open(os.path.join(out_dir, "index.json"), "w"), indent=1)


def run_all(in_dir: str, out_path: str) -> None:
    import torch

    from kestrel.kernels.gdn_cluster import rmsnorm_gdn_ref
    from kestrel.kernels.matvec import q4_pack, q4_unpack
    from kestrel.runtime import cuda as kc

    torch.zeros(1, device="cuda")
    dev, _ = kc.init(0)
    cu = kc.driver()
    clock_khz = kc.check(cu.cuDeviceGetAttribute(cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE, dev), "clock")
    rows = []
    for e in json.load(open(os.path.join(in_dir, "index.json"))):
        k, hk, hv, dk, dv, np_ = SHAPES[e["shape"]]
        g = torch.Generator(device="cuda").manual_seed(1)
        c = 2 * hk * dk + hv * dv
        n = c + hv * dv + 2 * hv
        w = q4_pack(torch.randn(n, k, generator=g, device="cuda") / k ** 0.5, 128)
        s = torch.randn(k, generator=g, device="cuda")
        ss = (s ** 2).reshape(np_, -1).sum(-1)
        nw = 0.1 * torch.randn(k, generator=g, device="cuda")
        cs = 0.5 * torch.randn(c, 3, generator=g, device="cuda")
        cw = 0.5 * torch.randn(c, 4, generator=g, device="cuda")
        a_log = torch.rand(hv, generator=g, device="cuda").mul(15).add(1).log()
        dtb = 0.5 * torch.randn(hv, generator=g, device="cuda")
        normw = 0.1 * torch.randn(dv, generator=g, device="cuda")
        rec = 0.1 * torch.randn(hv, dk, dv, generator=g, device="cuda")
        out = torch.zeros(hv * dv, device="cuda")
        stamps = torch.zeros(e["grid"][0] * 16, dtype=torch.int64, device="cuda")
        attrs = [1e-6, 1e-6, dk ** -0.5, 1e-6]
        cs_ref, rec_ref = cs.clone(), rec.clone()
        want = rmsnorm_gdn_ref(s, ss, nw, q4_unpack(w, n, k, 128), cs_ref, cw, a_log, dtb, normw, rec_ref, *attrs)
        kern = kc.Kernel(open(os.path.join(in_dir, e["cubin"]), "rb").read(), e["name"], e["nw"], e["shared"])
        ptrs = [t.data_ptr() for t in (s, ss, nw, w, cs, cw, a_log, dtb, normw, rec, out)]
        args = kc.PackedArgs(TYPES, ptrs + attrs, scratch=(stamps.data_ptr(), 0))
        stream = torch.cuda.current_stream().cuda_stream
        kc.launch(kern, e["grid"], args, stream)
        torch.cuda.synchronize()
        err = {nm: ((a - b).abs().max() / b.abs().max()).item()
               for nm, a, b in (("out", out, want), ("conv_state", cs, cs_ref), ("rec_state", rec, rec_ref))}
        times = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(50):
                kc.launch(kern, e["grid"], args, stream)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / 50)
        st = stamps.view(-1, 16).cpu()
        phases = {}
        for i, name in enumerate(PHASES):
            d = (st[:, i + 1] - st[:, i]).double() / clock_khz * 1e3  # us
            phases[name] = {"median_us": d.median().item(), "max_us": d.max().item()}
        span = ((st[:, 13].max() - st[:, 12].min()).item() / 1e3, (st[:, 12].max() - st[:, 12].min()).item() / 1e3)
        r = {**{x: e[x] for x in ("shape", "sb", "nw", "cs", "ru", "wl", "grid", "shared")}, "err": err,
             "us_per_launch": statistics.median(times), "phases": phases,
             "globaltimer_span_us": span[0], "start_spread_us": span[1], "clock_khz": clock_khz}
        rows.append(r)
        print(json.dumps(r), flush=True)
    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, open(out_path, "w"), indent=1)
    for r in rows:
        print(f"\n{r['shape']} SB={r['sb']} NW={r['nw']} CS={r['cs']} RU={r['ru']} WL={r['wl']}: {r['us_per_launch']:.2f} us a launch, span "
              f"{r['globaltimer_span_us']:.2f} us (starts spread {r['start_spread_us']:.2f}), err "
              + " ".join(f"{k} {v:.1e}" for k, v in r["err"].items()))
        for name, v in r["phases"].items():
            print(f"  {name:26} median {v['median_us']:7.2f}  max {v['max_us']:7.2f} us")


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        run_all(sys.argv[2], sys.argv[3])
