"""Probe: a hand-written q4 matrix product for 1-8 rows of x on the tensor cores (issue 13 part 3:
q4 decode at 85% of the bandwidth; issue 12: the verify step at k + 1 rows near the one-row step).

Triton's q4 kernels are bound by instructions (bench/results/stop21: ~3 per weight in the matvec, and
the tensor-core forms lose more to layout changes). Here, CUDA C through NVRTC (DESIGN: "CUDA C via
NVRTC where Triton falls short"), the weight is repacked so that one 32-bit word is exactly one
lane's A fragment of an m16n8k16 MMA (rows g, g + 8 and inputs 2t, 2t + 1, 2t + 8, 2t + 9 of a
16 x 16 tile, lane = 4g + t): a lane's 16-byte load is its fragments for four k-tiles (64 inputs),
a warp's 512 bytes one contiguous 16-row x 64-input block. Per word: 4 LOP3 + 1 shift make four
f16x2 of 1024 + q (nibbles p, p + 4 go to one register's halves), 2 HSUB2 + 2 HFMA2 make (q - 8)
exactly, one MMA multiplies them by x / 64 in f16 (B operand: x row g, staged once per CTA in shared
memory, converted once) into an fp32 accumulator; each 128-input group's sum is scaled once. A CTA is
one 16-row block; its warps split K and their sums meet in shared memory in warp order
(deterministic). Rows of x past M are zero (MMA columns wasted, the weight read once for all).

Here (no GPU):   python bench/q4frag_probe.py compile DIR        (needs nvidia-cuda-nvrtc)
On the device:   cd bench && python3 q4frag_probe.py time DIR $OUT/q4frag.json
"""
from __future__ import annotations

import itertools
import json
import os
import sys

GROUP = 128
SHAPES = {"27b-in_proj": (16480, 5120), "27b-qkv": (14336, 5120), "27b-o_proj": (5120, 6144),
          "27b-down": (5120, 17408), "27b-gate": (17408, 5120)}

SRC = r"""
#define KB (K / 64)
#define KT (K / 16)
#define GPB (GROUP / 64)

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
  return r;
}

__device__ __forceinline__ void mma_word(unsigned q, unsigned b0, unsigned b1, float* c) {
  unsigned a0, a1, a2, a3, t = q >> 8;
  asm("lop3.b32 %0, %1, 0x000f000f, 0x64006400, 0xea;" : "=r"(a0) : "r"(q));
  asm("lop3.b32 %0, %1, 0x00f000f0, 0x64006400, 0xea;" : "=r"(a1) : "r"(q));
  asm("lop3.b32 %0, %1, 0x000f000f, 0x64006400, 0xea;" : "=r"(a2) : "r"(t));
  asm("lop3.b32 %0, %1, 0x00f000f0, 0x64006400, 0xea;" : "=r"(a3) : "r"(t));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(a0) : "r"(0x64086408u));
  asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(a1) : "r"(0x2c002c00u), "r"(0xd480d480u));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(a2) : "r"(0x64086408u));
  asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(a3) : "r"(0x2c002c00u), "r"(0xd480d480u));
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

template <int D>
__device__ __forceinline__ void groups(const uint4* __restrict__ wp, const unsigned short* __restrict__ sp,
                                       const unsigned* xs, int kb, int gx, int g, int t, float* tot) {
  uint4 q[GPB * D];
#pragma unroll
  for (int i = 0; i < GPB * D; i++) q[i] = ldg_stream(wp + (size_t)(kb + i) * 32);
#pragma unroll
  for (int d = 0; d < D; d++) {
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < GPB; i++) {
      const int kt = (kb + d * GPB + i) * 4;
      unsigned words[4] = {q[d * GPB + i].x, q[d * GPB + i].y, q[d * GPB + i].z, q[d * GPB + i].w};
#pragma unroll
      for (int j = 0; j < 4; j++)  // lanes past x's rows read its last row (their columns are not stored)
        mma_word(words[j], xs[((kt + j) * M + gx) * 8 + t], xs[((kt + j) * M + gx) * 8 + t + 4], c);
    }
    const int grp = (kb + d * GPB) / GPB;
    unsigned short h0 = sp[grp * 16 + g], h1 = sp[grp * 16 + g + 8];
    float s0f, s1f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(s0f) : "h"(h0));
    asm("cvt.f32.f16 %0, %1;" : "=f"(s1f) : "h"(h1));
    tot[0] += c[0] * s0f; tot[1] += c[1] * s0f; tot[2] += c[2] * s1f; tot[3] += c[3] * s1f;
  }
}

// y [M, N] = x [M, K] @ W^T. w: [N/16][K/64][32 lanes] uint4 (fragment layout); sc: [N/16][K/GROUP][16] f16
// PERSIST: each warp takes whole 16-row blocks (blockIdx.x * WARPS + warp, then every gridDim.x * WARPS-th):
// x is staged once per CTA for all its blocks, and no warp waits on another. Else a CTA is one block,
// its warps splitting K (a reduction in shared memory).
extern "C" __global__ void __launch_bounds__(32 * WARPS) q4frag(const float* __restrict__ x, const uint4* __restrict__ w,
                                                                 const unsigned short* __restrict__ sc,
                                                                 float* __restrict__ y, void* s0, void* s1) {
  extern __shared__ unsigned xs[];  // [KT][M][8] f16x2: word j of (kt, n) = x_n[16 kt + 2j .. + 1] / 64
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  for (int i = threadIdx.x; i < M * (K / 2); i += 32 * WARPS) {
    int n = i / (K / 2), p = i - n * (K / 2);
    float2 f = reinterpret_cast<const float2*>(x + (size_t)n * K)[p];
    xs[((p >> 3) * M + n) * 8 + (p & 7)] = pack_half2(f.x * 0.015625f, f.y * 0.015625f);
  }
  __syncthreads();
  const int ng = K / GROUP;
  const int gx = g < M ? g : M - 1;
#if PERSIST
  for (int rb = blockIdx.x * WARPS + warp; rb < N / 16; rb += gridDim.x * WARPS) {
    float tot[4] = {0.f, 0.f, 0.f, 0.f};
    const uint4* wp = w + ((size_t)rb * KB) * 32 + lane;
    const unsigned short* sp = sc + (size_t)rb * ng * 16;
    int kb = 0;
    for (; kb + GPB * DEPTH <= KB; kb += GPB * DEPTH) groups<DEPTH>(wp, sp, xs, kb, gx, g, t, tot);
    for (; kb < KB; kb += GPB) groups<1>(wp, sp, xs, kb, gx, g, t, tot);
    const int r0 = rb * 16 + g, n0 = 2 * t;
    if (n0 < M) { y[(size_t)n0 * N + r0] = 64.f * tot[0]; y[(size_t)n0 * N + r0 + 8] = 64.f * tot[2]; }
    if (n0 + 1 < M) { y[(size_t)(n0 + 1) * N + r0] = 64.f * tot[1]; y[(size_t)(n0 + 1) * N + r0 + 8] = 64.f * tot[3]; }
  }
#else
  const int rb = blockIdx.x;
  float tot[4] = {0.f, 0.f, 0.f, 0.f};
  const int kb1 = (warp + 1) * ng / WARPS * GPB;
  const uint4* wp = w + ((size_t)rb * KB) * 32 + lane;
  const unsigned short* sp = sc + (size_t)rb * ng * 16;
  int kb = warp * ng / WARPS * GPB;
  for (; kb + GPB * DEPTH <= kb1; kb += GPB * DEPTH) groups<DEPTH>(wp, sp, xs, kb, gx, g, t, tot);
  for (; kb < kb1; kb += GPB) groups<1>(wp, sp, xs, kb, gx, g, t, tot);
  __syncthreads();  // every warp is done with xs: reuse it for the sums
  float* red = reinterpret_cast<float*>(xs);
#pragma unroll
  for (int i = 0; i < 4; i++) red[(warp * 32 + lane) * 4 + i] = tot[i];
  __syncthreads();
  if (warp == 0) {
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    for (int v = 0; v < WARPS; v++)
#pragma unroll
      for (int i = 0; i < 4; i++) s[i] += red[(v * 32 + lane) * 4 + i];
    const int r0 = rb * 16 + g, n0 = 2 * t;
    if (n0 < M) { y[(size_t)n0 * N + r0] = 64.f * s[0]; y[(size_t)n0 * N + r0 + 8] = 64.f * s[2]; }
    if (n0 + 1 < M) { y[(size_t)(n0 + 1) * N + r0] = 64.f * s[1]; y[(size_t)(n0 + 1) * N + r0 + 8] = 64.f * s[3]; }
  }
#endif
}
"""


def smem_bytes(m: int, k: int, warps: int) -> int:
    return max(2 * k * m, warps * 32 * 4 * 4)


def compile_one(n, k, m, warps, depth, persist=0):
    from cuda.bindings import nvrtc

    defs = (f"#define N {n}\n#define K {k}\n#define M {m}\n#define GROUP {GROUP}\n#define WARPS {warps}\n"
            f"#define DEPTH {depth}\n#define PERSIST {persist}\n")
    err, prog = nvrtc.nvrtcCreateProgram((defs + SRC).encode(), b"q4frag.cu", 0, [], [])
    (r,) = nvrtc.nvrtcCompileProgram(prog, 3, [b"--gpu-architecture=sm_90a", b"-default-device", b"--std=c++17"])
    if r != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(log.decode())
    _, size = nvrtc.nvrtcGetCUBINSize(prog)
    cubin = b" " * size
    nvrtc.nvrtcGetCUBIN(prog, cubin)
    return cubin


def compile_all(folder):
    os.makedirs(folder, exist_ok=True)
    index = []
    for (name, (n, k)), m, warps, depth, persist in itertools.product(SHAPES.items(), (1, 4), (4, 8), (2, 4, 8),
                                                                      (0, 1, 2, 4)):
        if persist and warps == 4:
            continue
        cubin = compile_one(n, k, m, warps, depth, int(persist > 0))
        f = f"{name}-m{m}-w{warps}-d{depth}-p{persist}.cubin"
        open(os.path.join(folder, f), "wb").write(cubin)
        # persist: that many CTAs per SM (132 SMs), each warp taking whole 16-row blocks
        grid = min(-(-n // 16 // warps), 132 * persist) if persist else n // 16
        index.append(dict(shape=name, N=n, K=k, M=m, warps=warps, depth=depth, persist=persist, grid=grid, cubin=f,
                          shared=smem_bytes(m, k, warps)))
    json.dump(index, open(os.path.join(folder, "index.json"), "w"), indent=1)
    print(len(index), "variants")


def repack(q, scales, n, k):
    """q (q - 8, int8 [N, K]) and scales (fp32 [N, K/G]) -> (fragment-layout words as bytes, scales
    [N/16][K/G][16] f16 as bytes). Word (block rb, kb, lane 4g + t, k-tile kt): nibble (hk * 2 + h) +
    4e holds row 16 rb + 8h + g, input 64 kb + 16 kt + 8hk + 2t + e."""
    import torch

    c = (q.to(torch.int64) + 8).reshape(n // 16, 2, 8, k // 64, 4, 2, 4, 2)  # rb, h, g, kb, kt, hk, t, e
    c = c.permute(0, 3, 2, 6, 4, 1, 5, 7)  # rb, kb, g, t, kt, h, hk, e
    shift = torch.tensor([[[4 * ((hk * 2 + h) + 4 * e) for e in range(2)] for hk in range(2)] for h in range(2)],
                         device=q.device)
    words = (c << shift).sum(dim=(-3, -2, -1))  # rb, kb, g, t, kt
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).contiguous()
    s = scales.to(torch.float16).reshape(n // 16, 16, -1).permute(0, 2, 1).contiguous()
    return words.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8)


def time_all(folder, out):
    import math
    import statistics

    import torch

    from graph_timing import launch_times_us, rotating_copies
    from kestrel.kernels.matvec import q4_codes, q4_pack
    from kestrel.runtime import cuda as kc

    torch.zeros(1, device="cuda")
    kc.init(0)
    index = json.load(open(os.path.join(folder, "index.json")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    data, rows = {}, []
    for e in index:
        n, k, m = e["N"], e["K"], e["M"]
        key = (e["shape"], m)
        if key not in data:
            data.clear()
            torch.cuda.empty_cache()
            wf = torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)
            q, sc = q4_codes(q4_pack(wf, GROUP), n, k, GROUP)
            words, scales = repack(q, sc, n, k)
            x = torch.randn(m, k, generator=gen, device="cuda")
            xh = (x / 64).half().double()
            deq = (q.double().reshape(n, k // GROUP, GROUP) * sc.double()[:, :, None]).reshape(n, k)
            ref = (xh @ deq.T * 64).float()
            nbytes = words.numel() + scales.numel()
            copies = rotating_copies(nbytes)
            sets = [(words, scales) if i == 0 else (words.clone(), scales.clone()) for i in range(copies)]
            data[key] = (x, sets, ref, nbytes)
        x, sets, ref, nbytes = data[key]
        kern = kc.Kernel(open(os.path.join(folder, e["cubin"]), "rb").read(), "q4frag", e["warps"], e["shared"])
        y = torch.full((m, n), float("nan"), device="cuda")
        grid = [e["grid"], 1, 1]
        types = ["*fp32", "*u8", "*u8", "*fp32"]
        packed = [kc.PackedArgs(types, [x.data_ptr(), wv.data_ptr(), sv.data_ptr(), y.data_ptr()]) for wv, sv in sets]
        kc.launch(kern, grid, packed[0], 0)
        torch.cuda.synchronize()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        us = statistics.median(launch_times_us(kern, grid, packed, replays=8))
        r = dict(e, us=us, GBps=nbytes / us / 1e3, err=err)
        rows.append(r)
        print(f"{e['shape']:12} M={m} warps={e['warps']} depth={e['depth']} persist={e['persist']} {us:8.2f} us {r['GBps']:6.0f} GB/s "
              f"err {err:.1e}", flush=True)
    json.dump(rows, open(out, "w"), indent=1)
    print("\nbest per shape and M:")
    for key in dict.fromkeys((r["shape"], r["M"]) for r in rows):
        r = min((r for r in rows if (r["shape"], r["M"]) == key and r["err"] < 1e-5), key=lambda r: r["us"])
        print(f"{key[0]:12} M={key[1]} warps={r['warps']} depth={r['depth']} persist={r['persist']} {r['us']:8.2f} us "
              f"{r['GBps']:6.0f} GB/s")


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
