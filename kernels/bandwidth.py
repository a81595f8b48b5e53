"""The read-only bandwidth probe: what ``kestrel-run --bench`` and ``--profile`` divide bytes by.

DESIGN's "Measuring" rule: the bandwidth of a run is the larger of a device-to-device copy (read +
write counted) and a read-only stream, both measured in the same run. The copy needs no kernel
(cuMemcpyDtoDAsync); the read-only stream is this kernel, compiled into every GPU plan's kernel
table (compiler/codegen.py ``probe_kernels``) so the runtime needs nothing but the plan.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

READ_BLOCK = 4096  # int32 words a program reads per iteration (16 KB: 8 16-byte loads per thread at 4 warps)
READ_WARPS = 4
READ_TYPES = ["*i32", "*i32", "i32", "i32"]
# compiled knowing both pointers 16-byte aligned and n_words a multiple of 16 (so the loads are 16 bytes
# wide: without it the probe read 4 bytes a load and measured 3.7 TB/s where the stream runs at 4.3);
# runtime/bench.py allocates and passes such buffers
READ_ALIGNED = [True, True, True, False]
READ_PROGRAMS_PER_SM = 8


def read_stream_launch(n_words: int, sms: int) -> dict:
    """Grid: ``READ_PROGRAMS_PER_SM`` programs per SM (enough loads in flight to saturate HBM), each
    taking every grid-th tile of ``READ_BLOCK`` words."""
    tiles = -(-n_words // READ_BLOCK)
    return {"grid": [max(1, min(tiles, READ_PROGRAMS_PER_SM * sms)), 1, 1], "num_warps": READ_WARPS,
            "constexprs": {"BLOCK": READ_BLOCK}}


def read_stream_ref(x: torch.Tensor, programs: int) -> torch.Tensor:
    """Per program, the wrapping int32 sum of the words it read (tiles p, p + programs, ...)."""
    n = x.numel()
    tiles = -(-n // READ_BLOCK)
    padded = torch.zeros(tiles * READ_BLOCK, dtype=torch.int64)
    padded[:n] = x.to(torch.int64)
    per_tile = padded.reshape(tiles, READ_BLOCK).sum(1)
    out = torch.zeros(programs, dtype=torch.int64)
    out.index_add_(0, torch.arange(tiles) % programs, per_tile)
    return ((out + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


@triton.jit
def read_stream_kernel(x_ptr, out_ptr, n_words, n_tiles, BLOCK: tl.constexpr):
    """Reads ``n_words`` (a multiple of 16) int32 words once (tile t by program t % grid) and stores each program's
    wrapping sum, so no load can be dropped. Integer sums: any bit pattern is a valid input."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for t in range(pid, n_tiles, step):  # (n_words is an i32: t * BLOCK < 2**31)
        idx = t * BLOCK + offs
        acc += tl.load(x_ptr + idx, mask=idx < n_words, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))
