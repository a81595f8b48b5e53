"""Programmatic dependent launch (PDL, sm_90 and later): what every step kernel runs before it touches
anything an earlier kernel of the step wrote.

The step's CUDA graph chains its kernel nodes with programmatic edges (runtime/gpu.py): kernel i + 1
may start while kernel i is still running, once every program of kernel i has passed its
``pdl_wait``. So each kernel begins with ``pdl_wait(PDL)``:

  griddepcontrol.wait              blocks until the previous kernel has completed, its writes visible;
  griddepcontrol.launch_dependents lets the next kernel's programs start (they then sit in their
                                   own wait, already resident, while this kernel runs).

Every kernel of the chain waits before it reads or writes step data, so kernel i + 1 finishing
implies kernel i finished: the chain keeps the full order of a plain graph (and the same bytes);
what PDL removes is the launch gap and the ramp between nodes. Work that reads only constant data
may come before the wait: the matvec kernels prefetch their first weight bytes into L2 there
(``l2_prefetch``), overlapping the previous kernel's tail.

``PDL`` is a constexpr that codegen sets from the target (compiler/codegen.py: true from sm_90); it is
false in Triton's interpreter and on older targets, where these are no-ops. Outside a programmatic
launch (streaming launches, a graph built with KESTREL_PDL=0) the wait returns at once.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_MIN_CC = 90  # griddepcontrol needs sm_90

# cp.async.bulk.prefetch.L2 of [base, base + nbytes), issued by the CTA's thread 0 (one bulk copy-engine
# request; base 16-byte aligned and nbytes a multiple of 16: the callers guarantee both)
_L2_PREFETCH = tl.constexpr("""{
 .reg .u32 t;
 .reg .pred p;
 mov.u32 t, %tid.x;
 setp.eq.u32 p, t, 0;
 @p cp.async.bulk.prefetch.L2.global [$1], $2;
 mov.u32 $0, 0;
}""")


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel of the step, then let the next one launch (see the module doc)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def l2_prefetch(base, nbytes):
    """Prefetch bytes [base, base + nbytes) into L2 (``base`` an int64 address, 16-byte aligned;
    ``nbytes`` an int32 multiple of 16), one bulk prefetch by thread 0. sm_90 only (PDL kernels)."""
    tl.inline_asm_elementwise(_L2_PREFETCH, "=r,l,r", [base, nbytes.to(tl.int32)], dtype=tl.int32, is_pure=False,
                              pack=1)
