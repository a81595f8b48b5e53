"""On the GPU: why ``gdn_commit`` (the speculative iteration's Gated DeltaNet state advance, stop 39) takes ~10 us a
launch at the 27B shape when the snapshot copy it replaced took ~4 (bench/results/stop39 calls 2-6, kernel by
kernel). 48 layers' states (48 x 3.1 MB: more than the L2) each advanced by one launch, the 48 launches captured in
one CUDA graph and replayed; per launch, against probe kernels that isolate one part each:

  commit       the plan's kernel (kestrel.kernels.gated_delta.gdn_commit_kernel), kept = 1 and 4 rows
  copy         the state copied from another buffer (what gdn_rollback did)
  rmw          the state scaled in place (read and write the same addresses, no row data)
  scalar_rows  commit's arithmetic with the row's decay / keys / delta read once per program (scalar + vectors)

    python3 bench/commit_probe.py OUT.json
"""
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

from graph_timing import replay_times_us
from kestrel.kernels.gated_delta import gdn_commit_kernel, gdn_commit_launch, update_row_width
from kestrel.kernels.targets import TARGETS

HK, HV, DK, DV, C, KC, M, LAYERS = 16, 48, 128, 128, 10240, 4, 4, 48
N = HV * DK * DV


@triton.jit
def copy_kernel(dst_ptr, src_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=m), mask=m)


@triton.jit
def rmw_kernel(s_ptr, pos_ptr, npos_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    kept = tl.load(npos_ptr) - tl.load(pos_ptr)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = (offs < N) & (kept > 0)
    tl.store(s_ptr + offs, tl.load(s_ptr + offs, mask=m) * 0.999, mask=m)


@triton.jit
def scalar_rows_kernel(s_ptr, rows_ptr, pos_ptr, npos_ptr, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                       DV: tl.constexpr, BLOCK_K: tl.constexpr, M: tl.constexpr):
    """Program (j, kb): rows kb * BLOCK_K .. of value head j's [DK, DV] state: decay once, BLOCK_K keys, DV deltas."""
    R: tl.constexpr = HV // HK
    QKD: tl.constexpr = HK * DK
    j = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.arange(0, DV)
    n = tl.minimum(tl.maximum(tl.load(npos_ptr) - tl.load(pos_ptr), 0), M)
    offs = j * DK * DV + ks[:, None] * DV + cols[None, :]
    s = tl.load(s_ptr + offs)
    for r in range(0, n):
        upd = rows_ptr + r * (HV + QKD + HV * DV)
        decay = tl.load(upd + j)
        k = tl.load(upd + HV + (j // R) * DK + ks)
        delta = tl.load(upd + HV + QKD + j * DV + cols)
        s = s * decay
        s = s + k[:, None] * delta[None, :]
    tl.store(s_ptr + offs, s, mask=n > 0)


def graph_us(launch, reps: int = 20) -> float:
    """48 launches (one a layer) captured once; the median replay / 48, in us."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(LAYERS):  # compile + warm
            launch(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(LAYERS):
            launch(i)
    times = replay_times_us(g, reps, LAYERS)
    return sorted(times)[len(times) // 2]


def main(out: str) -> None:
    dev = "cuda"
    t = TARGETS["sm_90"]
    states = [torch.randn(N, device=dev) for _ in range(LAYERS)]
    src = [torch.randn(N, device=dev) for _ in range(LAYERS)]
    rows = [torch.randn(M, update_row_width(HK, HV, DK, DV), device=dev) * 0.01 + 0.5 for _ in range(LAYERS)]
    conv = [torch.randn(C * (KC - 1), device=dev) for _ in range(LAYERS)]
    conv_snap = [torch.randn(M - 1, C * (KC - 1), device=dev) for _ in range(LAYERS)]
    pos = torch.tensor([100], dtype=torch.int32, device=dev)
    res = {}
    lc = gdn_commit_launch(HK, HV, DK, DV, C, KC, M, t)
    for kept in (1, 4):
        npos = torch.tensor([100 + kept], dtype=torch.int32, device=dev)
        res[f"commit kept={kept}"] = graph_us(lambda i: gdn_commit_kernel[tuple(lc["grid"])](
            states[i], rows[i], conv[i], conv_snap[i], pos, npos, num_warps=lc["num_warps"], **lc["constexprs"]))
        for bk in (8, 32):
            res[f"scalar_rows BLOCK_K={bk} kept={kept}"] = graph_us(lambda i: scalar_rows_kernel[(HV, DK // bk)](
                states[i], rows[i], pos, npos, HK=HK, HV=HV, DK=DK, DV=DV, BLOCK_K=bk, M=M, num_warps=4))
    npos = torch.tensor([101], dtype=torch.int32, device=dev)
    res["copy"] = graph_us(lambda i: copy_kernel[(triton.cdiv(N, 2048),)](states[i], src[i], N=N, BLOCK=2048,
                                                                           num_warps=4))
    res["rmw"] = graph_us(lambda i: rmw_kernel[(triton.cdiv(N, 2048),)](states[i], pos, npos, N=N, BLOCK=2048,
                                                                         num_warps=4))
    for k, v in res.items():
        print(f"{k:40s} {v:7.2f} us a launch ({N * 8 / v / 1e3:.0f} GB/s for the state's read + write)")
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
