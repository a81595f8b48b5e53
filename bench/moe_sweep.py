"""Launch-configuration sweep for Qwen3-Next's one-row MoE kernels at the 80B-A3B shape (a tuning experiment).

Here (no GPU):   python bench/moe_sweep.py compile DIR     (MOE_SWEEP_KINDS=down_add: that kernel's variants only)
On the device:   python3 bench/moe_sweep.py time DIR $OUT/moe-sweep.json

The one-token step's MoE block after fuse: ``moe_topk`` (the router's softmax and top-k over E = 512
logits), ``rmsnorm_moe_gate_up`` (the k = 10 routed experts' and the shared expert's gate / up rows, 2048
inputs, q4 g128, the post-attention norm folded in) and ``moe_down_add`` (their down rows summed in rank
order, 512 inputs a routed expert, plus the residual). Each variant (BLOCK_N, BLOCK_K, num_warps; the
down's pipeline depth STAGES, -1 its gathered form) is checked against the rule's variant's result and the
rule's against the torch reference (on the routed experts' rows only), then timed as bench/graph_timing.py
times a kernel: a CUDA graph of launches, each with its own routing buffer (32 sets of random experts rotated, so the
weights a launch reads come from DRAM, as in a step whose 48 layers each read their own; the shared
expert's small matrices do stay in L2 here). The report names the launch rule's variant.
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

E, H, I, IS, K, GROUP = 512, 2048, 512, 512, 10, 128
P = 512  # partial sums of the residual's squares (the producer's programs: 2048 rows in 4s)
ID_SETS = 32


def gate_up_variants():
    for bn in (2, 4, 8, 16):
        for bk in (256, 512, 1024, 2048):
            for nw in (1, 2, 4, 8):
                if nw <= max(1, bn * bk // 32 // 32) and bn * bk // 2 >= 512:
                    yield {"BLOCK_N": bn, "BLOCK_K": bk}, nw


def down_variants():
    for bn in (2, 4, 8, 16, 32):
        for bk in (128, 256, 512):
            for nw in (1, 2, 4):
                for st in (0, 2, 3, 4):
                    if nw <= max(1, bn * bk // 32 // 32):
                        yield {"BLOCK_N": bn, "BLOCK_KD": bk, "BLOCK_KS": bk, "STAGES": st}, nw
    for bn in (1, 2, 4, 8, 16):  # the gathered form (stop 38: the MoeRule's down_gather), all of I in its tile
        for nw in (1, 2, 4, 8):
            yield {"BLOCK_N": bn, "BLOCK_KD": I, "BLOCK_KS": 512, "STAGES": -1}, nw


TYPES = {
    "topk": ["*fp32", "*i32", "*fp32", "i32", "i32"],
    "gate_up": ["*fp32", "*fp32", "*fp32", "*i32", "*u8", "*u8", "*u8", "*u8", "*bf16", "*fp32", "i32", "fp32"],
    "gate_up_plain": ["*fp32", "*i32", "*u8", "*u8", "*u8", "*u8", "*bf16", "*fp32", "i32"],
    "down_add": ["*fp32", "*i32", "*fp32", "*u8", "*u8", "*fp32", "*fp32", "*fp32", "i32"],
}


def rules():
    from kestrel.kernels.moe import moe_down_launch, moe_gate_up_launch, moe_topk_launch
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    return {"topk": moe_topk_launch(1, E, K, t),
            "gate_up": moe_gate_up_launch(1, E, H, I, IS, K, (GROUP, GROUP, 0), t, partials=P),
            "down_add": moe_down_launch(1, E, H, I, IS, K, (GROUP, GROUP), t)}


def jobs():
    rule = rules()
    out = [("topk", dict(rule["topk"]["constexprs"]) | {"SORT": sort}, nw) for sort in (False, True)
           for nw in (1, 2, 4, 8)]  # (SORT: stop 41's bitonic top-k form)
    base = rule["gate_up"]["constexprs"]
    out += [("gate_up", base | c, nw) for c, nw in gate_up_variants()]
    plain = {k: v for k, v in base.items() if k not in ("P", "BLOCK_P")}  # moe_gate_up (no norm folded in)
    out += [("gate_up_plain", plain | c, nw) for c, nw in gate_up_variants() if c["BLOCK_K"] >= 1024]
    base = rule["down_add"]["constexprs"]
    out += [("down_add", base | c, nw) for c, nw in down_variants()]
    kinds = os.environ.get("MOE_SWEEP_KINDS")  # e.g. "down_add": only those kernels' variants
    return [j for j in out if not kinds or j[0] in kinds.split(",")]


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels import moe

    kind, consts, nw = job
    fn = {"topk": moe.moe_topk_kernel, "gate_up": moe.rmsnorm_moe_gate_up_kernel,
          "gate_up_plain": moe.moe_gate_up_kernel, "down_add": moe.moe_down_add_kernel}[kind]
    try:
        c = compile_kernel(kind, fn, TYPES[kind], consts, nw, 90, [t.startswith("*") for t in TYPES[kind]])
    except Exception as e:  # noqa: BLE001 - a variant that does not compile is just skipped
        return None, f"{kind} {consts} {nw}: {type(e).__name__}"
    return (kind, consts, nw, c.name, c.cubin, c.shared), None


def compile_all(folder):
    os.makedirs(folder, exist_ok=True)
    rule = rules()
    index = []
    with ProcessPoolExecutor(2) as ex:
        for i, (res, err) in enumerate(ex.map(_compile, jobs())):
            if err:
                print("skip", err)
                continue
            kind, consts, nw, fn, cubin, shared = res
            f = f"{kind}-{i}.cubin"
            open(os.path.join(folder, f), "wb").write(cubin)
            r = rule.get(kind, {"constexprs": None, "num_warps": 0})
            is_rule = r["constexprs"] == consts and r["num_warps"] == nw
            index.append(dict(kind=kind, consts=consts, num_warps=nw, name=fn, cubin=f, shared=shared, rule=is_rule))
    json.dump(index, open(os.path.join(folder, "index.json"), "w"), indent=1)
    print(len(index), "variants")


def _q4_random(n, k, gen):
    """A random q4 buffer [N, K] (the layout of kernels/matvec.py): random nibbles, small f16 scales."""
    import torch
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n * k // 8,), generator=gen, device="cuda", dtype=torch.int64)
    scales = (torch.rand(n * k // GROUP, generator=gen, device="cuda") * 0.004 + 0.001).half()
    return torch.cat([words.to(torch.int32).view(torch.uint8), scales.view(torch.uint8)])


def _rows_of(buf, n, k, rows):
    """The q4 weight of rows ``rows`` of buffer [N, K], unpacked for the references (kernels/matvec.py)."""
    import torch
    from kestrel.kernels.matvec import q4_unpack
    words = buf[: n * k // 2].view(torch.int32).reshape(n, k // 8)[rows]
    scales = buf[n * k // 2:].view(torch.float16).reshape(n, k // GROUP)[rows]
    sub = torch.cat([words.contiguous().view(torch.uint8).reshape(-1), scales.contiguous().view(torch.uint8).reshape(-1)])
    return q4_unpack(sub.cpu(), len(rows), k, GROUP)


def time_all(folder, out):
    import statistics

    import torch

    from graph_timing import launch_times_us
    from kestrel.kernels import moe
    from kestrel.kernels.rmsnorm import rmsnorm_ref
    from kestrel.runtime import cuda as kc

    torch.zeros(1, device="cuda")
    kc.init(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    index = json.load(open(os.path.join(folder, "index.json")))
    wg, wu, wd = (_q4_random(E * I, H, gen), _q4_random(E * I, H, gen), _q4_random(E * H, I, gen))
    sg, su, sd = _q4_random(IS, H, gen), _q4_random(IS, H, gen), _q4_random(H, IS, gen)
    sgate = (torch.randn(1, H, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    kp = -(-K // 4) * 4  # rows of the routing buffers 16-byte aligned too
    ids = torch.zeros(ID_SETS, kp, dtype=torch.int32, device="cuda")
    ids[:, :K] = torch.stack([torch.randperm(E, generator=gen, device="cuda")[:K] for _ in range(ID_SETS)])
    wts = torch.zeros(ID_SETS, kp, device="cuda")
    wts[:, :K] = torch.softmax(torch.randn(ID_SETS, K, generator=gen, device="cuda"), -1)
    logits = torch.randn(ID_SETS, E, generator=gen, device="cuda")
    s = torch.randn(H, generator=gen, device="cuda")
    ss = torch.stack([(s[i:i + 4] ** 2).sum() for i in range(0, H, 4)])
    nw = torch.randn(H, generator=gen, device="cuda") * 0.1
    act_n = K * I + IS + 1
    stride = -(-act_n // 4) * 4  # each set's row 16-byte aligned (the kernels were compiled assuming it)
    act = (torch.randn(ID_SETS, stride, generator=gen, device="cuda") * 0.05)[:, :act_n]
    r = torch.randn(H, generator=gen, device="cuda")

    # the references, on set 0 (the routed experts' rows only: the stacked matrices unpacked whole would be GBs)
    e0 = ids[0, :K].long()
    rows_gu = (e0[:, None] * I + torch.arange(I, device="cuda")).reshape(-1)
    rows_d = (e0[:, None] * H + torch.arange(H, device="cuda")).reshape(-1)
    local = torch.arange(K, dtype=torch.int32)
    unpack = lambda b, n, k: _rows_of(b, n, k, torch.arange(n, device="cuda"))  # noqa: E731
    ref = {
        "topk": moe.moe_topk_ref(logits[0].cpu(), K, 1),
        "gate_up": moe.moe_gate_up_ref(rmsnorm_ref(s.cpu(), nw.cpu(), 1e-6), local, _rows_of(wg, E * I, H, rows_gu),
                                       _rows_of(wu, E * I, H, rows_gu), unpack(sg, IS, H), unpack(su, IS, H),
                                       sgate.cpu(), K),
        "gate_up_plain": moe.moe_gate_up_ref(s.cpu(), local, _rows_of(wg, E * I, H, rows_gu),
                                             _rows_of(wu, E * I, H, rows_gu), unpack(sg, IS, H), unpack(su, IS, H),
                                             sgate.cpu(), K),
        "down_add": r.cpu() + moe.moe_down_ref(act[0].cpu(), local, wts[0, :K].cpu(), _rows_of(wd, E * H, I, rows_d),
                                               unpack(sd, H, IS)),
    }
    rows, first = [], {}
    for e in index:
        kind, c = e["kind"], e["consts"]
        kern = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["name"], e["num_warps"], e["shared"])
        if kind == "topk":
            o_ids = torch.empty(ID_SETS, kp, dtype=torch.int32, device="cuda")
            o_w = torch.empty(ID_SETS, kp, device="cuda")
            grid = [1, 1, 1]
            sets = [[logits[j].data_ptr(), o_ids[j].data_ptr(), o_w[j].data_ptr(), K, 1] for j in range(ID_SETS)]
            result = lambda: (o_ids[0, :K].cpu(), o_w[0, :K].cpu())  # noqa: E731
        elif kind.startswith("gate_up"):
            nb = -(-I // c["BLOCK_N"])
            grid = [K * nb + -(-IS // c["BLOCK_N"]) + 1, 1, 1]
            o = torch.empty(ID_SETS, stride, device="cuda")
            sets = [[s.data_ptr(), ss.data_ptr(), nw.data_ptr(), ids[j].data_ptr(), wg.data_ptr(), wu.data_ptr(),
                     sg.data_ptr(), su.data_ptr(), sgate.data_ptr(), o[j].data_ptr(), E, 1e-6] for j in range(ID_SETS)]
            if kind == "gate_up_plain":
                sets = [[v[0]] + v[3:11] for v in sets]
            result = lambda: o[0, :act_n].cpu()  # noqa: E731
        else:
            grid = [-(-H // c["BLOCK_N"]), 1, 1]
            o = torch.empty(ID_SETS, H, device="cuda")
            o_ss = torch.empty(ID_SETS, grid[0], device="cuda")
            sets = [[act[j].data_ptr(), ids[j].data_ptr(), wts[j].data_ptr(), wd.data_ptr(), sd.data_ptr(), r.data_ptr(),
                     o[j].data_ptr(), o_ss[j].data_ptr(), c["BLOCK_N"]] for j in range(ID_SETS)]
            result = lambda: o[0].cpu()  # noqa: E731
        packed = [kc.PackedArgs(TYPES[kind], v) for v in sets]
        kc.launch(kern, grid, packed[0], 0)
        torch.cuda.synchronize()
        got = result()
        if kind == "topk":
            err = 0.0 if torch.equal(got[0], ref["topk"][0]) else 1.0
        else:
            err = ((got - ref[kind]).abs().max() / ref[kind].abs().max()).item()
        us = statistics.median(launch_times_us(kern, grid, packed, replays=8))
        row = dict(e, us=us, err=err)
        rows.append(row)
        print(f"{kind:9} {json.dumps({k: v for k, v in c.items() if k.startswith(('BLOCK', 'STAGES', 'SORT'))})} nw={e['num_warps']} "
              f"{us:8.2f} us err {err:.1e}{' (rule)' if e['rule'] else ''}", flush=True)
        first.setdefault(kind, row)
    json.dump(rows, open(out, "w"), indent=1)
    print("\nbest per kernel (err < 1e-3), and the launch rule's pick:")
    for kind in ("topk", "gate_up", "gate_up_plain", "down_add"):
        rs = sorted((r for r in rows if r["kind"] == kind and r["err"] < 1e-3), key=lambda r: r["us"])
        for r in rs[:6] + [r for r in rows if r["kind"] == kind and r["rule"]]:
            print(f"{kind:9} {json.dumps({k: v for k, v in r['consts'].items() if k.startswith(('BLOCK', 'STAGES', 'SORT'))})} "
                  f"nw={r['num_warps']} {r['us']:8.2f} us err {r['err']:.1e}{' (rule)' if r['rule'] else ''}")


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
