"""Programmatic dependent launch (PDL, sm_90 and later): what every step kernel runs before it touches
anything an earlier kernel of the step wrote.

The step's CUDA graph chains its kernel nodes with programmatic edges (runtime/gpu.py): kernel i + 1
may start while kernel i is still running, once every program of kernel i has passed its
``pdl_wait``. So each kernel begins with ``pdl_wait(PDL)``:

  griddepcontrol.wait              blocks until the previous kernel has completed, its writes visible;
  griddepcontrol.launch_dependents lets the next kernel's programs start (they then sit in their
                                   own wait, already resident, while this kernel runs).

Where a kernel lets the next one launch is its choice: at its start (most kernels: one wave, or few
programs), or after its main loop (``pdl_launch``; the matvec family when its launch rule says
``PDL_LATE``: measured against the start on the H200, bench/results/stop20). Every kernel of the
chain waits before it reads or writes step data, so kernel i + 1 finishing implies kernel i finished: the
chain keeps the full order of a plain graph (and the same bytes); what PDL removes is the launch gap between
nodes (measured on the H200: bench/results/stop19). Weights are not step data (no kernel of the step writes
one): the small bf16 matvecs load their first weight tile before the wait (kernels/matvec.py PRELOAD; 0.8B
bf16 0.757 -> 0.739 ms/token, stop 29). An L2 prefetch of each matvec CTA's first weight bytes before the wait
lost (27B q4 5.42 ms/token without it, 5.73 with 16 KB per CTA, 6.17 with 64 KB); so did a
prefetch branch beside the chain (bulk L2 prefetches of the next products' weights, stop 29 call 1: 0.8B
bf16 0.741 -> 0.770-0.898 ms a step, 27B q4 5.48 -> 5.53-5.78). Stop 36 measured each program asking the L2
for all its rows (``L2_PREFETCH``): lost again at 27B, 2B-9B q4 and 0.8B bf16, but 0.8B q4 0.508 -> 0.476, so
q4 matrices of at most 4.5 MiB do it (kernels/matvec.py). Stop 37: moe_down asking the L2 for its routed and
shared experts' rows before its wait (the routing known two launches back) lost (80B-A3B q4 1.980 -> 1.996
ms/token), and attn_step computing pos's RoPE angles before its wait lost in the step's graph (0.8B q4 0.483 ->
0.488) while it won chained with itself (9.2 -> 6.0 us a launch): both gone (bench/results/stop37).

Whether a step graph keeps programmatic edges is decided at load by timing (runtime/gpu.py): on the
H200 they cut 0.8B's step by 7-13%, 2B bf16's by 6% and 27B q4's by 3.6%, and cost 2B q4, 4B, 9B
bf16 and 27B bf16 2-4%, with no rule of size that predicts which; the M-row step's graph keeps plain
edges (not measured). Since stop 37 the trial has a third graph, programmatic with the step's early-trigger
matvecs compiled to trigger after their loop (compiler/codegen.py): 2B-9B q4, which lost with the early
triggers, win with those (2B 0.848 -> 0.785 ms/token against plain edges before; bench/results/stop37).

``PDL`` is a constexpr that codegen sets from the target (compiler/codegen.py: true from sm_90), false
on older targets. Triton's interpreter (which runs launches one at a time, and no inline assembly)
skips the instructions whatever PDL says (a plan's sm_90 launch list runs there in the tests). Outside
a programmatic launch (streaming launches, a graph built with KESTREL_PDL=0) the wait returns at once.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_MIN_CC = 90  # griddepcontrol needs sm_90
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def pdl_wait(PDL: tl.constexpr, LAUNCH: tl.constexpr = True):
    """Wait for the previous kernel of the step, then (LAUNCH) let the next one launch (see the module
    doc). A kernel that passes LAUNCH=False calls ``pdl_launch`` itself, later."""
    if PDL and not _INTERPRET:
        gdc_wait()
        if LAUNCH:
            gdc_launch_dependents()


@triton.jit
def pdl_launch(PDL: tl.constexpr):
    """Let the next kernel of the step launch: a multi-wave kernel calls it after its main loop (``LATE``
    triggers), so the next kernel's programs, resident and waiting, do not take SM slots its own
    later waves need; they still start before its last programs end."""
    if PDL and not _INTERPRET:
        gdc_launch_dependents()
