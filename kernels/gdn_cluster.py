"""A Gated DeltaNet layer's mixer in one launch at one row (sm_90 on): the normed input projection (q4), the conv,
the delta rule and the gated norm, a thread-block cluster per key head (op ``rmsnorm_gdn``, folded by
passes/fold_row_norms.py where the rule ``gdn_cluster.on`` says so).

Why: at one row a Gated DeltaNet layer's mixer is three dependent launches (``rmsnorm_matmul`` of the fused
projection, ``gdn_delta``, ``gdn_norm``), each a global reduction the next one waits for. But a key head g needs
only its own rows of the projection: q and k of head g, v and z of its R = Hv / Hk value heads, their b and a.
So one cluster of CS CTAs a key head computes them, exchanges the conv'd q and k through distributed shared
memory, runs the delta rule on its heads' state and norms its heads' outputs, two exchanges on mbarriers in place
of two launch boundaries; every CTA's weights (its ~100 KB of the projection at the 80B-A3B shape) are requested
before the PDL wait, so they stream in while the previous kernel finishes.

CUDA C compiled by NVRTC (DESIGN: "CUDA C via NVRTC where Triton falls short": Triton has no clusters). Grid
[Hk * CS]; CTA r of cluster g (a key head) owns
* q rows g Dk + r QR .. + QR and the same k rows (QR = Dk / CS), their conv channels (state read and written:
  one owner a channel, so the conv state is updated here, race-free);
* value columns r VC .. + VC of the head group's R Dv (VC = R Dv / CS, a divisor of Dv: one value head j, its
  columns c0 .. c0 + VC): those rows of v (and their conv channels) and of z, and head j's b and a rows;
* head j's state columns c0 .. c0 + VC (the delta rule is independent per column).
Steps: the CTA's three mbarriers initialised, one cluster barrier (every CTA's mbarriers ready before any CTA
stores into it); one thread requests the CTA's NR = 2 QR + 2 VC + 2 rows with one bulk copy a row run for the
nibble words and one for the scales (SB: the scales' runs whole 16-byte units; else plain loads), and every thread
its state tile, conv windows and small weights, all before the PDL wait; after it, x and the producer's NP partial
sums of squares requested together, x normed (rstd from the partials) and staged as f16x2 of x / 64
(kernels/q4_stream.py's arithmetic: ``q4_matvec_ref``); the NR products (a warp RU rows at once); the conv + SiLU of
its channels, the new conv state stored; its q and k pushed by ``st.async`` into every CTA of the cluster, each
store completing on the receiver's mbarrier, which every CTA waits on for head g's q and k; their L2 norms; the
gates; the delta rule on the tile (NSL slabs of rows a column, summed in slab order); its share of its head's mean
square pushed to the head's HR CTAs likewise, summed in rank order; out = norm_w * o * rstd * silu(z). No fence at
GPU scope (stop 49 call 1: a ``barrier.cluster.arrive.release`` compiles to ``MEMBAR.ALL.GPU``, which drained the
state stores before each of three barriers: 28.5 us a launch at 80B-A3B against 13.3 for the three launches).
Deterministic: every sum in a fixed order.

Reference: ``rmsnorm_gdn_ref``, the unfused references composed (``rmsnorm_matvec_ref``, ``gdn_delta_ref``,
``gdn_norm_ref``); the CPU emulation of a launch (the launch-plan tests) runs it.
"""
from __future__ import annotations

import torch

from kestrel.kernels.gated_delta import gdn_delta_ref, gdn_norm_ref
from kestrel.kernels.matvec import matvec_ref, q4_codes, q4_matvec_ref
from kestrel.kernels.q4_mma import CTA_RESERVED_SMEM, CudaKernel
from kestrel.kernels.q4_stream import BULK_MIN_CC, DEVICE_HELPERS
from kestrel.kernels.rmsnorm import rmsnorm_ref

SOURCE = r"""
#ifndef TIMING
#define TIMING 0                         /* bench/gdn_cluster_probe.py: each phase's clock into scratch0 (per CTA) */
#endif
#ifndef RU
#define RU 4                             /* projection rows a warp takes at once */
#endif
#ifndef WL
#define WL 0                             /* the words by every thread's cp.async instead of bulk copies (a probe form) */
#endif
#ifndef SB
#define SB 0                             /* the scales by bulk copies too (each run's scales whole 16-byte units) */
#endif
#define R (HV / HK)
#define QKC (HK * DK)
#define C (2 * QKC + HV * DV)            /* conv channels: q | k | v */
#define NT (C + HV * DV + 2 * HV)        /* the projection's rows: q | k | v | z | b | a */
#define QR (DK / CS)                     /* q (and k) rows a CTA */
#define VC (R * DV / CS)                 /* value columns a CTA (one value head's) */
#define NR (2 * QR + 2 * VC + 2)         /* projection rows a CTA: q, k, v, z, b, a */
#define NCH (2 * QR + VC)                /* conv channels a CTA */
#define KCM (KC - 1)
#define ROWB (K / 2)
#define NGR (K / GROUP)
#define JC (K / 32)
#define CPG (GROUP / 32)
#define THREADS (32 * NW)
#define XPT ((K / 8 + THREADS - 1) / THREADS)  /* 8-input pieces of x a thread stages */
#define NSL (THREADS / VC < DK ? THREADS / VC : DK)  /* state row slabs a column */
#define SR (DK / NSL)                    /* state rows a slab */
#define HR (DV / VC)                     /* CTAs a value head */
#define W_AT 0                           /* the rows' nibble words [NR][ROWB] */
#define SC_AT (NR * ROWB)                /* their scales [NR][NGR] f16 */
#define X_AT ((SC_AT + NR * NGR * 2 + 15) / 16 * 16)   /* x: f16x2 of x / 64, K / 8 uint4 */
#define Y_AT (X_AT + 2 * K)              /* the rows' products [NR] */
#define QF_AT (Y_AT + 4 * NR)            /* head g's q [DK], then k [DK]: written by the cluster's CTAs */
#define V_AT (QF_AT + 8 * DK)            /* this CTA's conv'd v [VC], then o [VC] */
#define RED_AT (V_AT + 8 * VC)           /* the slabs' sums [NSL][VC] */
#define MS_AT (RED_AT + 4 * NSL * VC)    /* rstd, the q and k factors */
#define NS_AT (MS_AT + 16)               /* the head's CTAs' sums of o^2 [HR]: written by them */
#define BAR_AT ((NS_AT + 4 * HR + 7) / 8 * 8)  /* mbarriers: the weights, q | k, the sums of o^2 */
#define SMEM_BYTES (BAR_AT + 24)

""" + DEVICE_HELPERS + r"""
#if TIMING
#define STAMP(n) do { if (tid == 0) ((long long*)scratch0)[blockIdx.x * 16 + (n)] = clock64(); } while (0)
#define GSTAMP(n) do { if (tid == 0) { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); \
                         ((long long*)scratch0)[blockIdx.x * 16 + (n)] = (long long)t; } } while (0)
#else
#define GSTAMP(n) do { } while (0)
#define STAMP(n) do { } while (0)
#endif

/* this CTA's shared address ``local`` in the CTA of cluster rank ``rank`` */
__device__ __forceinline__ unsigned remote_addr(unsigned local, int rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

/* v into the CTA of cluster rank ``rank`` at (its) ``local``, counted on its mbarrier at (its) ``bar`` */
__device__ __forceinline__ void push_f32(unsigned local, unsigned bar, int rank, float v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
               ::"r"(remote_addr(local, rank)), "r"(__float_as_uint(v)), "r"(remote_addr(bar, rank)) : "memory");
}

__device__ __forceinline__ void bar_wait_cluster(unsigned bar, unsigned phase) {
  unsigned ok = 0;
  while (!ok)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; "
                 "selp.u32 %0, 1, 0, p; }" : "=r"(ok) : "r"(bar), "r"(phase) : "memory");
}

/* the global row of this CTA's projection row i (q, k, v, z, b, a runs) */
__device__ __forceinline__ int proj_row(int i, int g, int r, int j) {
  if (i < QR) return g * DK + r * QR + i;
  if (i < 2 * QR) return QKC + g * DK + r * QR + (i - QR);
  if (i < 2 * QR + VC) return 2 * QKC + g * R * DV + r * VC + (i - 2 * QR);
  if (i < 2 * QR + 2 * VC) return C + g * R * DV + r * VC + (i - 2 * QR - VC);
  return i == NR - 2 ? C + HV * DV + j : C + HV * DV + HV + j;
}

/* the conv channel of this CTA's channel i (q, k, v) */
__device__ __forceinline__ int conv_channel(int i, int g, int r) {
  if (i < QR) return g * DK + r * QR + i;
  if (i < 2 * QR) return QKC + g * DK + r * QR + (i - QR);
  return 2 * QKC + g * R * DV + r * VC + (i - 2 * QR);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) __cluster_dims__(CS, 1, 1)
ENTRY(const float* __restrict__ x, const float* __restrict__ ss_in, const float* __restrict__ nw,
      const unsigned char* __restrict__ w, float* conv_state, const float* __restrict__ conv_w,
      const float* __restrict__ a_log, const float* __restrict__ dt_bias, const float* __restrict__ norm_w,
      float* rec_state, float* out, float eps, float l2_eps, float scale, float norm_eps,
      void* scratch0, void* scratch1) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  {
    unsigned given;                               /* the launch's dynamic shared memory holds the layout */
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(given));
    if (given < SMEM_BYTES) __trap();
  }
  const int g = blockIdx.x / CS, r = blockIdx.x % CS;       /* key head, rank in its cluster */
  const int j = g * R + (r * VC) / DV, c0 = (r * VC) % DV;  /* this CTA's value head and first column */
  const unsigned bar = smem_u32(smem + BAR_AT), bqk = bar + 8, bns = bar + 16;
  float* Y = (float*)(smem + Y_AT);
  float* QF = (float*)(smem + QF_AT);
  float* KF = QF + DK;
  float* V = (float*)(smem + V_AT);
  float* O = V + VC;
  float* RED = (float*)(smem + RED_AT);
  float* MS = (float*)(smem + MS_AT);
  float* NS = (float*)(smem + NS_AT);

  /* --- before the wait: what no kernel still running writes (weights; this layer's states, last written by
     this kernel in the previous step) --- */
  if (tid == 0) {
    bar_init(bar, 1);
    bar_init(bqk, 1);
    bar_init(bns, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  /* every CTA's mbarriers initialised before any CTA of the cluster stores into it (the one cluster barrier, before
     the PDL wait: the exchanges below complete on mbarriers, with no fence at GPU scope) */
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;" ::: "memory");
  if (tid == 0) {
    bar_expect(bqk, 2 * DK * 4);                  /* q and k: QR of each from every CTA (st.async: complete_tx) */
    bar_expect(bns, HR * 4);                      /* the sums of o^2 of this head's CTAs */
  }
  GSTAMP(12);
  STAMP(0);
#if WL
  {                                               /* WL: the rows' words by every thread's 16-byte cp.async */
    const unsigned dst = smem_u32(smem + W_AT);
    for (int i = tid; i < NR * (ROWB / 16); i += THREADS) {
      const int row = i / (ROWB / 16), piece = i % (ROWB / 16);
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                   ::"r"(dst + row * ROWB + 16 * piece),
                   "l"(w + (size_t)proj_row(row, g, r, j) * ROWB + 16 * piece) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
#endif
  if (tid == 0) {                                 /* the rows' words (SB: and scales): one bulk copy a run of rows */
    bar_expect(bar, (WL ? 0 : NR * ROWB) + (SB ? NR * NGR * 2 : 0));
    const unsigned dst = smem_u32(smem + W_AT), dsc = smem_u32(smem + SC_AT);
    const int runs[6][2] = {{0, QR}, {QR, QR}, {2 * QR, VC}, {2 * QR + VC, VC}, {NR - 2, 1}, {NR - 1, 1}};
#pragma unroll
    for (int u = 0; u < 6; ++u) {
      const size_t row = proj_row(runs[u][0], g, r, j);
      if (!WL) bulk_copy(dst + runs[u][0] * ROWB, w + row * ROWB, runs[u][1] * ROWB, bar);
      if (SB) bulk_copy(dsc + runs[u][0] * NGR * 2, w + (size_t)NT * ROWB + row * NGR * 2, runs[u][1] * NGR * 2, bar);
    }
  }
  if (!SB) {                                      /* their scales, by plain loads */
    unsigned short* S = (unsigned short*)(smem + SC_AT);
    const unsigned short* ws = (const unsigned short*)(w + (size_t)NT * ROWB);
    for (int i = tid; i < NR * NGR; i += THREADS) S[i] = ws[(size_t)proj_row(i / NGR, g, r, j) * NGR + i % NGR];
  }
  const int col = tid % VC, slab = tid / VC;      /* the delta rule's: a column, a slab of SR rows */
  float st[SR];
  float* tile = rec_state + ((size_t)j * DK + slab * SR) * DV + c0 + col;
  if (slab < NSL) {
#pragma unroll
    for (int i = 0; i < SR; ++i) st[i] = tile[(size_t)i * DV];
  }
  float cs[KCM > 0 ? KCM : 1], cw[KC];            /* a conv channel's window state and weights */
  const int ch = tid < NCH ? conv_channel(tid, g, r) : 0;
  if (tid < NCH) {
#pragma unroll
    for (int t = 0; t < KCM; ++t) cs[t] = conv_state[(size_t)ch * KCM + t];
#pragma unroll
    for (int t = 0; t < KC; ++t) cw[t] = conv_w[(size_t)ch * KC + t];
  }
  float4 nwa[XPT], nwb[XPT];                      /* the input norm's weight, as x is staged */
#pragma unroll
  for (int u = 0; u < XPT; ++u) {
    const int i = tid + u * THREADS;
    if (i < K / 8) {
      nwa[u] = *(const float4*)(nw + 8 * i);
      nwb[u] = *(const float4*)(nw + 8 * i + 4);
    }
  }
  const float neg_a = -expf(a_log[j]), dtb = dt_bias[j];
  const float nw_col = col < VC ? norm_w[c0 + col] : 0.f;
#if PDL
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  STAMP(1);

  /* --- the normed input, staged: x and the partials requested together, rstd applied as x is converted --- */
  float4 x0[XPT], x1[XPT];
#pragma unroll
  for (int u = 0; u < XPT; ++u) {
    const int i = tid + u * THREADS;
    if (i < K / 8) {
      x0[u] = __ldcg((const float4*)(x + 8 * i));
      x1[u] = __ldcg((const float4*)(x + 8 * i + 4));
    }
  }
  if (warp == 0) {                                /* rstd from the producer's partials, in a fixed order */
    const float q = partials_rstd(ss_in, NP, K, eps, lane);
    if (lane == 0) MS[1] = q;
  }
  __syncthreads();
  uint4* X16 = (uint4*)(smem + X_AT);
  {
    const float q = MS[1];
#pragma unroll
    for (int u = 0; u < XPT; ++u) {
      const int i = tid + u * THREADS;
      if (i < K / 8) {
        const float4 na = nwa[u], nb = nwb[u], a = x0[u], b = x1[u];
        X16[i] = make_uint4(pack_half2(a.x * q * (1.f + na.x) * 0.015625f, a.y * q * (1.f + na.y) * 0.015625f),
                            pack_half2(a.z * q * (1.f + na.z) * 0.015625f, a.w * q * (1.f + na.w) * 0.015625f),
                            pack_half2(b.x * q * (1.f + nb.x) * 0.015625f, b.y * q * (1.f + nb.y) * 0.015625f),
                            pack_half2(b.z * q * (1.f + nb.z) * 0.015625f, b.w * q * (1.f + nb.w) * 0.015625f));
      }
    }
  }
  __syncthreads();
  STAMP(2);
  bar_wait(bar, 0);
#if WL
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  __syncthreads();
#endif
  STAMP(3);

  /* --- the projection: a warp RU rows at a time (independent chains), lane l the chunks l, l + 32, ... --- */
  {
    const uint4* W4 = (const uint4*)(smem + W_AT);
    const unsigned short* S = (const unsigned short*)(smem + SC_AT);
    for (int row0 = warp * RU; row0 < NR; row0 += NW * RU) {
      float acc[RU];
#pragma unroll
      for (int u = 0; u < RU; ++u) acc[u] = 0.f;
#pragma unroll
      for (int c0 = 0; c0 < JC; c0 += 32) {
        const int c = c0 + lane;
        if (c < JC) {
          const uint4 h0 = X16[4 * c], h1 = X16[4 * c + 1], h2 = X16[4 * c + 2], h3 = X16[4 * c + 3];
#pragma unroll
          for (int u = 0; u < RU; ++u) {
            const int row = min(row0 + u, NR - 1);  /* (past the last row: recomputed, not stored) */
            acc[u] = fmaf(chunk_value(W4[row * JC + c], h0, h1, h2, h3), h2f(S[row * NGR + c / CPG]), acc[u]);
          }
        }
      }
#pragma unroll
      for (int o = 16; o; o >>= 1)
#pragma unroll
        for (int u = 0; u < RU; ++u) acc[u] += __shfl_xor_sync(0xffffffffu, acc[u], o);
      if (lane == 0)
#pragma unroll
        for (int u = 0; u < RU; ++u)
          if (row0 + u < NR) Y[row0 + u] = 64.f * acc[u];
    }
  }
  __syncthreads();
  STAMP(4);
  /* --- the conv + SiLU of this CTA's channels; the window shifted into the state (one owner a channel) --- */
  if (tid < NCH) {
    const float xin = Y[tid];                     /* rows q | k | v are this CTA's channels, in order */
    float acc = 0.f;
#pragma unroll
    for (int t = 0; t < KCM; ++t) acc += cs[t] * cw[t];
    acc += xin * cw[KCM];
    const float y = acc / (1.f + expf(-acc));
#pragma unroll
    for (int t = 0; t + 1 < KCM; ++t) conv_state[(size_t)ch * KCM + t] = cs[t + 1];
    if (KCM > 0) conv_state[(size_t)ch * KCM + KCM - 1] = xin;
    if (tid < 2 * QR) {                           /* q and k into every CTA of the cluster (this one too) */
      const unsigned at = smem_u32(QF + (tid / QR) * DK + r * QR + tid % QR);
#pragma unroll
      for (int d = 0; d < CS; ++d) push_f32(at, bqk, d, y);
    } else {
      V[tid - 2 * QR] = y;
    }
  }
  STAMP(5);
  bar_wait_cluster(bqk, 0);                       /* head g's q and k, from the cluster */
  STAMP(6);

  /* --- their L2 norms --- */
  if (warp < 2) {
    const float* v = warp ? KF : QF;
    float q = 0.f;
    for (int i = lane; i < DK; i += 32) q += v[i] * v[i];
#pragma unroll
    for (int o = 16; o; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
    if (lane == 0) MS[2 + warp] = (1.f / sqrtf(q + l2_eps)) * (warp ? 1.f : scale);
  }
  __syncthreads();

  STAMP(7);
  /* --- gates; the delta rule on the tile: S = S exp(g); S += k (outer) beta (v - S^T k); o = S^T q --- */
  const float xa = Y[NR - 1] + dtb;
  const float softplus = xa > 20.f ? xa : logf(1.f + expf(fminf(xa, 20.f)));
  const float decay = expf(neg_a * softplus), beta = 1.f / (1.f + expf(-Y[NR - 2]));
  const float qf = MS[2], kf = MS[3];
  float part = 0.f;
  if (slab < NSL) {
#pragma unroll
    for (int i = 0; i < SR; ++i) {
      st[i] *= decay;
      part += st[i] * (KF[slab * SR + i] * kf);
    }
    RED[slab * VC + col] = part;
  }
  __syncthreads();
  float kv = 0.f;
  if (slab < NSL)
    for (int s = 0; s < NSL; ++s) kv += RED[s * VC + col];
  __syncthreads();                                /* every slab has read the sums before they are overwritten */
  if (slab < NSL) {
    const float delta = (V[col] - kv) * beta;
    part = 0.f;
#pragma unroll
    for (int i = 0; i < SR; ++i) {
      st[i] += (KF[slab * SR + i] * kf) * delta;
      part += st[i] * (QF[slab * SR + i] * qf);
      tile[(size_t)i * DV] = st[i];
    }
    RED[slab * VC + col] = part;
  }
  __syncthreads();
  if (tid < VC) {
    float o = 0.f;
    for (int s = 0; s < NSL; ++s) o += RED[s * VC + tid];
    O[tid] = o;
  }
  __syncthreads();

  STAMP(8);
  /* --- the gated norm: head j's mean square from its HR CTAs, rank order --- */
  if (warp == 0) {
    float q = 0.f;
    for (int i = lane; i < VC; i += 32) q += O[i] * O[i];
#pragma unroll
    for (int o = 16; o; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
    if (lane < HR) push_f32(smem_u32(NS + r % HR), bns, (r / HR) * HR + lane, q);  /* to the head's CTAs */
  }
  bar_wait_cluster(bns, 0);
  STAMP(9);
  if (tid < VC) {
    float q = 0.f;
#pragma unroll
    for (int s = 0; s < HR; ++s) q += NS[s];
    const float rstd = 1.f / sqrtf(q / (float)DV + norm_eps);
    const float z = Y[2 * QR + VC + tid];
    out[(size_t)j * DV + c0 + tid] = nw_col * (O[tid] * rstd) * (z / (1.f + expf(-z)));
  }
  STAMP(10);
  STAMP(11);
  GSTAMP(13);
}
"""


def layout(k: int, group: int, hk: int, hv: int, dk: int, dv: int, cs: int, nw: int) -> dict:
    """The split of one configuration (the source's defines), or {} where it does not apply."""
    if hk <= 0 or hv % hk or dk % cs or (hv // hk * dv) % cs:
        return {}
    qr, vc = dk // cs, hv // hk * dv // cs
    if not qr or not vc or dv % vc or (32 * nw) % vc or dv // vc > 32:
        return {}
    nsl = min(32 * nw // vc, dk)
    if dk % nsl:
        return {}
    nr = 2 * qr + 2 * vc + 2
    return {"QR": qr, "VC": vc, "NR": nr, "NCH": 2 * qr + vc, "NSL": nsl, "SR": dk // nsl}


def shared_bytes(c: dict) -> int:
    """SMEM_BYTES of the source (the kernel traps if it is given less): the CTA's rows (words and scales), x, the
    products, q | k, v | o, the slabs' sums, four scalars, the head's sums of o^2 and three mbarriers."""
    lay = layout(c["K"], c["GROUP"], c["HK"], c["HV"], c["DK"], c["DV"], c["CS"], c["NW"])
    nr, k = lay["NR"], c["K"]
    x_at = -(-(nr * k // 2 + nr * (k // c["GROUP"]) * 2) // 16) * 16
    ns_at = x_at + 2 * k + 4 * nr + 8 * c["DK"] + 8 * lay["VC"] + 4 * lay["NSL"] * lay["VC"] + 16
    return -(-(ns_at + 4 * (c["DV"] // lay["VC"])) // 8) * 8 + 24


def rmsnorm_gdn_ref(s, ss, nw, w, conv_state, conv_w, a_log, dt_bias, norm_w, rec_state, eps: float, l2_eps: float,
                    scale: float, norm_eps: float) -> torch.Tensor:
    """The mixer's output [Hv Dv] (conv_state, rec_state updated in place): the input projection of rmsnorm(s)
    (kernels/matvec.py's ``matvec_ref``; ss, the producer's partial sums of s^2, is how the GPU gets the mean
    square), cut into qkv | z | b | a, then ``gdn_delta_ref`` and ``gdn_norm_ref``: the unfused references."""
    y = matvec_ref(rmsnorm_ref(s, nw, eps), w)
    return _mixer(y, conv_state, conv_w, a_log, dt_bias, norm_w, rec_state, l2_eps, scale, norm_eps)


def _mixer(y, conv_state, conv_w, a_log, dt_bias, norm_w, rec_state, l2_eps, scale, norm_eps):
    hv, _, dv = rec_state.shape
    c = conv_state.shape[0]
    qkv, z = y[:c], y[c:c + hv * dv]
    b, a = y[c + hv * dv:c + hv * dv + hv], y[c + hv * dv + hv:c + hv * dv + 2 * hv]
    o = gdn_delta_ref(qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec_state, l2_eps, scale)
    return gdn_norm_ref(o, z, qkv, norm_w, conv_state, norm_eps)


def _emulate(grid, x, ss, nw, w, conv_state, conv_w, a_log, dt_bias, norm_w, rec_state, out, eps, l2_eps, scale,
             norm_eps, *, K, GROUP, HK, HV, DK, DV, KC, CS, NW, NP, SB=0, PDL=False):
    """A launch on the CPU (the launch-plan tests): the operands are arena views; the projection
    ``q4_matvec_ref``'s of x normed with rstd from the NP partials, then the references."""
    assert list(grid) == [HK * CS, 1, 1] and layout(K, GROUP, HK, HV, DK, DV, CS, NW), (grid, HK, CS)
    c = 2 * HK * DK + HV * DV
    n = c + HV * DV + 2 * HV
    rstd = torch.rsqrt(ss[:NP].double().sum() / K + eps).float()
    xv = x[:K].float() * rstd * (1.0 + nw[:K].float())
    y = q4_matvec_ref(xv, *q4_codes(w[:n * K // 2 + n * (K // GROUP) * 2], n, K, GROUP), GROUP)
    cs = conv_state[:c * (KC - 1)].view(c, KC - 1)
    rs = rec_state[:HV * DK * DV].view(HV, DK, DV)
    o = _mixer(y, cs, conv_w[:c * KC].view(c, KC), a_log[:HV], dt_bias[:HV], norm_w[:DV], rs, l2_eps, scale,
               norm_eps)
    out[:HV * DV] = o


_CONSTS = ("K", "GROUP", "HK", "HV", "DK", "DV", "KC", "CS", "NW", "NP", "SB", "PDL")
GDN_CLUSTER = CudaKernel("gdn_cluster", __name__, SOURCE,
                         ("x_ptr", "ss_ptr", "nw_ptr", "w_ptr", "conv_state_ptr", "conv_w_ptr", "a_log_ptr",
                          "dt_bias_ptr", "norm_w_ptr", "rec_state_ptr", "out_ptr", "eps", "l2_eps", "scale",
                          "norm_eps"), _CONSTS, shared_bytes, _emulate)
gdn_cluster = GDN_CLUSTER  # the kernel table names it through jit_name ("kestrel.kernels.gdn_cluster:gdn_cluster")


def gdn_cluster_launch(k: int, group: int, hk: int, hv: int, dk: int, dv: int, kc: int, partials: int,
                       target) -> dict | None:
    """The launch for a layer of Hk key heads (Hv value heads, widths Dk / Dv, conv width KC) whose projection is q4
    [2 Hk Dk + 2 Hv Dv + 2 Hv, K] of group ``group``, normed with ``partials`` partial sums; None where the target's
    ``gdn_cluster`` rule does not run it: off, no clusters and bulk copies (sm_90 on), a split that does not divide
    the heads (``layout``), rows whose words are not whole 16-byte runs, or a CTA's rows that do not fit its shared
    memory (the 27B's do not: its weights would need a ring)."""
    r = target.rules.get("gdn_cluster")
    if r is None or not r.on or target.cc < BULK_MIN_CC or not group or k % group or k % 32 or k % 8:
        return None
    lay = layout(k, group, hk, hv, dk, dv, r.cs, r.num_warps)
    if not lay or (k // 2) % 16 or lay["NCH"] > 32 * r.num_warps or kc < 1:
        return None
    c = {"K": k, "GROUP": group, "HK": hk, "HV": hv, "DK": dk, "DV": dv, "KC": kc, "CS": r.cs, "NW": r.num_warps,
         "NP": partials, "SB": int((k // group * 2) % 16 == 0)}
    if shared_bytes(c) + CTA_RESERVED_SMEM > target.smem_optin:
        return None
    return {"grid": [hk * r.cs, 1, 1], "num_warps": r.num_warps, "constexprs": c}
