"""Nsight Compute on the q4 matvecs at the 27B decode shapes (on the GPU, Triton's JIT there): each
kernel launched at its launch rule, once to compile and warm, then once more under ncu's counters
(DRAM throughput, occupancy, warp stall reasons, issue activity). What limits the small-N shapes
(down_proj and o_proj / out_proj at 43-51% of the read bandwidth) is the question it answers.

    ncu --clock-control none --kernel-name regex:matvec --launch-skip 0 --launch-count 99 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --csv --page details \\
        python3 bench/ncu_q4.py > ncu.csv
"""
from __future__ import annotations

import torch

from kestrel.kernels.matvec import matvec_kernel, matvec_launch, matvec_swiglu_kernel, q4_pack
from kestrel.kernels.targets import TARGETS

T = TARGETS["sm_90"]
SHAPES = [("down", 5120, 17408), ("o_proj", 5120, 6144), ("in_proj", 16480, 5120), ("gate_up", 17408, 5120)]


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in SHAPES:
        buf = q4_pack(torch.randn(n, k, generator=g, device="cuda") * 0.02, 128)
        x, y = torch.randn(k, generator=g, device="cuda"), torch.empty(n, device="cuda")
        pair = name == "gate_up"
        L = matvec_launch(n, k, 128, T, pair=pair)
        grid, c, nw = tuple(L["grid"]), L["constexprs"], L["num_warps"]
        print(name, n, k, L, flush=True)
        for _ in range(2):  # compile + warm, then the profiled launch (ncu replays it per section)
            if pair:
                matvec_swiglu_kernel[grid](x, buf, buf, y, num_warps=nw, **c)
            else:
                matvec_kernel[grid](x, buf, y, num_warps=nw, **c)
        torch.cuda.synchronize()
        del buf


if __name__ == "__main__":
    main()
