"""Probe (issue 13 part 3): the 27B q4 MLP block as ONE persistent launch instead of three.

The layer probe (bench/q4stream_probe.py time-layer) measures the out projection, the normed gate / up pair and the
down projection as separate launches chained by programmatic edges: every launch pays its ramp (the first bytes a
microsecond or more after its CTAs start) and its tail (the SMs with one block more than the others). Here one
launch of kernels/q4_stream.py's machinery runs the three in phases:

  phase 0: s1 = r + W_o x (matmul_add), each row group's partial sum of s1^2;
  phase 1: a = silu(W_g n) * (W_u n), n = s1 * rstd * (1 + nw), rstd from phase 0's partials (rmsnorm_matmul_swiglu);
  phase 2: s2 = s1 + W_d a (matmul_add), its partials (what the next layer's norm reads).

One CTA an SM; its producer warp streams the CTA's blocks of all three phases through one ring without stopping at
the phase boundaries (weights are not data: the next phase's first blocks are in flight while the consumers finish
this one). Between phases the consumer warps meet every other CTA's at a grid barrier (a counter in global memory,
release / acquire at GPU scope; every CTA is resident: one an SM, launched with the grid at most the SMs), then
stage the next phase's x. Per phase its own split (RB rows a block, KS warps a row group over K), the consumer warps
and the ring shared. The arithmetic is q4_matvec_ref's, as in the product kernel.

Checked on the device against kernels/q4_stream.py's float64 emulation of the three products in order; timed
chained over LAYERS layers (each its own weights: DRAM reads) against the same three products as separate launches
(the Triton kernels, and the product's q4_stream pair between them).

Here (no GPU):   python bench/q4chain_probe.py compile bench/q4chain-cubins
On the device:   cd bench && python3 q4chain_probe.py time q4chain-cubins $OUT/chain.json
                 (run's carry=["bench/q4chain-cubins"]; the folder is git-ignored)
"""
from __future__ import annotations

import itertools
import json
import os
import statistics
import sys

GROUP, SMS, SMEM_PER_SM = 128, 132, 228 * 1024
H, I, V = 5120, 17408, 6144  # 27B: hidden, MLP width, the out projection's input (48 value heads x 128)
FORM_NP = 640  # (unused by the chain: its norm reads phase 0's own partials)
LAYERS = 12

from kestrel.kernels.q4_stream import DEVICE_HELPERS  # noqa: E402

SOURCE = r"""
#define THREADS (32 * (NC + 1))
#define MAX2(a, b) ((a) > (b) ? (a) : (b))
#define BLKW(K, RB) ((RB) * (K) / 2)
#define BLKB(K, RB) (BLKW(K, RB) + (RB) * ((K) / GROUP) * 2)
#define SLOT ((MAX2(MAX2(BLKB(K0, RB0), 2 * BLKB(K1, RB1)), BLKB(K2, RB2)) + 127) / 128 * 128)
#define KMAX MAX2(MAX2(K0, K1), K2)
#define X_AT (STAGES * SLOT)
#define RSTD_AT (X_AT + 2 * KMAX)
#define BAR_AT (RSTD_AT + 16)
#define RED_AT (BAR_AT + 16 * STAGES)
#define ALL_CONSUMERS 15                 /* the named barrier of every consumer warp (row groups: 1 .. NG) */

""" + DEVICE_HELPERS + r"""
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(ALL_CONSUMERS), "n"(32 * NC) : "memory");
}

/* every CTA's consumers past this point once all have reached it (the target-th arrival on the counter) */
__device__ __forceinline__ void grid_sync(unsigned* cnt, unsigned target, int tid) {
  consumers_sync();
  if (tid == 0) {                 /* (the fences as cooperative groups' grid sync has them) */
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(cnt) : "memory");
    unsigned v = 0;
    do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(cnt) : "memory"); while (v < target);
    __threadfence();
  }
  consumers_sync();
}

/* the producer's blocks of one phase: weight(s) w0 (w1: the pair's second) of N x K, RB rows a block */
template <int K, int N, int RB, int NWT>
__device__ __forceinline__ void produce(int& j, int c, int G, unsigned ring, unsigned full, unsigned empty,
                                        const unsigned char* w0, const unsigned char* w1) {
  constexpr int BW = BLKW(K, RB), BS = RB * (K / GROUP) * 2, BB = BW + BS;
  for (int b = c; b < N / RB; b += G, ++j) {
    const int slot = j % STAGES;
    if (j >= STAGES) {
      bar_wait(empty + 8 * slot, ((j / STAGES) - 1) & 1);
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    const unsigned bar = full + 8 * slot, dst = ring + slot * SLOT;
    bar_expect(bar, NWT * BB);
#pragma unroll
    for (int t = 0; t < NWT; ++t) {
      const unsigned char* w = t ? w1 : w0;
      bulk_copy(dst + t * BB, w + (size_t)b * BW, BW, bar);
      bulk_copy(dst + t * BB + BW, w + (size_t)N * (K / 2) + (size_t)b * BS, BS, bar);
    }
  }
}

/* one phase on the consumer warps: x (K, fp32, from other CTAs: read from L2) staged as f16x2 of x / 64 (NORM:
   x * rstd * (1 + nw), rstd from NP partials), then the CTA's blocks: y = [r +] W x, or silu(Wg x) * (Wu x); ADD: a
   partial sum of y^2 per row group (RPW rows) */
template <int K, int N, int RB, int KS, int NWT, int ADD, int NORM>
__device__ __forceinline__ void consume(int& j, int c, int G, unsigned char* smem, unsigned full, unsigned empty,
                                        const float* x, const float* ss_in, int np, const float* nw, const float* r_in,
                                        float* y, float* ss_out, float eps, int warp, int lane) {
  constexpr int JC = K / 32, NGR = K / GROUP, CPG = GROUP / 32, NG = NC / KS, RPW = RB / NG, JS = JC / KS;
  constexpr int CPT = (JS + 31) / 32, BB = BLKB(K, RB), BW = BLKW(K, RB);
  static_assert(NC % KS == 0 && RB % NG == 0 && JC % KS == 0 && NG < ALL_CONSUMERS, "split");
  const int tid = warp * 32 + lane;
  float* rstd = (float*)(smem + RSTD_AT);
  if (NORM) {
    if (warp == 0) {
      float q = 0.f;
      for (int i = lane; i < np; i += 32) q += __ldcg(ss_in + i);
#pragma unroll
      for (int o = 16; o; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
      if (lane == 0) rstd[0] = rsqrtf(q / (float)K + eps);
    }
    consumers_sync();
  }
  uint4* X16 = (uint4*)(smem + X_AT);
  for (int i = tid; i < K / 8; i += 32 * NC) {
    float4 a = __ldcg((const float4*)(x + 8 * i)), b = __ldcg((const float4*)(x + 8 * i + 4));
    if (NORM) {
      const float q = rstd[0];
      const float4 na = *(const float4*)(nw + 8 * i), nb = *(const float4*)(nw + 8 * i + 4);
      a = make_float4(a.x * q * (1.f + na.x), a.y * q * (1.f + na.y), a.z * q * (1.f + na.z), a.w * q * (1.f + na.w));
      b = make_float4(b.x * q * (1.f + nb.x), b.y * q * (1.f + nb.y), b.z * q * (1.f + nb.z), b.w * q * (1.f + nb.w));
    }
    X16[i] = make_uint4(pack_half2(a.x * 0.015625f, a.y * 0.015625f), pack_half2(a.z * 0.015625f, a.w * 0.015625f),
                        pack_half2(b.x * 0.015625f, b.y * 0.015625f), pack_half2(b.z * 0.015625f, b.w * 0.015625f));
  }
  consumers_sync();
  const int grp = warp / KS, sl = warp % KS, c0 = sl * JS;
  constexpr bool XR = CPT <= XREG_MAX;
  uint4 xh[XR ? CPT : 1][4];
  if (XR) {
#pragma unroll
    for (int k = 0; k < (XR ? CPT : 1); ++k)
#pragma unroll
      for (int u = 0; u < 4; ++u)
        xh[k][u] = lane + 32 * k < JS ? X16[4 * (c0 + lane + 32 * k) + u] : make_uint4(0u, 0u, 0u, 0u);
  }
  for (int b = c, i = 0; b < N / RB; b += G, ++i, ++j) {
    const int slot = j % STAGES;
    bar_wait(full + 8 * slot, (j / STAGES) & 1);
    const unsigned char* st = smem + slot * SLOT;
    float acc[NWT][RPW];
#pragma unroll
    for (int t = 0; t < NWT; ++t)
#pragma unroll
      for (int q = 0; q < RPW; ++q) acc[t][q] = 0.f;
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const int ch = c0 + lane + 32 * k;
      if (lane + 32 * k < JS) {
        uint4 h0, h1, h2, h3;
        if (XR) {
          h0 = xh[XR ? k : 0][0]; h1 = xh[XR ? k : 0][1]; h2 = xh[XR ? k : 0][2]; h3 = xh[XR ? k : 0][3];
        } else {
          h0 = X16[4 * ch]; h1 = X16[4 * ch + 1]; h2 = X16[4 * ch + 2]; h3 = X16[4 * ch + 3];
        }
#pragma unroll
        for (int t = 0; t < NWT; ++t) {
          const uint4* W4 = (const uint4*)(st + t * BB);
          const unsigned short* S = (const unsigned short*)(st + t * BB + BW);
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
    if (KS > 1) {
      float* red = (float*)(smem + RED_AT) + ((i & 1) * NG + grp) * KS * NWT * RPW;
      if (lane == 0)
#pragma unroll
        for (int t = 0; t < NWT; ++t)
#pragma unroll
          for (int q = 0; q < RPW; ++q) red[(sl * NWT + t) * RPW + q] = acc[t][q];
      asm volatile("bar.sync %0, %1;" ::"r"(1 + grp), "r"(32 * KS) : "memory");
      if (sl != 0) continue;
#pragma unroll
      for (int t = 0; t < NWT; ++t)
#pragma unroll
        for (int q = 0; q < RPW; ++q) {
          float v = red[t * RPW + q];
          for (int s = 1; s < KS; ++s) v += red[(s * NWT + t) * RPW + q];
          acc[t][q] = v;
        }
    }
    const int row0 = b * RB + grp * RPW;
    float out[RPW];
#pragma unroll
    for (int q = 0; q < RPW; ++q) {
      if (NWT == 2) {
        const float g = 64.f * acc[0][q], u = 64.f * acc[NWT - 1][q];
        out[q] = g / (1.f + expf(-g)) * u;
      } else {
        out[q] = 64.f * acc[0][q];
      }
      if (ADD) out[q] = __ldcg(r_in + row0 + q) + out[q];
    }
    float v = out[0];
#pragma unroll
    for (int q = 1; q < RPW; ++q) v = lane == q ? out[q] : v;
    if (lane < RPW) y[row0 + lane] = v;
    if (ADD && lane == 0) {
      float sq = 0.f;
#pragma unroll
      for (int q = 0; q < RPW; ++q) sq += out[q] * out[q];
      ss_out[row0 / RPW] = sq;
    }
  }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
q4chain_mlp(const float* __restrict__ x, const float* r, const float* __restrict__ nw,
            const unsigned char* __restrict__ wo, const unsigned char* __restrict__ wg,
            const unsigned char* __restrict__ wu, const unsigned char* __restrict__ wd, float* s1, float* ss1,
            float* act, float* s2, float* ss2, unsigned* sync, float eps) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = gridDim.x, c = blockIdx.x;
  const unsigned full = smem_u32(smem + BAR_AT), empty = full + 8 * STAGES, ring = smem_u32(smem);
  if (tid == 0) ring_init(full, empty, STAGES, NC);
  __syncthreads();
  if (warp == NC) {               /* the producer: weights only, so it never waits for the previous launch */
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (lane == 0) {
      int j = 0;
      produce<K0, H0, RB0, 1>(j, c, G, ring, full, empty, wo, wo);
      produce<K1, N1, RB1, 2>(j, c, G, ring, full, empty, wg, wu);
      produce<K2, H0, RB2, 1>(j, c, G, ring, full, empty, wd, wd);
    }
    return;
  }
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  int j = 0;
  consume<K0, H0, RB0, KS0, 1, 1, 0>(j, c, G, smem, full, empty, x, nullptr, 0, nullptr, r, s1, ss1, eps, warp, lane);
  grid_sync(sync, G, tid);
  consume<K1, N1, RB1, KS1, 2, 0, 1>(j, c, G, smem, full, empty, s1, ss1, H0 / (RB0 / (NC / KS0)), nw, nullptr, act,
                                     nullptr, eps, warp, lane);
  grid_sync(sync, 2 * G, tid);
  consume<K2, H0, RB2, KS2, 1, 1, 0>(j, c, G, smem, full, empty, act, nullptr, 0, nullptr, s1, s2, ss2, eps, warp,
                                     lane);
  consumers_sync();
  if (tid == 0) {                 /* the last CTA through resets the counters for the next launch */
    unsigned done;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(done) : "l"(sync + 1) : "memory");
    if (done == G - 1) {
      sync[0] = 0;
      sync[1] = 0;
    }
  }
}
"""

# (NC, STAGES; phase splits (RB, KS) for the out projection, the pair, the down projection)
SPLITS = [(16, 2, (16, 2), (8, 2), (4, 8)), (16, 3, (16, 2), (8, 2), (4, 8)), (8, 2, (16, 1), (8, 1), (8, 8)),
          (8, 3, (16, 1), (8, 1), (8, 8)), (16, 2, (16, 4), (8, 2), (8, 16)), (16, 2, (16, 2), (16, 2), (16, 16)),
          (16, 2, (32, 4), (8, 2), (4, 8)), (16, 3, (8, 2), (8, 2), (4, 8))]
XREG_MAX = 5


def shared_bytes(c: dict) -> int:
    def blk(k, rb):
        return rb * k // 2 + rb * (k // GROUP) * 2

    slot = -(-max(blk(c["K0"], c["RB0"]), 2 * blk(c["K1"], c["RB1"]), blk(c["K2"], c["RB2"])) // 128) * 128
    red = 2 * max(c["KS0"] * c["RB0"], 2 * c["KS1"] * c["RB1"], c["KS2"] * c["RB2"]) * 4
    return c["STAGES"] * slot + 2 * max(c["K0"], c["K1"], c["K2"]) + 16 + 16 * c["STAGES"] + red


def consts(nc, stages, p0, p1, p2) -> dict:
    return {"GROUP": GROUP, "NC": nc, "STAGES": stages, "XREG_MAX": XREG_MAX, "H0": H, "N1": I,
            "K0": V, "RB0": p0[0], "KS0": p0[1], "K1": H, "RB1": p1[0], "KS1": p1[1], "K2": I, "RB2": p2[0],
            "KS2": p2[1]}


def valid(c: dict) -> bool:
    nc = c["NC"]
    for k, n, rb, ks in ((c["K0"], H, c["RB0"], c["KS0"]), (c["K1"], I, c["RB1"], c["KS1"]),
                         (c["K2"], H, c["RB2"], c["KS2"])):
        if nc % ks or rb % (nc // ks) or (k // 32) % ks or n % rb or nc // ks >= 15:
            return False
    return shared_bytes(c) + 1024 <= 227 * 1024


def compile_all(folder: str) -> None:
    from cuda.bindings import nvrtc

    from kestrel.compiler.codegen import nvrtc_version

    os.makedirs(folder, exist_ok=True)
    index = []
    for split in SPLITS:
        c = consts(*split)
        if not valid(c):
            print("skip", split)
            continue
        src = "".join(f"#define {k} {v}\n" for k, v in c.items()) + SOURCE
        _, prog = nvrtc.nvrtcCreateProgram(src.encode(), b"q4chain.cu", 0, [], [])
        (r,) = nvrtc.nvrtcCompileProgram(prog, 3, [b"--gpu-architecture=sm_90", b"-default-device", b"--std=c++17"])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        if r != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            print("compile failed", split, log.decode(errors="replace")[-2000:])
            continue
        _, size = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * size
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        f = f"c{len(index):03d}.cubin"
        open(os.path.join(folder, f), "wb").write(bytes(cubin))
        index.append({"cubin": f, "constexprs": c, "shared": shared_bytes(c), "num_warps": c["NC"] + 1,
                      "grid": [SMS, 1, 1], "compiler": nvrtc_version()})
    json.dump(index, open(os.path.join(folder, "index.json"), "w"), indent=1)
    print(len(index), "chain kernels")


def _emulate_chain(x, r, nw, wo, wg, wu, wd, c):
    """The three products in order with kernels/q4_stream.py's emulation (float64 lanes): s1, act, s2."""
    import torch

    from kestrel.kernels import q4_stream

    nc = c["NC"]
    rows0, rows2 = c["RB0"] // (nc // c["KS0"]), c["RB2"] // (nc // c["KS2"])
    s1, ss1 = torch.empty(H, device=x.device), torch.empty(H // rows0, device=x.device)
    base = dict(GROUP=GROUP, STAGES=2)
    q4_stream._emulate([1, 1, 1], x, wo, r, s1, ss1, rows0, N=H, K=V, RB=rows0 * 2, NC=2, ADD=1, BLOCK_N=rows0,
                       **base)
    act = torch.empty(I, device=x.device)
    q4_stream._emulate([1, 1, 1], s1, ss1, nw, wg, wu, act, 1e-6, N=I, K=H, RB=8, NC=2, NORM=1, NP=H // rows0,
                       SWIGLU=1, **base)
    s2, ss2 = torch.empty(H, device=x.device), torch.empty(H // rows2, device=x.device)
    q4_stream._emulate([1, 1, 1], act, wd, s1, s2, ss2, rows2, N=H, K=I, RB=rows2 * 2, NC=2, ADD=1, BLOCK_N=rows2,
                       **base)
    return s1, act, s2


def time_all(folder: str, out: str) -> None:
    """Each chain kernel checked against the emulation, then timed chained over LAYERS layers (each layer its own
    weights), beside the same three products as separate launches: Triton's three, and Triton / q4_stream pair /
    Triton (the product's default)."""
    import torch

    from kestrel.kernels import q4_stream
    from kestrel.kernels.matvec import matvec_launch, q4_pack, rmsnorm_matvec_launch
    from kestrel.kernels.targets import TARGETS
    from kestrel.runtime import cuda as kc

    kc.init()
    cu = kc.driver()
    g = torch.Generator(device="cuda").manual_seed(0)

    def weight(n, k):
        return q4_pack(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5, GROUP)

    layers = [(weight(H, V), weight(I, H), weight(I, H), weight(H, I)) for _ in range(LAYERS)]
    x = torch.randn(V, device="cuda", generator=g)
    r = torch.randn(H, device="cuda", generator=g)
    nw = torch.randn(H, device="cuda", generator=g) * 0.1
    bufs = [torch.zeros(n, device="cuda") for n in (H, H + 1, I, H, H + 1)]  # s1, ss1, act, s2, ss2
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream

    def replay_us(launches, replays=7):
        _, graph_exec = kc.chain_graph(launches, True)
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            kc.check(cu.cuGraphLaunch(graph_exec, stream), "cuGraphLaunch")
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / LAYERS)
        return statistics.median(times)

    rows = []
    types = ["*fp32"] * 3 + ["*u8"] * 4 + ["*fp32"] * 5 + ["*i32", "fp32"]
    for e in json.load(open(os.path.join(folder, "index.json"))):
        c = e["constexprs"]
        cubin = open(os.path.join(folder, e["cubin"]), "rb").read()
        kern = kc.Kernel(cubin, "q4chain_mlp", e["num_warps"], e["shared"])
        packed = [kc.PackedArgs(types, [x.data_ptr(), r.data_ptr(), nw.data_ptr(), *[w.data_ptr() for w in ws],
                                        *[b.data_ptr() for b in bufs], sync.data_ptr(), 1e-6]) for ws in layers]
        for b in bufs:
            b.fill_(float("nan"))
        try:
            kc.launch(kern, e["grid"], packed[0], stream)
            torch.cuda.synchronize()
        except Exception as ex:  # noqa: BLE001 - a split the device refuses: reported, the others still timed
            print(f"chain {c}: launch failed: {ex}", flush=True)
            continue
        ref = _emulate_chain(x, r, nw, *layers[0], c)
        errs = [((got - want).abs().max() / want.abs().max()).item()
                for got, want in zip((bufs[0], bufs[2], bufs[3]), ref)]
        us = replay_us([(kern, e["grid"], p) for p in packed])
        reset = int(sync.abs().sum().item())
        attr = cu.CUfunction_attribute
        regs = kc.check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, kern.function), "regs")
        local = kc.check(cu.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, kern.function), "local")
        rows.append({"kind": "chain", "config": {k: c[k] for k in c if k[:2] in ("NC", "ST", "RB", "KS")},
                     "us_per_layer": us, "err_s1_act_s2": errs, "sync_left": reset, "regs": regs, "local_bytes": local})
        print(f"chain {json.dumps(rows[-1]['config'])}: {us:7.2f} us a layer  err {max(errs):.1e}  sync left {reset}  "
              f"regs {regs} local {local}", flush=True)
    # the same three products as separate launches
    t = TARGETS["sm_90"]
    from kestrel.compiler.codegen import compile_kernel  # (the separate launches: compiled with the device's Triton)
    from kestrel.kernels import matvec

    sep = {}
    ss_prev = torch.rand(FORM_NP, device="cuda")
    for name, fn, launch, ty in (
            ("out_proj", matvec.matvec_add_kernel, matvec_launch(H, V, GROUP, t),
             ["*fp32", "*u8", "*fp32", "*fp32", "*fp32", "i32"]),
            ("gate_up", matvec.rmsnorm_matvec_swiglu_kernel, rmsnorm_matvec_launch(I, H, GROUP, FORM_NP, t, pair=True),
             ["*fp32", "*fp32", "*fp32", "*u8", "*u8", "*fp32", "fp32"]),
            ("down", matvec.matvec_add_kernel, matvec_launch(H, I, GROUP, t),
             ["*fp32", "*u8", "*fp32", "*fp32", "*fp32", "i32"])):
        ck = compile_kernel(name, fn, ty, launch["constexprs"], launch["num_warps"], 90, [True] * len(ty))
        sep[name] = (kc.Kernel(ck.cubin, ck.name, ck.num_warps, ck.shared, pdl=True), launch)
    pair = q4_stream.stream_launch(I, H, GROUP, t, pair=True, norm=True, partials=FORM_NP)
    ck = compile_kernel("pair", q4_stream.q4stream_norm_swiglu,
                        ["*fp32", "*fp32", "*fp32", "*u8", "*u8", "*fp32", "fp32"], pair["constexprs"],
                        pair["num_warps"], 90, [True] * 7)
    stream_pair = (kc.Kernel(ck.cubin, ck.name, ck.num_warps, ck.shared, pdl=True), pair)

    def separate(pair_kernel):
        out = []
        for wo, wg, wu, wd in layers:
            k0, l0 = sep["out_proj"]
            out.append((k0, l0["grid"], kc.PackedArgs(["*fp32", "*u8", "*fp32", "*fp32", "*fp32", "i32"],
                                                      [x.data_ptr(), wo.data_ptr(), r.data_ptr(), bufs[0].data_ptr(),
                                                       bufs[1].data_ptr(), l0["constexprs"]["BLOCK_N"]])))
            k1, l1 = pair_kernel
            out.append((k1, l1["grid"], kc.PackedArgs(["*fp32", "*fp32", "*fp32", "*u8", "*u8", "*fp32", "fp32"],
                                                      [bufs[0].data_ptr(), ss_prev.data_ptr(), nw.data_ptr(),
                                                       wg.data_ptr(), wu.data_ptr(), bufs[2].data_ptr(), 1e-6])))
            k2, l2 = sep["down"]
            out.append((k2, l2["grid"], kc.PackedArgs(["*fp32", "*u8", "*fp32", "*fp32", "*fp32", "i32"],
                                                      [bufs[2].data_ptr(), wd.data_ptr(), bufs[0].data_ptr(),
                                                       bufs[3].data_ptr(), bufs[4].data_ptr(),
                                                       l2["constexprs"]["BLOCK_N"]])))
        return out

    for kind, pk in (("triton x3", sep["gate_up"]), ("triton, q4_stream pair, triton", stream_pair)):
        us = replay_us(separate(pk))
        rows.append({"kind": kind, "us_per_layer": us})
        print(f"{kind}: {us:7.2f} us a layer", flush=True)
    nbytes = sum(w.numel() for w in layers[0])
    print(f"a layer's MLP block reads {nbytes / 1e6:.1f} MB")
    json.dump({"rows": rows, "layer_bytes": nbytes}, open(out, "w"), indent=1)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
