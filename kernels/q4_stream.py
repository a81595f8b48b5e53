"""The one-row q4 matrix-vector product fed by the bulk copy engine (sm_90 on): y = W @ x with W in the q4 layout of
kernels/matvec.py, for the one-token step's big projections, where the Triton matvec is latency-bound (Nsight
Compute, stop 20: one wave, 2-4 warps a scheduler, no eligible warp 34-50% of the cycles; its programs keep a few
KB a warp in flight).

CUDA C compiled by NVRTC (DESIGN: "CUDA C via NVRTC where Triton falls short"). One CTA an SM (``ctas_per_sm`` in
the rule), persistent: CTA c multiplies the row blocks c, c + G, ... of RB rows each. A block's nibble words and
its scales are two contiguous runs of the q4 buffer, so ONE thread moves a whole block (per weight) into a ring
slot with two ``cp.async.bulk`` copies that complete on the slot's mbarrier: STAGES blocks (tens of KB an SM) in
flight, with no registers held for them.

* Warp specialisation: the last warp only moves blocks. It requests the first STAGES blocks before the PDL wait
  (weights are not step data: kernels/pdl.py), then refills a slot once its "empty" mbarrier says the NC
  consumer warps have read it. The consumers form NG = NC / KS row groups of KS warps: group g multiplies rows
  g RPW .. g RPW + RPW - 1 of every block (RPW = RB / NG), its warp s the K slice s of KS (JS = K / 32 / KS
  chunks), lane l taking the slice's 32-input chunks l, l + 32, ...; a warp reduces its rows inside the warp.
  KS = 1: it stores them. KS > 1: the slices' sums meet in shared memory behind the group's named barrier and
  slice 0 adds them in slice order and stores (a K slice of a wide K fits registers: the down projection). No
  CTA-wide barrier after x is staged. MINB caps the registers so that MINB CTAs fit an SM (2: the next launch's
  CTA is resident, its first blocks in flight, while this one finishes).
* x is staged once per CTA after the wait, as f16x2 of x / 64 (NORM: x * rstd * (1 + nw) first, rstd from the
  producer's NP partial sums of squares, as kernels/q4_mma.py makes it); a lane keeps its chunks of x in
  registers when it has at most XREG_MAX of them, else reads them from shared memory once per block.
* The arithmetic is ``q4_matvec_ref``'s: per word, the four f16x2 (q - 8) pairs (kernels/q4_mma.py's
  conversion), the even and odd lanes' products summed in fp16 in input order, the two lanes added in fp32; a
  chunk's four words added in fp32 times its group's scale; the chunks summed in fp32 (lane order, then a
  shuffle tree) and times 64. Within 2e-7 of max |y| of the reference on the H200 (bench/results/stop31), like
  the Triton matvec (which sums its chunks in another order).
* Forms (constexprs): NORM + SWIGLU (rmsnorm_matmul_swiglu: gate and up blocks in one slot, y = silu(g) * u),
  ADD (matmul_add: s = r + W x, and each row group's RPW rows' sum of s^2: partial_rows = RPW, exposed as
  BLOCK_N), NORM (rmsnorm_matmul), none (matmul). Deterministic: every sum in a fixed order.

Measured on the H200 (bench/results/stop31, ``bench/q4stream_probe.py``: each kernel in a chain of programmatic
edges over weight copies that do not fit L2): see the launch rule's provenance in kernels/targets.py.
"""
from __future__ import annotations

import torch

from kestrel.kernels.matvec import q4_codes, q4_matvec_ref
from kestrel.kernels.q4_mma import CTA_RESERVED_SMEM, CudaKernel

BULK_MIN_CC = 90  # cp.async.bulk, mbarrier expect_tx and griddepcontrol: sm_90 on

# the shared-memory address, fp16, mbarrier and bulk-copy helpers, the norm's rstd from partials and one q4 word's
# value (bench/q4stream_probe.py uses them too)
DEVICE_HELPERS = r"""
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ float h2f(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
  return r;
}

__device__ __forceinline__ void bar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

__device__ __forceinline__ void bar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

/* a ring's ``stages`` slot pairs: "full" (the producer's one arrival and the copies' bytes), "empty" (``consumers``
   arrivals); one thread, before a CTA barrier */
__device__ __forceinline__ void ring_init(unsigned full, unsigned empty, int stages, unsigned consumers) {
  for (int s = 0; s < stages; ++s) {
    bar_init(full + 8 * s, 1);
    bar_init(empty + 8 * s, consumers);
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

/* the next phase of ``bar`` completes after ``bytes`` more bytes of bulk copies (and this arrival) */
__device__ __forceinline__ void bar_expect(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

/* ``bytes`` (a multiple of 16, both addresses 16-byte aligned) from global ``src`` to shared ``dst``, counted on ``bar`` */
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

__device__ __forceinline__ void bar_wait(unsigned bar, unsigned phase) {
  unsigned ok = 0;
  while (!ok)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(ok) : "r"(bar), "r"(phase) : "memory");
}

/* rstd = 1 / sqrt(mean(s^2) + eps) from the producer's np partial sums of s^2 over k inputs, summed in a fixed
   order by one warp (every lane returns it) */
__device__ __forceinline__ float partials_rstd(const float* ss, int np, int k, float eps, int lane) {
  float q = 0.f;
  for (int i = lane; i < np; i += 32) q += ss[i];
#pragma unroll
  for (int o = 16; o; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
  return rsqrtf(q / (float)k + eps);
}

/* one word's value as q4_matvec_ref defines it */
__device__ __forceinline__ float word_value(unsigned q, unsigned x01, unsigned x23, unsigned x45, unsigned x67) {
  unsigned p0, p1, p2, p3, a;
  const unsigned t = q >> 8;
  asm("lop3.b32 %0, %1, 0x000f000f, 0x64006400, 0xea;" : "=r"(p0) : "r"(q));
  asm("lop3.b32 %0, %1, 0x00f000f0, 0x64006400, 0xea;" : "=r"(p1) : "r"(q));
  asm("lop3.b32 %0, %1, 0x000f000f, 0x64006400, 0xea;" : "=r"(p2) : "r"(t));
  asm("lop3.b32 %0, %1, 0x00f000f0, 0x64006400, 0xea;" : "=r"(p3) : "r"(t));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(p0) : "r"(0x64086408u));
  asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(p1) : "r"(0x2c002c00u), "r"(0xd480d480u));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(p2) : "r"(0x64086408u));
  asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(p3) : "r"(0x2c002c00u), "r"(0xd480d480u));
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(a) : "r"(p0), "r"(x01));
  asm("fma.rn.f16x2 %0, %1, %2, %0;" : "+r"(a) : "r"(p1), "r"(x23));
  asm("fma.rn.f16x2 %0, %1, %2, %0;" : "+r"(a) : "r"(p2), "r"(x45));
  asm("fma.rn.f16x2 %0, %1, %2, %0;" : "+r"(a) : "r"(p3), "r"(x67));
  float lo, hi;
  asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(a));
  return lo + hi;
}

/* a 32-input chunk's value: its four words summed in fp32 (h0..h3: the chunk's x, four f16x2 words each) */
__device__ __forceinline__ float chunk_value(const uint4 v, const uint4 h0, const uint4 h1, const uint4 h2,
                                             const uint4 h3) {
  return ((word_value(v.x, h0.x, h0.y, h0.z, h0.w) + word_value(v.y, h1.x, h1.y, h1.z, h1.w))
          + word_value(v.z, h2.x, h2.y, h2.z, h2.w)) + word_value(v.w, h3.x, h3.y, h3.z, h3.w);
}
"""

SOURCE = r"""
#ifndef SWIGLU
#define SWIGLU 0
#endif
#ifndef ADD
#define ADD 0
#endif
#ifndef NORM
#define NORM 0
#define NP 1
#endif
#ifndef MINB
#define MINB 1                           /* CTAs an SM the registers are capped for (2: the next launch's CTA fits) */
#endif
#ifndef KS
#define KS 1                             /* consumer warps that split a row group's K between them */
#endif
#if SWIGLU
#define WSECOND w1                       /* the up weight (the issue loop's second; without SWIGLU not reached) */
#else
#define WSECOND w0
#endif
#define JC (K / 32)                      /* 32-input chunks a row: 16 bytes of nibbles each */
#define NGR (K / GROUP)
#define ROWB (K / 2)
#define SCB (NGR * 2)
#define NWT (SWIGLU ? 2 : 1)
#define BLK_W (RB * ROWB)
#define BLK_S (RB * SCB)
#define BLK (BLK_W + BLK_S)              /* one weight's block in a slot: its words, then its scales */
#define STAGE_BYTES (NWT * BLK)
#define RING_BYTES (STAGES * STAGE_BYTES)
#define NB (N / RB)
#define THREADS (32 * (NC + 1))
#define NG (NC / KS)                     /* row groups of a block */
#define RPW (RB / NG)                    /* rows of a row group */
#define JS (JC / KS)                     /* chunks of a warp's K slice */
#define CPT ((JS + 31) / 32)
#define CPG (GROUP / 32)
#define XREG (CPT <= XREG_MAX)
#define X_AT RING_BYTES                  /* word j of x: the f16x2 of x / 64 at inputs (0,1) (2,3) (4,5) (6,7) */
#define RSTD_AT (X_AT + 2 * K)
#define BAR_AT (RSTD_AT + 16)            /* full [STAGES], then empty [STAGES] */
#define RED_AT (BAR_AT + 16 * STAGES)    /* KS > 1: the K slices' sums [2][NG][KS][NWT][RPW] fp32 */

""" + DEVICE_HELPERS + r"""
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
ENTRY(const float* __restrict__ x,
#if NORM
      const float* __restrict__ ss_in, const float* __restrict__ nw,
#endif
      const unsigned char* __restrict__ w0,
#if SWIGLU
      const unsigned char* __restrict__ w1,
#endif
#if ADD
      const float* r_in,
#endif
      float* y,
#if ADD
      float* __restrict__ ss_out, int partial_rows,
#endif
#if NORM
      float eps,
#endif
      void* scratch0, void* scratch1) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = gridDim.x, c = blockIdx.x;
  const int mine = (NB - c + G - 1) / G;         /* this CTA's blocks: c, c + G, ... */
  const unsigned full = smem_u32(smem + BAR_AT), empty = full + 8 * STAGES, ring = smem_u32(smem);
  if (tid == 0) ring_init(full, empty, STAGES, NC);
  __syncthreads();
  /* the CTA's i-th block into slot i % STAGES: per weight its words and its scales, one bulk copy each */
  auto issue = [&](int i) {
    const int b = c + i * G, slot = i % STAGES;
    const unsigned bar = full + 8 * slot, dst = ring + slot * STAGE_BYTES;
    bar_expect(bar, STAGE_BYTES);
#pragma unroll
    for (int t = 0; t < NWT; ++t) {
      const unsigned char* wt = t ? WSECOND : w0;
      bulk_copy(dst + t * BLK, wt + (size_t)b * BLK_W, BLK_W, bar);
      bulk_copy(dst + t * BLK + BLK_W, wt + (size_t)N * ROWB + (size_t)b * BLK_S, BLK_S, bar);
    }
  };
  if (warp == NC && lane == 0)
    for (int i = 0; i < STAGES && i < mine; ++i) issue(i);
#if PDL
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  float* rstd = (float*)(smem + RSTD_AT);
#if NORM
  if (warp == 0) {                               /* rstd from the producer's partials, in a fixed order */
    const float q = partials_rstd(ss_in, NP, K, eps, lane);
    if (lane == 0) rstd[0] = q;
  }
  __syncthreads();
#endif
  uint4* X16 = (uint4*)(smem + X_AT);
  for (int j = tid; j < K / 8; j += THREADS) {
    float4 a = __ldcg((const float4*)(x + 8 * j)), b = __ldcg((const float4*)(x + 8 * j + 4));
#if NORM
    const float q = rstd[0];
    const float4 na = *(const float4*)(nw + 8 * j), nb = *(const float4*)(nw + 8 * j + 4);
    a = make_float4(a.x * q * (1.f + na.x), a.y * q * (1.f + na.y), a.z * q * (1.f + na.z), a.w * q * (1.f + na.w));
    b = make_float4(b.x * q * (1.f + nb.x), b.y * q * (1.f + nb.y), b.z * q * (1.f + nb.z), b.w * q * (1.f + nb.w));
#endif
    X16[j] = make_uint4(pack_half2(a.x * 0.015625f, a.y * 0.015625f), pack_half2(a.z * 0.015625f, a.w * 0.015625f),
                        pack_half2(b.x * 0.015625f, b.y * 0.015625f), pack_half2(b.z * 0.015625f, b.w * 0.015625f));
  }
  __syncthreads();
  if (warp == NC) {                              /* the producer: refill each slot once its consumers have read it */
    if (lane == 0)
      for (int i = STAGES; i < mine; ++i) {
        const int slot = i % STAGES;
        bar_wait(empty + 8 * slot, ((i / STAGES) - 1) & 1);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        issue(i);
      }
    return;
  }
  const int grp = warp / KS, sl = warp % KS, c0 = sl * JS;  /* this warp's row group and K slice */
#if XREG
  uint4 xh[CPT][4];
#pragma unroll
  for (int k = 0; k < CPT; ++k) {
    const int j = lane + 32 * k;
#pragma unroll
    for (int u = 0; u < 4; ++u) xh[k][u] = j < JS ? X16[4 * (c0 + j) + u] : make_uint4(0u, 0u, 0u, 0u);
  }
#endif
  for (int i = 0; i < mine; ++i) {
    const int slot = i % STAGES, b = c + i * G;
    bar_wait(full + 8 * slot, (i / STAGES) & 1);
    const unsigned char* st = smem + slot * STAGE_BYTES;
    float acc[NWT][RPW];
#pragma unroll
    for (int t = 0; t < NWT; ++t)
#pragma unroll
      for (int q = 0; q < RPW; ++q) acc[t][q] = 0.f;
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const int ch = c0 + lane + 32 * k;
      if (lane + 32 * k < JS) {
#if XREG
        const uint4 h0 = xh[k][0], h1 = xh[k][1], h2 = xh[k][2], h3 = xh[k][3];
#else
        const uint4 h0 = X16[4 * ch], h1 = X16[4 * ch + 1], h2 = X16[4 * ch + 2], h3 = X16[4 * ch + 3];
#endif
#pragma unroll
        for (int t = 0; t < NWT; ++t) {
          const uint4* W4 = (const uint4*)(st + t * BLK);
          const unsigned short* S = (const unsigned short*)(st + t * BLK + BLK_W);
#pragma unroll
          for (int q = 0; q < RPW; ++q) {
            const int r = grp * RPW + q;
            acc[t][q] = fmaf(chunk_value(W4[r * JC + ch], h0, h1, h2, h3), h2f(S[r * NGR + ch / CPG]), acc[t][q]);
          }
        }
      }
    }
    __syncwarp();
    if (lane == 0) bar_arrive(empty + 8 * slot);
#pragma unroll
    for (int o = 16; o; o >>= 1)
#pragma unroll
      for (int t = 0; t < NWT; ++t)
#pragma unroll
        for (int q = 0; q < RPW; ++q) acc[t][q] += __shfl_xor_sync(0xffffffffu, acc[t][q], o);
#if KS > 1
    {                                            /* the group's K slices meet in shared memory, summed in slice order */
      float* red = (float*)(smem + RED_AT) + ((i & 1) * NG + grp) * KS * NWT * RPW;
      if (lane == 0)
#pragma unroll
        for (int t = 0; t < NWT; ++t)
#pragma unroll
          for (int q = 0; q < RPW; ++q) red[(sl * NWT + t) * RPW + q] = acc[t][q];
      /* the group's warps only (barrier 1 + grp); two buffers by block parity: a slice writes block i + 2's sums
         only after block i + 1's barrier, which slice 0 reaches after reading block i's */
      asm volatile("bar.sync %0, %1;" ::"r"(1 + grp), "r"(32 * KS) : "memory");
      if (sl != 0) continue;
#pragma unroll
      for (int t = 0; t < NWT; ++t)
#pragma unroll
        for (int q = 0; q < RPW; ++q) {
          float v = red[t * RPW + q];
          for (int j = 1; j < KS; ++j) v += red[(j * NWT + t) * RPW + q];
          acc[t][q] = v;
        }
    }
#endif
    const int row0 = b * RB + grp * RPW;
    float out[RPW];
#pragma unroll
    for (int q = 0; q < RPW; ++q) {
#if SWIGLU
      const float g = 64.f * acc[0][q], u = 64.f * acc[NWT - 1][q];
      out[q] = g / (1.f + expf(-g)) * u;
#else
      out[q] = 64.f * acc[0][q];
#endif
#if ADD
      out[q] = r_in[row0 + q] + out[q];
#endif
    }
    float v = out[0];
#pragma unroll
    for (int q = 1; q < RPW; ++q) v = lane == q ? out[q] : v;
    if (lane < RPW) y[row0 + lane] = v;
#if ADD
    if (lane == 0) {                             /* the group's RPW rows: one partial, in row order */
      float sq = 0.f;
#pragma unroll
      for (int q = 0; q < RPW; ++q) sq += out[q] * out[q];
      ss_out[row0 / RPW] = sq;
    }
#endif
  }
}
"""

XREG_MAX = 5  # chunks of x a lane keeps in registers (16 each); more: read from shared memory per block


def shared_bytes(c: dict) -> int:
    """The ring (STAGES slots of RB rows of each weight: words and scales), the staged x (2 K bytes), rstd, the
    2 STAGES mbarriers, and with KS > 1 the K slices' sums (two blocks' worth)."""
    k, nwt, ks = c["K"], 2 if c.get("SWIGLU") else 1, c.get("KS", 1)
    block = c["RB"] * (k // 2 + k // c["GROUP"] * 2)
    red = 2 * c["RB"] * ks * nwt * 4 if ks > 1 else 0  # 2 x NG x KS x NWT x RPW floats, RPW = RB / NG
    return c["STAGES"] * nwt * block + 2 * k + 16 + 16 * c["STAGES"] + red


def _check_grid(grid, n: int, rb: int) -> None:
    assert 1 <= grid[0] <= n // rb and list(grid[1:]) == [1, 1] and n % rb == 0, f"grid {grid}"


def _emulate(grid, *args, N, K, GROUP, RB, STAGES, NC, SWIGLU=0, ADD=0, NORM=0, NP=0, BLOCK_N=0, XREG_MAX=XREG_MAX,
             MINB=1, KS=1, PDL=False):
    """A launch on the CPU (the launch-plan tests): the operands in the op's order; the product
    ``q4_matvec_ref``'s, NORM's rstd from the NP partials, ADD's partials over BLOCK_N (= RB / (NC / KS)) rows."""
    _check_grid(grid, N, RB)
    a = list(args)
    x = a.pop(0)
    if NORM:
        ss_in, nw = a.pop(0), a.pop(0)
    ws = [a.pop(0) for _ in range(2 if SWIGLU else 1)]
    r = a.pop(0) if ADD else None
    y = a.pop(0)
    xv = x[:K].float()
    if ADD:
        ss_out, partial_rows = a.pop(0), a.pop(0)
        assert partial_rows == BLOCK_N == RB // (NC // KS)
    if NORM:
        eps = a.pop(0)
        rstd = torch.rsqrt(ss_in[:NP].double().sum() / K + eps).float()
        xv = xv * rstd * (1.0 + nw[:K].float())
    outs = [q4_matvec_ref(xv, *q4_codes(w[:N * K // 2 + N * (K // GROUP) * 2], N, K, GROUP), GROUP) for w in ws]
    v = outs[0] / (1.0 + torch.exp(-outs[0])) * outs[1] if SWIGLU else outs[0]
    if ADD:
        v = r[:N].float() + v
        ss_out[:N // BLOCK_N] = (v.double() ** 2).reshape(-1, BLOCK_N).sum(-1).float()
    y[:N] = v


_CONSTS = ("N", "K", "GROUP", "RB", "STAGES", "NC", "XREG_MAX", "PDL")  # (MINB, KS: optional, 1 when absent)
Q4STREAM = CudaKernel("q4stream", __name__, SOURCE, ("x_ptr", "w_ptr", "y_ptr"), _CONSTS,
                      shared_bytes, _emulate)
Q4STREAM_ADD = CudaKernel("q4stream_add", __name__, SOURCE,
                          ("x_ptr", "w_ptr", "r_ptr", "s_ptr", "ss_ptr", "partial_rows"), _CONSTS + ("ADD", "BLOCK_N"),
                          shared_bytes, _emulate)
Q4STREAM_NORM = CudaKernel("q4stream_norm", __name__, SOURCE,
                           ("x_ptr", "ss_ptr", "nw_ptr", "w_ptr", "y_ptr", "eps"), _CONSTS + ("NORM", "NP"),
                           shared_bytes, _emulate)
Q4STREAM_NORM_SWIGLU = CudaKernel("q4stream_norm_swiglu", __name__, SOURCE,
                                  ("x_ptr", "ss_ptr", "nw_ptr", "wg_ptr", "wu_ptr", "y_ptr", "eps"),
                                  _CONSTS + ("NORM", "NP", "SWIGLU"), shared_bytes, _emulate)
# the kernel table names these through jit_name ("kestrel.kernels.q4_stream:q4stream")
q4stream = Q4STREAM
q4stream_add = Q4STREAM_ADD
q4stream_norm = Q4STREAM_NORM
q4stream_norm_swiglu = Q4STREAM_NORM_SWIGLU


def launch(n: int, k: int, group: int, rb: int, stages: int, nc: int, sms: int, pair: bool = False, add: bool = False,
           norm: bool = False, partials: int = 0, minb: int = 1, ks: int = 1) -> dict:
    """The launch of one configuration (the rule's, or a sweep's): min(N / RB, ``sms``) CTAs of NC + 1 warps (NC / KS
    row groups of KS warps, each warp one K slice), their registers capped for ``minb`` CTAs an SM."""
    assert (n % rb == 0 and nc % ks == 0 and rb % (nc // ks) == 0 and nc // ks < 16 and k % 32 == 0
            and (k // 32) % ks == 0 and k % group == 0), (n, k, group, rb, nc, ks)
    c = {"N": n, "K": k, "GROUP": group, "RB": rb, "STAGES": stages, "NC": nc, "XREG_MAX": XREG_MAX}
    if minb != 1:
        c["MINB"] = minb
    if ks != 1:
        c["KS"] = ks
    if pair:
        c["SWIGLU"] = 1
    if add:
        c |= {"ADD": 1, "BLOCK_N": rb // (nc // ks)}
    if norm:
        c |= {"NORM": 1, "NP": partials}
    return {"grid": [min(n // rb, sms), 1, 1], "num_warps": nc + 1, "constexprs": c}


def bulk_aligned(n: int, k: int, group: int, rb: int) -> bool:
    """A block's words and scales are whole 16-byte runs (the bulk copy's unit)."""
    return (rb * k // 2) % 16 == 0 and (rb * (k // group) * 2) % 16 == 0


def stream_launch(n: int, k: int, group: int, target, pair: bool = False, add: bool = False, norm: bool = False,
                  partials: int = 0) -> dict | None:
    """The launch of this kernel for a one-row q4 product [N, K] (``pair`` with ``norm``: rmsnorm + the gate / up
    pair; ``add``: matmul_add; ``norm``: rmsnorm_matmul; neither: matmul), or None where the target's ``q4_stream``
    rule does not run it: the form switched off (the unnormed pair has no form: fuse always folds its norm), a
    target without the bulk copy engine, N below ``min_rows`` or not a multiple of the block, K outside [``min_k``,
    ``max_k``] (``add`` above ``max_k``: the ``wide`` form, up to ``wide_max_k``), a split that does not divide the
    shape, or a ring that does not fit the target's shared memory. The pair takes the rule's ``pair_*`` split, the
    wide form its ``wide_*`` split, the others its ``rb`` / ``stages`` / ``nc`` / ``ks`` / ``minb``."""
    r = target.rules.get("q4_stream")
    wide = r is not None and add and r.max_k < k
    on = r is not None and (r.pair if pair and norm else (r.wide and k <= r.wide_max_k) if wide else r.add if add
                            else r.norm_plain if norm else r.plain and not pair)
    if (not on or not group or target.cc < BULK_MIN_CC or n < r.min_rows or not (r.min_k <= k <= r.max_k or wide)
            or k % group or k % 32):
        return None
    rb, stages, nc, ks, minb = ((r.pair_rb, r.pair_stages, r.pair_nc, r.pair_ks, r.pair_minb) if pair else
                                (r.wide_rb, r.wide_stages, r.wide_nc, r.wide_ks, r.wide_minb) if wide else
                                (r.rb, r.stages, r.nc, r.ks, r.minb))
    if (n % rb or nc % ks or rb % (nc // ks) or nc // ks >= 16 or (k // 32) % ks
            or not bulk_aligned(n, k, group, rb)):
        return None
    out = launch(n, k, group, rb, stages, nc, target.sms, pair, add, norm, partials, minb, ks)
    if shared_bytes(out["constexprs"]) + CTA_RESERVED_SMEM > target.smem_optin:
        return None
    return out
