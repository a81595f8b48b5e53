"""On the GPU (Triton's JIT there): the decode kernels issue 13 changed, at the real shapes, against
their CPU references, and timed.

  * q4 matvec / matvec_swiglu (kernels/matvec.py, the f16x2 kernel at its launch rule) at the 27B and
    0.8B shapes: error against ``q4_matvec_ref`` (fp16 lanes emulated exactly: only fp32 summation
    order differs), us per launch (median of CUDA-graph replays rotating over weight copies larger
    than L2) and that as a fraction of the read-only bandwidth measured in the same run;
  * sample (kernels/sample.py) at the 248,320-token vocabulary: the token equal to ``sample_ref``'s for
    every seed, per setting (greedy, Qwen's 0.7 / 0.8 / top-k 20, plain temperature, top-p alone,
    min-p), us per launch;
  * the speculative sampler (kernels/speculative.py, issue 12) at 248,320 tokens and K = 3 (SPEC_SAMPLE=0
    skips it): a draft (spec_filter over one row + draft_sample) and the verified rows (spec_filter over the
    K + 1 rows + spec_sample_rows), per setting: the draft / row tokens equal to ``draft_sample_ref`` /
    ``spec_sample_rows_ref``'s for every seed, q's kept set equal to ``filtered_probs_ref``'s, the filter's
    merge path (1 every token, 2 candidates, 3 the one-program search), us per pair of launches, and one
    sampled iteration's sampling (K drafts + the rows) as K x draft + rows.

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


def spec_sample_section(seeds: int = 16, k: int = 3) -> list:
    """The speculative sampler's two launch pairs at the 248,320-token vocabulary (module docstring)."""
    from kestrel.kernels import speculative as sp

    v = 248320
    fl, rl, dl = sp.spec_filter_launch(k + 1, v, T), sp.spec_rows_launch(k + 1, v, T), sp.spec_rows_launch(1, v, T)
    f1 = sp.spec_filter_launch(1, v, T)
    part = torch.zeros(sp.spec_scratch_shape(k + 1, v, T), dtype=torch.float32, device=DEV)
    tickets = torch.zeros(k + 1, dtype=torch.int32, device=DEV)
    g = torch.Generator().manual_seed(2)
    dists = {"random": torch.randn(k + 1, v, generator=g) * 3,
             "peaked": torch.randn(k + 1, v, generator=g) * 3 + torch.where(torch.rand(k + 1, v, generator=g) < 1e-3,
                                                                            12.0, 0.0)}
    out = []
    for dname, logits in dists.items():
        head = logits[:k] + torch.randn(k, v, generator=g) * torch.tensor([0.0, 0.5, 3.0][:k]).reshape(k, 1)
        ld, hd = logits.to(DEV), head.to(DEV)
        for name, t, p, topk, mp in SETTINGS:
            if t == 0:
                continue
            dev = lambda val, dt=torch.float32: torch.tensor([val], dtype=dt, device=DEV)  # noqa: E731
            t_t, p_t, k_t, mp_t = dev(t), dev(p), dev(topk, torch.int32), dev(mp)
            seed_t, dpos_t, draft_t, pos_t = (dev(0, torch.int32) for _ in range(4))
            q = torch.zeros(k, v, dtype=torch.float32, device=DEV)

            def draft(j):
                sp.spec_filter_kernel[tuple(f1["grid"])](hd[j], t_t, p_t, k_t, mp_t, part, tickets,
                                                         num_warps=f1["num_warps"], **f1["constexprs"])
                sp.draft_sample_kernel[tuple(dl["grid"])](hd[j], draft_t, t_t, p_t, k_t, mp_t, seed_t, dpos_t, q, part,
                                                          tickets, draft_t, j, num_warps=dl["num_warps"],
                                                          **dl["constexprs"])
            # drafts: every seed's draft and q rows against the references
            agree_d, q_ref = 0, torch.zeros(k, v)
            for s in range(seeds):
                seed_t.fill_(s)
                dpos_t.fill_(3 * s)
                draft_t.fill_(-1)
                draft(s % k)
                agree_d += int(draft_t.item()) == sp.draft_sample_ref(head[s % k], -1, t, p, topk, mp, s, 3 * s, q_ref,
                                                                      s % k)
            draft_path = int(part[f1["grid"][0], 6].view(torch.int32).item())
            kept_same = bool(torch.equal(q.cpu() > 0, q_ref > 0))
            us_draft = time_launches(lambda r: draft(r % k))
            # the verified rows: drafts drawn from q by the reference per seed
            s_len = 64
            tokens_t = torch.zeros(s_len, dtype=torch.int32, device=DEV)
            replay_t = torch.zeros(s_len, dtype=torch.int32, device=DEV)
            greedy = sp.argmax_rows_ref(logits)
            greedy_t, rows_t, zero_t = greedy.to(DEV), torch.zeros(k + 1, dtype=torch.int32, device=DEV), dev(0, torch.int32)
            q_dev = q_ref.to(DEV)

            def rows():
                sp.spec_filter_kernel[tuple(fl["grid"])](ld, t_t, p_t, k_t, mp_t, part, tickets,
                                                         num_warps=fl["num_warps"], **fl["constexprs"])
                sp.spec_sample_rows_kernel[tuple(rl["grid"])](ld, greedy_t, q_dev, tokens_t, replay_t, pos_t, t_t, p_t,
                                                              k_t, mp_t, seed_t, zero_t, part, tickets, rows_t,
                                                              K=k, S=s_len, num_warps=rl["num_warps"],
                                                              **rl["constexprs"])
            agree_r, accepted, pos = 0, 0, 5
            pos_t.fill_(pos)
            for s in range(seeds):
                tokens = torch.zeros(s_len, dtype=torch.int32)
                for j in range(k):
                    tokens[pos + 1 + j] = sp.draw_ref(q_ref[j], sp.spec_uniform(s, pos + 1 + j, sp.DRAFT))
                tokens_t.copy_(tokens)
                seed_t.fill_(s)
                rows()
                ref = sp.spec_sample_rows_ref(logits, greedy, q_ref, tokens, tokens, pos, t, p, topk, mp, s, 0)
                agree_r += bool(torch.equal(rows_t.cpu(), ref))
                accepted += sum(int(ref[r]) == int(tokens[pos + 1 + r]) for r in range(k))
            rows_path = [int(part[r * (fl["grid"][0] + 1) + fl["grid"][0], 6].view(torch.int32).item())
                         for r in range(k + 1)]
            us_rows = time_launches(lambda r: rows())
            row = {"distribution": dname, "setting": name, "temperature": t, "top_p": p, "top_k": topk, "min_p": mp,
                   "k": k, "seeds": seeds, "draft_equal_to_reference": agree_d, "q_kept_set_equal": kept_same,
                   "draft_path": draft_path, "us_draft": us_draft, "rows_equal_to_reference": agree_r,
                   "rows_path": rows_path, "drafts_accepted_of": [accepted, k * seeds], "us_rows": us_rows,
                   "us_iteration_sampling": k * us_draft + us_rows, "tickets_after": tickets.tolist()}
            out.append(row)
            print(f"spec sample {dname:6} {name:22} draft {us_draft:7.1f} us (equal {agree_d}/{seeds}, q set "
                  f"{kept_same}, path {draft_path})  rows {us_rows:7.1f} us (equal {agree_r}/{seeds}, paths "
                  f"{rows_path}, accepted {accepted}/{k * seeds})  iteration's sampling K={k}: "
                  f"{row['us_iteration_sampling']:7.1f} us", flush=True)
    return out


def main():
    t0 = time.time()
    rb = read_bandwidth()
    print(f"read-only {rb / 1e9:.0f} GB/s", flush=True)
    cands = [int(c) for c in os.environ.get("SAMPLE_CANDS", "0").split(",")]
    rep = {"read_GBps": rb / 1e9, "sample": [r for c in cands for r in sample_section(cand=c)]}
    if os.environ.get("SPEC_SAMPLE", "1") == "1":
        rep["spec_sample"] = spec_sample_section()
    if os.environ.get("Q4", "1") == "1":
        rep["q4"] = q4_section(rb)
    if os.environ.get("SAMPLE_SWEEP") == "1":
        rep["sample_sweep"] = sample_sweep()
    json.dump(rep, open(sys.argv[1], "w"), indent=1)
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
