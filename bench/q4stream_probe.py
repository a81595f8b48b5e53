"""Probe (issue 13 part 3): is the one-row q4 matvec's gap to the read bandwidth a matter of bytes in flight?

Nsight Compute (stop 20) had every q4 matvec of the 27B step latency-bound: one wave, 1.9-4.5 warps a
scheduler, no eligible warp 34-50% of the cycles, 11-28% occupancy; the tensor-core form (stop 28) moved bytes
at the same 3.3 TB/s with a fifth of the instructions. Both keep at most a few KB per warp in flight.

This kernel (CUDA C through NVRTC, the product's ABI: x fp32 [K], the q4 buffer of kernels/matvec.py, y fp32
[N]) keeps tens of KB per SM in flight with the Hopper bulk copy engine:

* persistent: grid = SMs x ``CPS``; CTA c takes the row blocks c, c + G, ... of RB rows each. A block's nibble
  words and its scales are two contiguous runs of the q4 buffer, so one thread moves a whole block into a
  ring slot with two ``cp.async.bulk`` copies completing on the slot's mbarrier; STAGES slots in flight;
* the first STAGES blocks are requested before ``griddepcontrol.wait`` (weights are not step data), and the
  CTA lets the next launch in at its start: compiled for two CTAs an SM (``__launch_bounds__(.., 2)``, the
  ring sized for it), the next launch's CTAs are resident and streaming their first blocks while this one
  finishes (stop 30's persistent_probe: residency needed the register cap);
* x is quantised once per CTA to int8 per 32-input chunk (scale max|x| / 127, round to nearest even), the
  llama.cpp Q8_1 way, and each 32-bit q4 word takes 2 LOP3 + 1 SHF + 2 DP4A (unsigned nibbles times signed x
  bytes; the -8 offset as -8 * sum(x8) per chunk): ~0.75 instructions a weight against the f16x2 kernel's 2.8;
* a thread owns CPT chunks of x (in registers) and multiplies them into RB / WR rows of every block; the warps'
  sums meet in shared memory in a fixed order (deterministic).

Checked on the device against a float64 emulation of exactly that arithmetic (``q8_ref``; wsf16: q4_matvec_ref) and the
exact product; timed alone and in a chain of programmatic edges (bench/graph_timing.py, rotating weight
copies so each launch reads DRAM), beside the Triton matvec the launch rule picks, in the same call.

Here (no GPU):   python bench/q4stream_probe.py compile bench/q4stream-cubins
On the device:   cd bench && python3 q4stream_probe.py time q4stream-cubins $OUT/q4stream.json
                 (run's carry=["bench/q4stream-cubins"]; the folder is git-ignored)
The product's fused forms (kernels/q4_stream.py) against the Triton kernels the step runs:
                 python bench/q4stream_probe.py compile-forms bench/q4stream-forms
                 cd bench && python3 q4stream_probe.py time-forms q4stream-forms $OUT/forms.json
The 27B GDN layer's four products chained in step order, each by Triton or q4_stream (registers for 1 or 2 CTAs):
                 python bench/q4stream_probe.py compile-layer bench/q4stream-layer
                 cd bench && python3 q4stream_probe.py time-layer q4stream-layer $OUT/layer.json
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import sys

GROUP = 128
SMS = 132
SMEM_PER_SM = 228 * 1024
CASES = [("27b in_proj", 16480, 5120), ("27b gate", 17408, 5120), ("27b out_proj", 5120, 6144),
         ("27b down", 5120, 17408), ("0.8b in_proj", 6144, 1024), ("0.8b gate", 3584, 1024),
         ("0.8b down", 1024, 3584), ("0.8b out_proj", 1024, 2048)]
PARAMS = ("x", "w", "y")
RBS, STAGES, WKS, WRS = (2, 4, 8, 16), (3, 4, 6), (1, 2, 4, 8), (1, 2)
WS_RBS = (4, 8, 16, 32)
CONSTS = ("N", "K", "GROUP", "RB", "STAGES", "WK", "WR", "CPS", "MINB", "PDL")
CONSTS_WS = ("N", "K", "GROUP", "RB", "STAGES", "NC", "CPS", "MINB", "PDL")
# KESTREL_PROBE_KINDS: which kernels the compile step sweeps (matvec: the Triton rule's; stream: v1; ws: v2)
KINDS = os.environ.get("KESTREL_PROBE_KINDS", "matvec,stream,ws").split(",")
# v1's best per shape in call 1 (bench/results/stop31/call1), kept as the reference point when v1 is not swept
V1_BEST = [(8, 3, 8, 2, 1), (2, 3, 8, 2, 1), (16, 6, 1, 2, 2)]

from kestrel.kernels.q4_stream import DEVICE_HELPERS  # noqa: E402 - the product kernel's helpers

# the product kernel's helpers, and the int8 forms' (x packed to match the nibble order: lo bytes 0 4 1 5, hi 2 6 3 7)
_HELPERS = DEVICE_HELPERS + r"""
__device__ __forceinline__ int dp4a_us(unsigned a, unsigned b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ unsigned pack4(int a, int b, int c, int d) {
  return (unsigned)(a & 255) | ((unsigned)(b & 255) << 8) | ((unsigned)(c & 255) << 16) | ((unsigned)(d & 255) << 24);
}

/* x to int8 per 32-input chunk (scale max |x| / 127, nearest even), packed in the nibble order, with each chunk's
   scale and -8 * sum(x8): chunks first, first + step, ... (JC: the source's chunks a row) */
__device__ __forceinline__ void stage_x8(const float* __restrict__ x, unsigned* x8, float* xs, int* xz, int first,
                                         int step) {
  for (int ch = first; ch < JC; ch += step) {
    float v[32];
    const float4* src = (const float4*)(x + 32 * ch);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float4 f = __ldcg(src + i);
      v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
    }
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < 32; ++i) m = fmaxf(m, fabsf(v[i]));
    const float inv = m > 0.f ? 127.f / m : 0.f;
    int q[32], s = 0;
#pragma unroll
    for (int i = 0; i < 32; ++i) { q[i] = __float2int_rn(v[i] * inv); s += q[i]; }
#pragma unroll
    for (int u = 0; u < 4; ++u) {                /* lo bytes: inputs 0 4 1 5; hi bytes: 2 6 3 7 (Q4_NIBBLE) */
      const int* e = q + 8 * u;
      x8[2 * (4 * ch + u)] = pack4(e[0], e[4], e[1], e[5]);
      x8[2 * (4 * ch + u) + 1] = pack4(e[2], e[6], e[3], e[7]);
    }
    xs[ch] = m / 127.f;
    xz[ch] = -8 * s;
  }
}

__device__ __forceinline__ int chunk_dot(const uint4 v, const uint2 x0, const uint2 x1, const uint2 x2, const uint2 x3,
                                         int d) {
  d = dp4a_us(v.x & 0x0f0f0f0fu, x0.x, d);
  d = dp4a_us((v.x >> 4) & 0x0f0f0f0fu, x0.y, d);
  d = dp4a_us(v.y & 0x0f0f0f0fu, x1.x, d);
  d = dp4a_us((v.y >> 4) & 0x0f0f0f0fu, x1.y, d);
  d = dp4a_us(v.z & 0x0f0f0f0fu, x2.x, d);
  d = dp4a_us((v.z >> 4) & 0x0f0f0f0fu, x2.y, d);
  d = dp4a_us(v.w & 0x0f0f0f0fu, x3.x, d);
  d = dp4a_us((v.w >> 4) & 0x0f0f0f0fu, x3.y, d);
  return d;
}
"""

SOURCE = r"""
#define JC (K / 32)                      /* 32-input chunks a row (16 bytes of nibbles each) */
#define NGR (K / GROUP)
#define ROWB (K / 2)
#define SCB (NGR * 2)
#define STAGE_W (RB * ROWB)
#define STAGE_S (RB * SCB)
#define STAGE_BYTES (STAGE_W + STAGE_S)
#define RING_BYTES (STAGES * STAGE_BYTES)
#define NB (N / RB)
#define THREADS (32 * WK * WR)
#define RPT (RB / WR)
#define CPT ((JC + 32 * WK - 1) / (32 * WK))
#define CPG (GROUP / 32)
#define X_AT RING_BYTES                  /* x8: K bytes, word j as (xa, xb) */
#define XS_AT (X_AT + K)                 /* per chunk: its scale (float), -8 * sum(x8) (int) */
#define XZ_AT (XS_AT + 4 * JC)
#define RED_AT (XZ_AT + 4 * JC)          /* two sets of RB x WK partial sums */
#define BAR_AT ((RED_AT + 8 * RB * WK + 7) / 8 * 8)

""" + _HELPERS + r"""
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
ENTRY(const float* __restrict__ x, const unsigned char* __restrict__ w, float* __restrict__ y, void* scratch0,
      void* scratch1) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wk = warp % WK, wr = warp / WK;
  const int G = gridDim.x, c = blockIdx.x;
  const int mine = (NB - c + G - 1) / G;         /* blocks c, c + G, ... */
  const unsigned bars = smem_u32(smem + BAR_AT);
  const unsigned ring = smem_u32(smem);
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) bar_init(bars + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int i) {                      /* the CTA's i-th block into slot i % STAGES */
    const int b = c + i * G, slot = i % STAGES;
    const unsigned bar = bars + 8 * slot, dst = ring + slot * STAGE_BYTES;
    bar_expect(bar, STAGE_BYTES);
    bulk_copy(dst, w + (size_t)b * STAGE_W, STAGE_W, bar);
    bulk_copy(dst + STAGE_W, w + (size_t)N * ROWB + (size_t)b * STAGE_S, STAGE_S, bar);
  };
  if (tid == 0)
    for (int i = 0; i < STAGES && i < mine; ++i) issue(i);
#if PDL
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  /* x to int8 per chunk: thread t quantises chunks t, t + THREADS, ... */
  unsigned* x8 = (unsigned*)(smem + X_AT);
  float* xs = (float*)(smem + XS_AT);
  int* xz = (int*)(smem + XZ_AT);
  stage_x8(x, x8, xs, xz, tid, THREADS);
  __syncthreads();
  uint2 xr[CPT][4];
  float xsr[CPT];
  int xzr[CPT];
#pragma unroll
  for (int i = 0; i < CPT; ++i) {
    const int ch = wk * 32 + lane + 32 * WK * i;
    const bool ok = ch < JC;
#pragma unroll
    for (int u = 0; u < 4; ++u) xr[i][u] = ok ? ((const uint2*)x8)[4 * ch + u] : make_uint2(0u, 0u);
    xsr[i] = ok ? xs[ch] : 0.f;
    xzr[i] = ok ? xz[ch] : 0;
  }
  float* red = (float*)(smem + RED_AT);
  for (int i = 0; i < mine; ++i) {
    const int slot = i % STAGES, b = c + i * G;
    bar_wait(bars + 8 * slot, (i / STAGES) & 1);
    const unsigned char* st = smem + slot * STAGE_BYTES;
    const uint4* W4 = (const uint4*)st;
    const unsigned short* S = (const unsigned short*)(st + STAGE_W);
    float acc[RPT];
#pragma unroll
    for (int q = 0; q < RPT; ++q) {
      const int r = wr + WR * q;
      float a = 0.f;
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const int ch = wk * 32 + lane + 32 * WK * k;
        if (ch < JC) {
          const uint4 v = W4[r * JC + ch];
          int d = xzr[k];
          d = dp4a_us(v.x & 0x0f0f0f0fu, xr[k][0].x, d);
          d = dp4a_us((v.x >> 4) & 0x0f0f0f0fu, xr[k][0].y, d);
          d = dp4a_us(v.y & 0x0f0f0f0fu, xr[k][1].x, d);
          d = dp4a_us((v.y >> 4) & 0x0f0f0f0fu, xr[k][1].y, d);
          d = dp4a_us(v.z & 0x0f0f0f0fu, xr[k][2].x, d);
          d = dp4a_us((v.z >> 4) & 0x0f0f0f0fu, xr[k][2].y, d);
          d = dp4a_us(v.w & 0x0f0f0f0fu, xr[k][3].x, d);
          d = dp4a_us((v.w >> 4) & 0x0f0f0f0fu, xr[k][3].y, d);
          const float sc = h2f(S[r * NGR + ch / CPG]);
          a = fmaf((float)d, xsr[k] * sc, a);
        }
      }
      acc[q] = a;
    }
#pragma unroll
    for (int o = 16; o; o >>= 1) {
#pragma unroll
      for (int q = 0; q < RPT; ++q) acc[q] += __shfl_xor_sync(0xffffffffu, acc[q], o);
    }
    float* rd = red + (i & 1) * RB * WK;
    if (lane == 0) {
#pragma unroll
      for (int q = 0; q < RPT; ++q) rd[(wr + WR * q) * WK + wk] = acc[q];
    }
    __syncthreads();                             /* slot read, partial sums written */
    if (tid == 0 && i + STAGES < mine) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(i + STAGES);
    }
    if (tid < RB) {
      float s = 0.f;
      for (int k = 0; k < WK; ++k) s += rd[tid * WK + k];
      y[(size_t)b * RB + tid] = s;
    }
  }
}
"""


# v2 (kind "ws"): warp-specialised. Warp NC (the last) only moves blocks: it waits for a slot's "empty" barrier
# (its NC consumer warps each arrive once they have read it) and refills it. Consumer warp w multiplies rows
# w, w + NC, ... of every block over the whole K (lane l: chunks l, l + 32, ...), reduces them inside the warp and
# stores them: no CTA-wide barrier after x is staged. x stays in registers when a lane has at most 6 chunks
# (XREG), else it is read from shared memory per chunk (once for the warp's RB / NC rows). int8 x with DP4A; its
# fp16-lane twin (kind "wsf16", q4_matvec_ref's arithmetic) is the product kernel, kernels/q4_stream.py, whose plain
# form this probe times (call 3 ran an earlier copy of it here, at commit 4ee1296).
SOURCE_WS = r"""
#define JC (K / 32)
#define NGR (K / GROUP)
#define ROWB (K / 2)
#define SCB (NGR * 2)
#define STAGE_W (RB * ROWB)
#define STAGE_S (RB * SCB)
#define STAGE_BYTES (STAGE_W + STAGE_S)
#define RING_BYTES (STAGES * STAGE_BYTES)
#define NB (N / RB)
#define THREADS (32 * (NC + 1))
#define RPW (RB / NC)
#define CPT ((JC + 31) / 32)
#define CPG (GROUP / 32)
#define XREG (CPT <= 6)
#define X_AT RING_BYTES
#define XS_AT (X_AT + K)
#define XZ_AT (XS_AT + 4 * JC)
#define BAR_AT ((XZ_AT + 4 * JC + 7) / 8 * 8)   /* full [STAGES], then empty [STAGES] */

""" + _HELPERS + r"""
extern "C" __global__ void __launch_bounds__(THREADS, MINB)
ENTRY(const float* __restrict__ x, const unsigned char* __restrict__ w, float* __restrict__ y, void* scratch0,
      void* scratch1) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = gridDim.x, c = blockIdx.x;
  const int mine = (NB - c + G - 1) / G;
  const unsigned full = smem_u32(smem + BAR_AT), empty = full + 8 * STAGES;
  const unsigned ring = smem_u32(smem);
  if (tid == 0) ring_init(full, empty, STAGES, NC);
  __syncthreads();
  auto issue = [&](int i) {
    const int b = c + i * G, slot = i % STAGES;
    const unsigned bar = full + 8 * slot, dst = ring + slot * STAGE_BYTES;
    bar_expect(bar, STAGE_BYTES);
    bulk_copy(dst, w + (size_t)b * STAGE_W, STAGE_W, bar);
    bulk_copy(dst + STAGE_W, w + (size_t)N * ROWB + (size_t)b * STAGE_S, STAGE_S, bar);
  };
  if (warp == NC && lane == 0)
    for (int i = 0; i < STAGES && i < mine; ++i) issue(i);
#if PDL
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  unsigned* x8 = (unsigned*)(smem + X_AT);
  float* xs = (float*)(smem + XS_AT);
  int* xz = (int*)(smem + XZ_AT);
  stage_x8(x, x8, xs, xz, tid, THREADS);
  __syncthreads();
  if (warp == NC) {                              /* the producer */
    if (lane == 0)
      for (int i = STAGES; i < mine; ++i) {
        const int slot = i % STAGES;
        bar_wait(empty + 8 * slot, ((i / STAGES) - 1) & 1);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        issue(i);
      }
    return;
  }
  const uint2* X2 = (const uint2*)x8;
#if XREG
  uint2 xr[CPT][4];
  float xsr[CPT];
  int xzr[CPT];
#pragma unroll
  for (int k = 0; k < CPT; ++k) {
    const int ch = lane + 32 * k;
    const bool ok = ch < JC;
#pragma unroll
    for (int u = 0; u < 4; ++u) xr[k][u] = ok ? X2[4 * ch + u] : make_uint2(0u, 0u);
    xsr[k] = ok ? xs[ch] : 0.f;
    xzr[k] = ok ? xz[ch] : 0;
  }
#endif
  for (int i = 0; i < mine; ++i) {
    const int slot = i % STAGES, b = c + i * G;
    bar_wait(full + 8 * slot, (i / STAGES) & 1);
    const unsigned char* st = smem + slot * STAGE_BYTES;
    const uint4* W4 = (const uint4*)st;
    const unsigned short* S = (const unsigned short*)(st + STAGE_W);
    float acc[RPW];
#pragma unroll
    for (int q = 0; q < RPW; ++q) acc[q] = 0.f;
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const int ch = lane + 32 * k;
      if (ch < JC) {
#if XREG
        const uint2 x0 = xr[k][0], x1 = xr[k][1], x2 = xr[k][2], x3 = xr[k][3];
        const float xsc = xsr[k];
        const int z = xzr[k];
#else
        const uint2 x0 = X2[4 * ch], x1 = X2[4 * ch + 1], x2 = X2[4 * ch + 2], x3 = X2[4 * ch + 3];
        const float xsc = xs[ch];
        const int z = xz[ch];
#endif
#pragma unroll
        for (int q = 0; q < RPW; ++q) {
          const int r = warp + NC * q;
          const int d = chunk_dot(W4[r * JC + ch], x0, x1, x2, x3, z);
          acc[q] = fmaf((float)d, xsc * h2f(S[r * NGR + ch / CPG]), acc[q]);
        }
      }
    }
    __syncwarp();
    if (lane == 0) bar_arrive(empty + 8 * slot);
#pragma unroll
    for (int o = 16; o; o >>= 1) {
#pragma unroll
      for (int q = 0; q < RPW; ++q) acc[q] += __shfl_xor_sync(0xffffffffu, acc[q], o);
    }
    if (lane < RPW) {
      float v = acc[0];
#pragma unroll
      for (int q = 1; q < RPW; ++q) v = lane == q ? acc[q] : v;
      y[(size_t)b * RB + warp + NC * lane] = v;
    }
  }
}
"""


def shared_bytes_ws(c: dict) -> int:
    k, rb = c["K"], c["RB"]
    stage = rb * (k // 2 + k // c["GROUP"] * 2)
    return (c["STAGES"] * stage + k + 8 * (k // 32) + 7) // 8 * 8 + 16 * c["STAGES"]


def shared_bytes(c: dict) -> int:
    k, rb = c["K"], c["RB"]
    stage = rb * (k // 2 + k // c["GROUP"] * 2)
    red_at = c["STAGES"] * stage + k + 8 * (k // 32)
    return (red_at + 8 * rb * c["WK"] + 7) // 8 * 8 + 8 * c["STAGES"]


def valid(n: int, k: int, rb: int, stages: int, wk: int, wr: int, minb: int) -> bool:
    jc = k // 32
    cpt = -(-jc // (32 * wk))
    c = {"K": k, "RB": rb, "GROUP": GROUP, "STAGES": stages, "WK": wk}
    return (n % rb == 0 and rb % wr == 0 and (rb * k // GROUP * 2) % 16 == 0 and cpt <= 6
            and 32 * wk * wr <= 1024 and minb * (shared_bytes(c) + 1024) <= SMEM_PER_SM
            and (cpt - 1) * 32 * wk < jc)


def stream_launch(n: int, k: int, rb: int, stages: int, wk: int, wr: int, cps: int, minb: int) -> dict:
    c = dict(N=n, K=k, GROUP=GROUP, RB=rb, STAGES=stages, WK=wk, WR=wr, CPS=cps, MINB=minb)
    return {"grid": [min(n // rb, SMS * cps), 1, 1], "num_warps": wk * wr, "constexprs": c}


def _kernel(kind: str = "stream"):
    from kestrel.kernels.q4_mma import CudaKernel

    if kind == "ws":
        return CudaKernel("q4ws", "bench.q4stream_probe", SOURCE_WS, PARAMS, CONSTS_WS, shared_bytes_ws, None)
    return CudaKernel("q4stream", "bench.q4stream_probe", SOURCE, PARAMS, CONSTS, shared_bytes, None)


def ws_launch(n: int, k: int, rb: int, stages: int, nc: int, cps: int, minb: int) -> dict | None:
    c = dict(N=n, K=k, GROUP=GROUP, RB=rb, STAGES=stages, NC=nc, CPS=cps, MINB=minb)
    if n % rb or rb % nc or (rb * k // GROUP * 2) % 16 or cps * (shared_bytes_ws(c) + 1024) > SMEM_PER_SM:
        return None
    if minb * (shared_bytes_ws(c) + 1024) > SMEM_PER_SM or 32 * (nc + 1) * minb > 2048:
        return None
    return {"grid": [min(n // rb, SMS * cps), 1, 1], "num_warps": nc + 1, "constexprs": c}


def _jobs():
    from kestrel.kernels import q4_stream
    from kestrel.kernels.matvec import matvec_launch
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    for name, n, k in CASES:
        if "matvec" in KINDS:
            yield name, n, k, "matvec", matvec_launch(n, k, GROUP, t)
        v1 = itertools.product(RBS, STAGES, WKS, WRS, (1, 2)) if "stream" in KINDS else V1_BEST
        for rb, stages, wk, wr, cps in v1:
            minb = 2
            if valid(n, k, rb, stages, wk, wr, minb) and (cps == 1 or 2 * (shared_bytes(
                    {"K": k, "RB": rb, "GROUP": GROUP, "STAGES": stages, "WK": wk}) + 1024) <= SMEM_PER_SM):
                yield name, n, k, "stream", stream_launch(n, k, rb, stages, wk, wr, cps, minb)
        if "ws" in KINDS:
            for rb, stages, nc, cps, minb in itertools.product(WS_RBS, (2, 3, 4, 6), (2, 4, 8, 16), (1, 2), (1, 2)):
                launch = ws_launch(n, k, rb, stages, nc, cps, minb)
                if launch is not None:
                    yield name, n, k, "ws", launch
        if "wsf16" in KINDS:  # q4_matvec_ref's arithmetic: the product kernel (kernels/q4_stream.py, plain form)
            for rb, stages, nc in itertools.product((8, 16, 32), (2, 3, 4), (4, 8, 16)):
                c = {"K": k, "RB": rb, "GROUP": GROUP, "STAGES": stages}
                if n % rb == 0 and rb % nc == 0 and q4_stream.shared_bytes(c) + 1024 <= SMEM_PER_SM:
                    yield name, n, k, "wsf16", q4_stream.launch(n, k, GROUP, rb, stages, nc, SMS)


def _compile(job):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels import matvec

    name, n, k, kind, launch = job
    from kestrel.kernels import q4_stream

    fn = {"matvec": matvec.matvec_kernel, "wsf16": q4_stream.q4stream}.get(kind) or _kernel(kind)
    types = ["*fp32", "*u8", "*fp32"]
    try:
        ck = compile_kernel(kind, fn, types, launch["constexprs"], launch["num_warps"], 90, [True] * 3)
    except Exception as e:  # noqa: BLE001 - a configuration that does not compile is skipped
        return None, f"skip {name} {kind} {launch['constexprs']}: {type(e).__name__} {str(e)[:600]}"
    return (ck, launch), None


def _describe(job, ck, launch) -> dict:
    name, n, k, kind, _ = job
    c = launch["constexprs"]
    return {"shape": name, "N": n, "K": k, "kind": kind,
            "config": {x: c[x] for x in ("RB", "STAGES", "WK", "WR", "NC", "CPS", "MINB", "BLOCK_N", "BLOCK_K")
                       if x in c}}


def compile_all(folder: str) -> None:
    from cubin_folder import compile_to_folder

    jobs = list(_jobs())
    if os.environ.get("KESTREL_PROBE_ONE") == "1":  # one stream variant a shape (a quick check)
        seen, few = set(), []
        for j in jobs:
            if j[3] == "matvec" or j[0] not in seen:
                few.append(j)
                seen.add(j[0]) if j[3] == "stream" else None
        jobs = few
    compile_to_folder(folder, jobs, _compile, _describe, prefix="s")


def q8_ref(x, q, scales):
    """The kernel's arithmetic in float64: x per 32-input chunk to int8 (scale max|x| / 127 in fp32, x * (127 /
    max) rounded half to even), each chunk's integer dot with q - 8, times the chunk's x scale and its group's
    weight scale, summed."""
    import torch

    k = x.numel()
    xc = x.float().reshape(k // 32, 32)
    m = xc.abs().amax(1, keepdim=True)
    inv = torch.where(m > 0, 127.0 / m, torch.zeros_like(m))
    x8 = torch.round(xc * inv)  # fp32 product, half to even, as __float2int_rn
    dots = (q.double().reshape(q.shape[0], k // 32, 32) * x8.double()[None]).sum(-1)  # exact integers
    xs = (m / 127.0).double().reshape(-1)
    sc = scales.double().repeat_interleave(GROUP // 32, dim=1)
    return (dots * xs[None] * sc).sum(-1)


def time_all(folder: str, out: str) -> None:
    import torch

    from graph_timing import chain_times_us, launch_times_us, rotating_copies
    from kestrel.kernels.matvec import q4_codes, q4_matvec_ref, q4_pack
    from kestrel.runtime import cuda as kc
    from kestrel.runtime.bench import copy_bandwidth

    kc.init()
    assert torch.cuda.get_device_properties(0).multi_processor_count == SMS
    stream = torch.cuda.current_stream().cuda_stream
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, operands = [], {}
    quick = os.environ.get("KESTREL_SWEEP_QUICK") == "1"  # (under compute-sanitizer)
    for e in json.load(open(os.path.join(folder, "index.json"))):
        n, k, key = e["N"], e["K"], e["shape"]
        if key not in operands:
            operands.clear()
            torch.cuda.empty_cache()
            x = torch.randn(k, device="cuda", generator=g)
            wf = torch.randn(n, k, device="cuda", generator=g) / k ** 0.5
            w = q4_pack(wf, GROUP)
            q, sc = q4_codes(w, n, k, GROUP)
            exact = ((q.double().reshape(n, k // GROUP, GROUP) * sc.double()[:, :, None]).reshape(n, k) @ x.double())
            ref8 = q8_ref(x, q, sc)
            ref16 = q4_matvec_ref(x, q, sc, GROUP).double()
            copies = [w] + [w.clone() for _ in range(rotating_copies(w.numel()) - 1)]
            operands[key] = (x, copies, exact, ref8, ref16, w.numel())
        x, copies, exact, ref8, ref16, nbytes = operands[key]
        y = torch.full((n,), float("nan"), device="cuda")
        kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"], e["shared"])
        sets = [kc.PackedArgs(e["params"], [x.data_ptr(), c.data_ptr(), y.data_ptr()]) for c in copies]
        try:
            kc.launch(kernel, e["grid"], sets[0], stream)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            rows.append({**e, "error": str(exc)[:200]})
            print(f"{key:<14} {e['kind']:<6} {e['config']} launch failed: {str(exc)[:150]}", flush=True)
            continue
        scale = exact.abs().max().item()
        err_exact = ((y.double() - exact).abs().max() / scale).item()
        ref = ref8 if e["kind"] in ("stream", "ws") else ref16  # the arithmetic the kernel claims
        err_ref = ((y.double() - ref).abs().max() / scale).item()
        reps = (1, 1) if quick else (7, 48)
        alone = statistics.median(launch_times_us(kernel, e["grid"], sets, replays=reps[0], launches=reps[1]))
        chained = statistics.median(chain_times_us(kernel, e["grid"], sets, replays=reps[0], launches=reps[1]))
        rows.append({**e, "us_alone": alone, "us_chained": chained, "GBps_chained": nbytes / chained / 1e3,
                     "err_vs_exact": err_exact, "err_vs_ref": err_ref})
        print(f"{key:<14} {e['kind']:<6} {json.dumps(e['config']):<62} alone {alone:7.2f}  chained {chained:7.2f} us "
              f"{nbytes / chained / 1e3:6.0f} GB/s  err {err_exact:.1e} / its ref {err_ref:.1e}",
              flush=True)
    bw = {"copy": copy_bandwidth(stream) / 1e9}
    best = {}
    for r in rows:
        if "us_chained" not in r:
            continue
        ok = r["err_vs_exact"] < 2e-2 and r["err_vs_ref"] < 1e-5
        kk = (r["shape"], r["kind"])
        if ok and (kk not in best or r["us_chained"] < best[kk]["us_chained"]):
            best[kk] = r
    top = max(bw.values())
    print(f"\nbandwidth: copy {bw['copy']:.0f} GB/s; chained us (fraction of it)")
    print("shape          kind    chained us (of copy)  config                                  vs Triton")
    for name, n, k in CASES:
        a = best.get((name, "matvec"))
        for kind in ("matvec", "stream", "ws", "wsf16"):
            b = best.get((name, kind))
            if b is None:
                continue
            print(f"{name:<14} {kind:<7} {b['us_chained']:7.2f} ({b['GBps_chained'] / top:4.0%})      "
                  f"{json.dumps(b['config']):<40}" + (f" {a['us_chained'] / b['us_chained']:5.2f}x" if a else ""))
    json.dump({"rows": rows, "bandwidth_GBps": bw}, open(out, "w"), indent=1)


# --- forms: kernels/q4_stream.py's fused forms against the Triton kernels the step runs at the same 27B shapes ----
# (norm_swiglu: rmsnorm_matvec_swiglu, 17408 x 5120, the partials of a 5120-row add; add: matvec_add, 5120 x 6144)
FORM_CASES = [("27b norm_swiglu", 17408, 5120, "norm_swiglu"), ("27b add", 5120, 6144, "add"),
              ("27b norm_plain", 16480, 5120, "norm_plain")]
FORM_TYPES = {"norm_swiglu": ["*fp32", "*fp32", "*fp32", "*u8", "*u8", "*fp32", "fp32"],
              "add": ["*fp32", "*u8", "*fp32", "*fp32", "*fp32", "i32"],
              "norm_plain": ["*fp32", "*fp32", "*fp32", "*u8", "*fp32", "fp32"]}
FORM_NP = 640  # the producer's partials (the Triton matvec_add's 8-row programs over 5120 rows)


def _triton_launch(n: int, k: int, form: str) -> dict:
    """The launch of the Triton kernel the sm_90 rule picks for a form (the step's, where q4_stream is off)."""
    from kestrel.kernels.matvec import matvec_launch, rmsnorm_matvec_launch
    from kestrel.kernels.targets import TARGETS

    t = TARGETS["sm_90"]
    if form.startswith("norm"):
        return rmsnorm_matvec_launch(n, k, GROUP, FORM_NP, t, pair="swiglu" in form)
    return matvec_launch(n, k, GROUP, t)


def _form_jobs():
    from kestrel.kernels import q4_stream

    for name, n, k, form in FORM_CASES:
        pair, norm = "swiglu" in form, form.startswith("norm")
        yield name, n, k, form, "triton", _triton_launch(n, k, form)
        for rb, stages, nc in itertools.product((8, 16, 32), (2, 3, 4), (4, 8, 16)):
            if n % rb or rb % nc:
                continue
            la = q4_stream.launch(n, k, GROUP, rb, stages, nc, SMS, pair=pair, add=form == "add", norm=norm,
                                  partials=FORM_NP)
            if q4_stream.shared_bytes(la["constexprs"]) + 1024 <= 227 * 1024:
                yield name, n, k, form, "stream", la


def _compile_form(job):
    from kestrel.compiler.codegen import compile_kernel
    from kestrel.kernels import matvec, q4_stream

    name, n, k, form, kind, launch = job
    if kind == "triton":
        fn = {"norm_swiglu": matvec.rmsnorm_matvec_swiglu_kernel, "add": matvec.matvec_add_kernel,
              "norm_plain": matvec.rmsnorm_matvec_kernel}[form]
    else:
        fn = {"norm_swiglu": q4_stream.q4stream_norm_swiglu, "add": q4_stream.q4stream_add,
              "norm_plain": q4_stream.q4stream_norm}[form]
    try:
        ck = compile_kernel(f"{kind}_{form}", fn, FORM_TYPES[form], launch["constexprs"], launch["num_warps"], 90,
                            [True] * len(FORM_TYPES[form]))
    except Exception as e:  # noqa: BLE001
        return None, f"skip {name} {kind} {launch['constexprs']}: {type(e).__name__} {str(e)[:600]}"
    return (ck, launch), None


def _describe_form(job, ck, launch) -> dict:
    name, n, k, form, kind, _ = job
    c = launch["constexprs"]
    return {"shape": name, "N": n, "K": k, "form": form, "kind": kind, "constexprs": c,
            "config": {x: c[x] for x in ("RB", "STAGES", "NC", "KS", "MINB", "BLOCK_N", "BLOCK_K") if x in c}}


def compile_forms(folder: str) -> None:
    from cubin_folder import compile_to_folder

    compile_to_folder(folder, list(_form_jobs()), _compile_form, _describe_form, prefix="f")


def time_forms(folder: str, out: str) -> None:
    import torch

    from graph_timing import chain_times_us, launch_times_us, rotating_copies
    from kestrel.kernels import q4_stream
    from kestrel.kernels.matvec import q4_pack
    from kestrel.runtime import cuda as kc
    from kestrel.runtime.bench import copy_bandwidth

    kc.init()
    stream = torch.cuda.current_stream().cuda_stream
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, operands = [], {}
    for e in json.load(open(os.path.join(folder, "index.json"))):
        n, k, form, key = e["N"], e["K"], e["form"], e["shape"]
        pair, norm, add = "swiglu" in form, form.startswith("norm"), form == "add"
        if key not in operands:
            operands.clear()
            torch.cuda.empty_cache()
            x = torch.randn(k, device="cuda", generator=g)
            nw = torch.randn(k, device="cuda", generator=g) * 0.1
            r = torch.randn(n, device="cuda", generator=g)
            ws = [q4_pack(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5, GROUP) for _ in range(2 if pair else 1)]
            ss = (x.reshape(FORM_NP, -1) ** 2).sum(-1) if norm else None  # x's own partials: rstd = x's
            nbytes = sum(w.numel() for w in ws)
            copies = [ws] + [[w.clone() for w in ws] for _ in range(rotating_copies(nbytes) - 1)]
            operands[key] = (x, nw, r, ss, copies, nbytes)
        x, nw, r, ss, copies, nbytes = operands[key]
        y = torch.full((n,), float("nan"), device="cuda")
        rows_p = e["constexprs"].get("BLOCK_N", 1)
        ss_out = torch.zeros(n // rows_p + 1, device="cuda")

        def args(ws):
            if form == "add":
                return [x.data_ptr(), ws[0].data_ptr(), r.data_ptr(), y.data_ptr(), ss_out.data_ptr(), rows_p]
            return [x.data_ptr(), ss.data_ptr(), nw.data_ptr(), *[w.data_ptr() for w in ws], y.data_ptr(), 1e-6]

        kernel = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"], e["shared"])
        sets = [kc.PackedArgs(e["params"], args(ws)) for ws in copies]
        kc.launch(kernel, e["grid"], sets[0], stream)
        torch.cuda.synchronize()
        ref = torch.full((n,), float("nan"), device="cuda")
        rc = dict(e["constexprs"]) if e["kind"] == "stream" else dict(
            q4_stream.launch(n, k, GROUP, 16, 2, 2, SMS, pair=pair, add=add, norm=norm, partials=FORM_NP)["constexprs"])
        ref_ss = torch.zeros(n // rc.get("BLOCK_N", 1) + 1, device="cuda")
        ref_args = ([x, copies[0][0], r, ref, ref_ss, rc.get("BLOCK_N", 1)] if add
                    else [x, ss, nw, *copies[0], ref, 1e-6])
        q4_stream._emulate([1, 1, 1], *ref_args, **rc)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        alone = statistics.median(launch_times_us(kernel, e["grid"], sets, replays=7, launches=48))
        chained = statistics.median(chain_times_us(kernel, e["grid"], sets, replays=7, launches=48))
        rows.append({**{a: b for a, b in e.items() if a != "constexprs"}, "us_alone": alone, "us_chained": chained,
                     "GBps_chained": nbytes / chained / 1e3, "err_vs_ref": err})
        print(f"{key:<16} {e['kind']:<7} {json.dumps(e['config']):<44} alone {alone:7.2f}  chained {chained:7.2f} us "
              f"{nbytes / chained / 1e3:6.0f} GB/s  err {err:.1e}", flush=True)
    bw = copy_bandwidth(stream) / 1e9
    print(f"\ncopy bandwidth {bw:.0f} GB/s; best chained (alone) per form, err < 1e-4")
    for name, n, k, form in FORM_CASES:
        for kind in ("triton", "stream"):
            ok = [r for r in rows if r["shape"] == name and r["kind"] == kind and r["err_vs_ref"] < 1e-4]
            if ok:
                b = min(ok, key=lambda r: r["us_chained"])
                print(f"{name:<16} {kind:<7} {b['us_chained']:7.2f} ({b['GBps_chained'] / bw:4.0%})  alone {b['us_alone']:7.2f}"
                      f"  {json.dumps(b['config'])}")
    json.dump({"rows": rows, "copy_GBps": bw}, open(out, "w"), indent=1)

# The 27B GDN layer's four q4 products in step order, for the layer chains (time-layer): each form beside the
# Triton kernel the step runs, chained as the step's graph chains them, so a kernel's start overlaps its
# predecessor's end as it does in the step (not only a launch of its own kind).
LAYER_FORMS = [("in_proj", 16480, 5120, "norm_plain"), ("out_proj", 5120, 6144, "add"),
               ("gate_up", 17408, 5120, "norm_swiglu"), ("down", 5120, 17408, "add")]
LAYER_SPLITS = {  # (RB, STAGES, NC, KS): KS > 1 splits K over a row group's warps (KS = K / 1024: one chunk a lane)
    "in_proj": [(16, 2, 4, 1), (8, 2, 8, 1), (16, 2, 8, 1), (8, 3, 8, 1), (8, 2, 10, 5), (16, 2, 10, 5), (8, 3, 10, 5)],
    "out_proj": [(16, 2, 4, 1), (32, 2, 8, 1), (8, 2, 4, 1), (8, 2, 8, 1), (8, 3, 4, 1), (8, 2, 12, 6), (16, 2, 12, 6),
                 (8, 2, 6, 3)],
    "gate_up": [(8, 2, 8, 1), (8, 3, 8, 1), (16, 2, 8, 1), (4, 3, 4, 1), (8, 2, 10, 5), (4, 3, 10, 5)],
    "down": [(8, 2, 4, 1), (8, 2, 8, 1), (4, 2, 4, 1), (4, 3, 4, 1), (8, 2, 17, 17), (4, 2, 17, 17), (4, 3, 17, 17),
             (8, 2, 8, 8)]}
LAYERS = 12  # layers a chain runs, each with its own weights (2.3 GB: every launch reads DRAM)


def _layer_jobs():
    from kestrel.kernels import q4_stream

    for name, n, k, form in LAYER_FORMS:
        pair, norm = "swiglu" in form, form.startswith("norm")
        yield name, n, k, form, "triton", _triton_launch(n, k, form)
        for (rb, stages, nc, ks), minb in itertools.product(LAYER_SPLITS[name], (1, 2)):
            la = q4_stream.launch(n, k, GROUP, rb, stages, nc, SMS, pair=pair, add=form == "add", norm=norm,
                                  partials=FORM_NP, minb=minb, ks=ks)
            if minb * (q4_stream.shared_bytes(la["constexprs"]) + 1024) <= SMEM_PER_SM:
                yield name, n, k, form, "stream", la


def compile_layer(folder: str) -> None:
    from cubin_folder import compile_to_folder

    compile_to_folder(folder, list(_layer_jobs()), _compile_form, _describe_form, prefix="l")


def _form_operands(n, k, form, g, copies):
    """x, the norm's weight and partials, the residual, and ``copies`` sets of the form's weights (fresh random)."""
    import torch

    from kestrel.kernels.matvec import q4_pack

    pair, norm = "swiglu" in form, form.startswith("norm")
    x = torch.randn(k, device="cuda", generator=g)
    nw = torch.randn(k, device="cuda", generator=g) * 0.1
    r = torch.randn(n, device="cuda", generator=g)
    ss = (x.reshape(FORM_NP, -1) ** 2).sum(-1) if norm else None  # x's own partials: rstd = x's
    one = [q4_pack(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5, GROUP) for _ in range(2 if pair else 1)]
    return x, nw, r, ss, [one] + [[w.clone() for w in one] for _ in range(copies - 1)]


def _form_args(e, form, x, nw, r, ss, ws, y, ss_out):
    if form == "add":
        return [x.data_ptr(), ws[0].data_ptr(), r.data_ptr(), y.data_ptr(), ss_out.data_ptr(),
                e["constexprs"].get("BLOCK_N", 1)]
    return [x.data_ptr(), ss.data_ptr(), nw.data_ptr(), *[w.data_ptr() for w in ws], y.data_ptr(), 1e-6]


def time_layer(folder: str, out: str) -> None:
    """Every kernel of the folder checked against the emulation and timed chained over the layers' weights; then
    the layer chains: each form by the Triton kernel or the best q4_stream split of three kinds (a warp's rows over
    the whole K; K split over a row group's warps; registers for two CTAs an SM), every combination, LAYERS
    layers a graph."""
    import torch

    from graph_timing import chain_times_us
    from kestrel.kernels import q4_stream
    from kestrel.runtime import cuda as kc
    from kestrel.runtime.bench import copy_bandwidth

    kc.init()
    cu = kc.driver()
    g = torch.Generator(device="cuda").manual_seed(0)
    index = json.load(open(os.path.join(folder, "index.json")))
    ops = {name: _form_operands(n, k, form, g, LAYERS) for name, n, k, form in LAYER_FORMS}
    forms = {name: (n, k, form) for name, n, k, form in LAYER_FORMS}
    rows, packed, kernels = [], {}, {}
    for i, e in enumerate(index):
        name = e["shape"]
        n, k, form = forms[name]
        x, nw, r, ss, copies = ops[name]
        y = torch.full((n,), float("nan"), device="cuda")
        ss_out = torch.zeros(n + 1, device="cuda")
        kern = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), e["entry"], e["num_warps"], e["shared"])
        attr = cu.CUfunction_attribute
        regs = kc.check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, kern.function), "regs")
        local = kc.check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, kern.function), "local")
        kernels[i] = kern
        packed[i] = [kc.PackedArgs(e["params"], _form_args(e, form, x, nw, r, ss, ws, y, ss_out)) for ws in copies]
        try:
            kc.launch(kern, e["grid"], packed[i][0], 0)
            torch.cuda.synchronize()
        except Exception as ex:  # noqa: BLE001 - a split the device refuses: reported, the others still timed
            print(f"{name:<9} {e['kind']:<7} {json.dumps(e['config']):<44} launch failed: {ex}", flush=True)
            continue
        add, pair, norm = form == "add", "swiglu" in form, form.startswith("norm")
        rc = dict(e["constexprs"]) if e["kind"] == "stream" else dict(
            q4_stream.launch(n, k, GROUP, 16, 2, 2, SMS, pair=pair, add=add, norm=norm, partials=FORM_NP)["constexprs"])
        ref = torch.full((n,), float("nan"), device="cuda")
        ref_ss = torch.zeros(n + 1, device="cuda")
        ref_args = ([x, copies[0][0], r, ref, ref_ss, rc.get("BLOCK_N", 1)] if add
                    else [x, ss, nw, *copies[0], ref, 1e-6])
        q4_stream._emulate([1, 1, 1], *ref_args, **rc)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        chained = statistics.median(chain_times_us(kern, e["grid"], packed[i], replays=7, launches=48))
        nbytes = sum(w.numel() for w in copies[0])
        minb = e["constexprs"].get("MINB", 1)
        rows.append({**{a: b for a, b in e.items() if a != "constexprs"}, "i": i, "minb": minb, "regs": regs,
                     "local_bytes": local, "us_chained": chained, "GBps_chained": nbytes / chained / 1e3,
                     "err_vs_ref": err})
        print(f"{name:<9} {e['kind']:<7} {json.dumps(e['config']):<44} minb {minb} regs {regs:3d} local {local:4d}  "
              f"chained {chained:7.2f} us {nbytes / chained / 1e3:6.0f} GB/s  err {err:.1e}", flush=True)
    bw = copy_bandwidth(torch.cuda.current_stream().cuda_stream) / 1e9
    choices = {}
    for name, *_ in LAYER_FORMS:
        mine = [r for r in rows if r["shape"] == name and r["err_vs_ref"] < 1e-4]
        picks = {"triton": min((r for r in mine if r["kind"] == "triton"), key=lambda r: r["us_chained"])}
        for pick, ok in (("stream", lambda r: r["minb"] == 1 and "KS" not in r["config"]),
                         ("stream-ks", lambda r: r["minb"] == 1 and "KS" in r["config"]),
                         ("stream-minb2", lambda r: r["minb"] == 2)):
            these = [r for r in mine if r["kind"] == "stream" and ok(r)]
            if these:
                picks[pick] = min(these, key=lambda r: r["us_chained"])
        choices[name] = picks
        print(f"{name}: " + ", ".join(f"{c} {r['us_chained']:.2f} us {json.dumps(r['config'])}"
                                      for c, r in picks.items()))
    combos = []
    for combo in itertools.product(*[list(choices[name].items()) for name, *_ in LAYER_FORMS]):
        launches = [(kernels[r["i"]], r["grid"], packed[r["i"]][layer]) for layer in range(LAYERS) for _, r in combo]
        _, graph_exec = kc.chain_graph(launches, True)
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            kc.check(cu.cuGraphLaunch(graph_exec, torch.cuda.current_stream().cuda_stream), "cuGraphLaunch")
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / LAYERS)
        us = statistics.median(times)
        combos.append({"forms": {name: c for (name, *_), (c, _) in zip(LAYER_FORMS, combo)},
                       "configs": {name: r["config"] for (name, *_), (_, r) in zip(LAYER_FORMS, combo)},
                       "us_per_layer": us})
    layer_bytes = sum(sum(w.numel() for w in ops[name][4][0]) for name, *_ in LAYER_FORMS)
    print(f"\ncopy bandwidth {bw:.0f} GB/s; a layer's four products read {layer_bytes / 1e6:.1f} MB "
          f"({layer_bytes / bw / 1e3:.2f} us at copy)")
    for c in sorted(combos, key=lambda c: c["us_per_layer"]):
        print(f"{c['us_per_layer']:8.2f} us/layer ({layer_bytes / c['us_per_layer'] / 1e3 / bw:4.0%})  "
              + "  ".join(f"{n}={f}" for n, f in c["forms"].items()))
    json.dump({"rows": rows, "combos": combos, "copy_GBps": bw, "layer_bytes": layer_bytes}, open(out, "w"), indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    elif sys.argv[1] == "compile-forms":
        compile_forms(sys.argv[2])
    elif sys.argv[1] == "time-forms":
        time_forms(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "compile-layer":
        compile_layer(sys.argv[2])
    elif sys.argv[1] == "time-layer":
        time_layer(sys.argv[2], sys.argv[3])
    else:
        time_all(sys.argv[2], sys.argv[3])
