"""Probe (issue 13 part 4, issue 15's 70%): does a persistent kernel with grid barriers between dependent
matvecs beat the same matvecs as chained launches? The 0.8B bf16 step's products in order (per layer:
in_proj 6144 x 1024, out_proj 1024 x 2048, gate + up 7168 x 1024, down 1024 x 3584; 24 layers, 96 products,
931 MB of weights), each reading the previous product's output, run three ways from one CUDA C source:

* ``persistent``: one launch of one CTA per SM; each CTA's rows of the next product are copied into shared
  memory (cp.async, the CTA's rows are one contiguous run of the matrix) before it waits at the grid barrier
  for the current product's input; a barrier is an atomic arrival and a spin on the count;
* ``chained`` (programmatic edges) / ``plain``: one launch a product in a CUDA graph (kestrel.runtime.cuda
  chain_graph); each launch copies its rows into shared memory before its PDL wait, so what differs from the
  persistent kernel is the kernel boundary in place of the grid barrier;
* ``chained2``: chained, compiled for two CTAs an SM (registers capped at 64), so that a launch's CTAs are
  resident and copying their rows while the previous launch runs.

``-stamps`` runs (chained, chained2) record %globaltimer per product and CTA (start, release, x and weights in
shared memory, stored; the device's timer advanced in ~1 us steps) and the compute interval in SM cycles.

Every variant's result is checked against a float64 reference of the chain and against each other (the same
per-row sums in the same order: bit for bit). Times are medians of replays; the floor is the weight bytes at
the copy bandwidth measured in the same run.

Here (no GPU):   python bench/persistent_probe.py compile bench/persistent-cubins
On the device:   cd bench && python3 persistent_probe.py time persistent-cubins $OUT/persistent.json
                 (the cubin folder is git-ignored: the device call carries it, run's carry=["bench/persistent-cubins"])
"""
from __future__ import annotations

import json
import os
import statistics
import sys

THREADS = 512
RB = 4  # rows a warp multiplies at once (independent FMA chains and shuffles)
XCH = 4  # x chunks of 8 inputs a lane holds: K is cut into slices of 32 XCH chunks, one per warp of a row group
LAYER = [(6144, 1024), (1024, 2048), (7168, 1024), (1024, 3584)]  # (N, K): the 0.8B bf16 step's products
LAYERS = int(os.environ.get("KESTREL_PROBE_LAYERS", "24"))
SMS = 132  # H200; the device run checks it

SOURCE = r"""
// table: per product 4 x u64: weight (bf16 [N, K]), x (f32 [K]), y (f32 [N]), (N << 32) | K
// shared memory: the weight rows of even products at 0, of odd ones at BUF_A (persistent; a chained launch has
// its own product's rows at 0), then the staged x
extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS)
ENTRY(const unsigned long long* __restrict__ table, unsigned* __restrict__ bar, unsigned long long* __restrict__ ts,
      int p0, int p1, void* scratch0, void* scratch1) {
  extern __shared__ __align__(16) unsigned char smem[];
  // STAMPS: %globaltimer (ns) per product and CTA at: the product's start, its input released (PDL wait or
  // barrier), x staged and weights in shared memory, the results stored; then the SM cycles from the third to
  // the fourth
#define STAMP(p, i) if (STAMPS && threadIdx.x == 0) { unsigned long long t_; \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t_)); ts[((size_t)(p) * gridDim.x + blockIdx.x) * 5 + (i)] = t_; }
  long long c0_ = 0;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, G = gridDim.x, c = blockIdx.x;
  constexpr int WARPS = THREADS / 32;
  auto prefetch = [&](int p) {
    const unsigned long long* e = table + 4 * p;
    const int n = (int)(e[3] >> 32), k = (int)(e[3] & 0xffffffffu);
    const int per = (n + G - 1) / G, r0 = c * per, rows = max(0, min(per, n - r0));
    const char* src = (const char*)e[0] + (size_t)r0 * k * 2;
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem + (PERSIST && (p & 1) ? BUF_A : 0));
    const int chunks = rows * k * 2 / 16;
    for (int i = tid; i < chunks; i += THREADS)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 16 * i), "l"(src + 16 * (size_t)i) : "memory");
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  prefetch(p0);
#if PDL
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  for (int p = p0; p < p1; ++p) {
    STAMP(p, 0);
    if (PERSIST && p + 1 < p1) prefetch(p + 1);
    if (p == p0) {
#if PDL
      asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    } else {  // grid barrier: every CTA's product p - 1 is stored
      __syncthreads();
      if (tid == 0) {
        __threadfence();
        const unsigned old = atomicAdd(bar, 1u), gen = old / G + 1;
#if FLAG
        // the last to arrive raises the generation in another line; the others poll that line, not the counter
        if (old % G == G - 1) asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 32), "r"(gen) : "memory");
        else {
          unsigned seen;
          do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(bar + 32) : "memory"); }
          while ((int)(seen - gen) < 0);
        }
#else
        unsigned seen;
        do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory"); }
        while ((int)(seen - gen * G) < 0);
#endif
      }
      __syncthreads();
    }
    STAMP(p, 1);
    const unsigned long long* e = table + 4 * p;
    const int n = (int)(e[3] >> 32), k = (int)(e[3] & 0xffffffffu);
    const int per = (n + G - 1) / G, r0 = c * per, rows = max(0, min(per, n - r0));
    float4* xs = (float4*)(smem + (PERSIST ? BUF_A + BUF_B : rows * k * 2));
    const int RED_OFF = (PERSIST ? BUF_A + BUF_B : rows * k * 2) + 4 * k;  // the units' sums, after x
    const float4* x = (const float4*)e[1];
    for (int i = tid; i < k / 4; i += THREADS) xs[i] = __ldcg(x + i);  // the input staged once, all loads in flight
    float* y = (float*)e[2];
    if (PERSIST && p + 1 < p1) asm volatile("cp.async.wait_group 1;" ::: "memory");
    else asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    STAMP(p, 2);
    c0_ = clock64();
    const uint4* w = (const uint4*)(smem + (PERSIST && (p & 1) ? BUF_A : 0));
    // warp w: K slice sl = w % S of the row group w / S (rows w / S, w / S + WARPS / S, ...); a lane holds its
    // slice's x chunks (8 inputs at 8 j, j = sl * js + lane + 32 i) in registers for all its rows
    const int J = k / 8, S = (J + 32 * XCH - 1) / (32 * XCH), js = J / S, sl = warp % S, rg = WARPS / S;
    float* red = (float*)(smem + RED_OFF);
    float4 xa[XCH], xb[XCH];
#pragma unroll
    for (int i = 0; i < XCH; ++i) {
      const int j = sl * js + lane + 32 * i;
      if (j < (sl + 1) * js) { xa[i] = xs[2 * j]; xb[i] = xs[2 * j + 1]; }
      else { xa[i] = make_float4(0.f, 0.f, 0.f, 0.f); xb[i] = xa[i]; }
    }
    for (int r = warp / S; r < rows; r += RB * rg) {  // RB rows at once (rows r, r + rg, ...): independent chains
      float a[RB][2];
#pragma unroll
      for (int q = 0; q < RB; ++q) a[q][0] = a[q][1] = 0.f;
#pragma unroll
      for (int i = 0; i < XCH; ++i) {
        const int j = sl * js + lane + 32 * i;
        if (j < (sl + 1) * js) {
#pragma unroll
          for (int q = 0; q < RB; ++q) {
            if (r + q * rg < rows) {
              const uint4 w4 = w[(size_t)(r + q * rg) * J + j];
              // bf16 pairs: the low half is the even input (its bits << 16 are the f32), the high half the odd
              float a0 = a[q][0], a1 = a[q][1];
              a0 = fmaf(__uint_as_float(w4.x << 16), xa[i].x, a0); a1 = fmaf(__uint_as_float(w4.x & 0xffff0000u), xa[i].y, a1);
              a0 = fmaf(__uint_as_float(w4.y << 16), xa[i].z, a0); a1 = fmaf(__uint_as_float(w4.y & 0xffff0000u), xa[i].w, a1);
              a0 = fmaf(__uint_as_float(w4.z << 16), xb[i].x, a0); a1 = fmaf(__uint_as_float(w4.z & 0xffff0000u), xb[i].y, a1);
              a0 = fmaf(__uint_as_float(w4.w << 16), xb[i].z, a0); a1 = fmaf(__uint_as_float(w4.w & 0xffff0000u), xb[i].w, a1);
              a[q][0] = a0; a[q][1] = a1;
            }
          }
        }
      }
      float v[RB];
#pragma unroll
      for (int q = 0; q < RB; ++q) v[q] = a[q][0] + a[q][1];
#pragma unroll
      for (int o = 16; o; o >>= 1) {
#pragma unroll
        for (int q = 0; q < RB; ++q) v[q] += __shfl_xor_sync(0xffffffffu, v[q], o);
      }
#pragma unroll
      for (int q = 0; q < RB; ++q)
        if (lane == 0 && r + q * rg < rows) red[(r + q * rg) * S + sl] = v[q];
    }
    __syncthreads();
    for (int r = tid; r < rows; r += THREADS) {  // the slices in order
      float v = 0.f;
      for (int sl = 0; sl < S; ++sl) v += red[r * S + sl];
      __stcg(y + r0 + r, v);
    }
    __syncthreads();  // the weight slot and x are free for the next products
    STAMP(p, 3);
    if (STAMPS && tid == 0) ts[((size_t)p * gridDim.x + blockIdx.x) * 5 + 4] = clock64() - c0_;
  }
}
"""


def products():
    return [LAYER[i % len(LAYER)] for i in range(LAYERS * len(LAYER))]


def phase_bytes(n: int, k: int, sms: int) -> int:
    """A CTA's weight rows of one product, in shared memory."""
    return -(-n // sms) * k * 2


def consts(persist: bool, pdl: bool, flag: int, sms: int, stamps: bool = False) -> dict:
    return {"THREADS": THREADS, "PERSIST": int(persist), "PDL": int(pdl), "FLAG": flag if persist else 0,
            "MIN_CTAS": 1 if persist else max(1, flag), "STAMPS": int(stamps), "XCH": XCH, "RB": RB,
            "BUF_A": max(phase_bytes(n, k, sms) for n, k in LAYER[0::2]),
            "BUF_B": max(phase_bytes(n, k, sms) for n, k in LAYER[1::2])}


def shared_bytes(c: dict, n: int = 0, k: int = 0, sms: int = SMS) -> int:
    """Persistent: both weight slots and the widest x; chained: the launch's own product and its x."""
    red = 4 * 16 * max(-(-n // sms) for n, _ in LAYER)  # each row's slice sums (at most 16 slices)
    if c["PERSIST"]:
        return c["BUF_A"] + c["BUF_B"] + 4 * max(k for _, k in LAYER) + red
    return phase_bytes(n, k, sms) + 4 * k + red


# name: (PERSIST, PDL, the third constant): for the persistent kernel FLAG (1: the barrier's waiters poll a flag line the
# last arrival raises, not the count), for chained ones MIN_CTAS (2: registers capped so that two CTAs fit an SM)
VARIANTS = {"persistent": (True, False, 0), "persistent-flag": (True, False, 1), "chained": (False, True, 0),
            "plain": (False, False, 0), "chained2": (False, True, 2)}
STAMPED = ("chained", "chained2")  # also compiled with STAMPS, run once more for the timeline


TYPES = ["*u64", "*u32", "*u64", "i32", "i32"]


def compile_all(folder: str) -> None:
    from kestrel.compiler.codegen import compile_cuda
    from kestrel.kernels.q4_mma import CudaKernel

    os.makedirs(folder, exist_ok=True)
    for name, persist, pdl, flag, stamps in [(n, *v, False) for n, v in VARIANTS.items()] + \
            [(n + "-stamps", *VARIANTS[n], True) for n in STAMPED]:
        c = consts(persist, pdl, flag, SMS, stamps)
        fn = CudaKernel(f"mv_{name.replace('-', '_')}", "bench.persistent_probe", SOURCE, ("table", "bar", "ts", "p0", "p1"), tuple(c),
                        lambda cc: shared_bytes(cc, *max(LAYER, key=lambda nk: phase_bytes(*nk, SMS))), None)
        ck = compile_cuda(fn.name, fn, TYPES, c, THREADS // 32, 90)
        open(os.path.join(folder, f"{name}.cubin"), "wb").write(ck.cubin)
        json.dump({"consts": c, "shared": ck.shared, "name": fn.name}, open(os.path.join(folder, f"{name}.json"), "w"))
        print(name, len(ck.cubin), "bytes,", ck.shared, "B shared")


def _kernel(kc, cubin: bytes, name: str, shared: int, pdl: bool):
    """The cubin's entry with ``shared`` bytes of dynamic shared memory, preferring the whole carveout as shared
    memory: a chained launch's CTAs then fit beside the previous launch's (stop 19's carveout_probe)."""
    k = kc.Kernel(cubin, name, THREADS // 32, shared, pdl=pdl)
    cu = kc.driver()
    kc.check(cu.cuFuncSetAttribute(k.function, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                   100), "cuFuncSetAttribute (carveout)")
    return k


def time_all(folder: str, out: str) -> None:
    import torch

    from kestrel.runtime import cuda as kc
    from kestrel.runtime.bench import copy_bandwidth

    kc.init()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert sms == SMS, f"compiled for {SMS} SMs, the device has {sms}"
    prods = products()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16) for n, k in prods]
    x0 = torch.randn(prods[0][1], device="cuda", generator=gen)
    ys = [torch.zeros(n, device="cuda") for n, _ in prods]
    xs = [x0] + [ys[i][: prods[i + 1][1]] for i in range(len(prods) - 1)]
    table = torch.tensor([[w.data_ptr(), x.data_ptr(), y.data_ptr(), (n << 32) | k]
                          for w, x, y, (n, k) in zip(ws, xs, ys, prods)], dtype=torch.int64, device="cuda")
    bar = torch.zeros(64, dtype=torch.int32, device="cuda")  # the count, and the generation flag 128 bytes on
    ref = x0.double()
    for w, (n, k) in zip(ws, prods):
        ref = w.double() @ ref[:k]
    weight_bytes = sum(w.numel() * 2 for w in ws)
    report = {"products": len(prods), "weight_mb": weight_bytes / 1e6, "sms": sms}
    results = {}
    ts = torch.zeros(len(prods) * sms * 5, dtype=torch.int64, device="cuda")
    runs = [(n, *v) for n, v in VARIANTS.items()] + [(n + "-stamps", *VARIANTS[n]) for n in STAMPED]
    for name, persist, pdl, _ in runs:
        meta = json.load(open(os.path.join(folder, f"{name}.json")))
        cubin = open(os.path.join(folder, f"{name}.cubin"), "rb").read()
        ptrs = [table.data_ptr(), bar.data_ptr(), ts.data_ptr()]
        if persist:
            kern = _kernel(kc, cubin, meta["name"], meta["shared"], pdl)
            launches = [(kern, (sms, 1, 1), kc.PackedArgs(TYPES, ptrs + [0, len(prods)]))]
        else:  # each launch its own product's shared memory, so that the next launch's CTAs fit beside it
            kerns = {nk: _kernel(kc, cubin, meta["name"], shared_bytes(meta["consts"], *nk, sms), pdl) for nk in LAYER}
            launches = [(kerns[prods[p]], (sms, 1, 1), kc.PackedArgs(TYPES, ptrs + [p, p + 1])) for p in range(len(prods))]
        _, gexec = kc.chain_graph(launches, pdl)
        stream = torch.cuda.Stream()
        cu = kc.driver()
        times = []
        for i in range(25):
            for y in ys:
                y.zero_()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(stream)
            kc.check(cu.cuGraphLaunch(gexec, stream.cuda_stream), "cuGraphLaunch")
            e.record(stream)
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3)
        got = ys[-1].double()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        results[name] = ys[-1].clone()
        med = statistics.median(times[5:])
        report[name] = {"us": med, "us_per_product": med / len(prods), "times_us": times, "max_rel_err": err}
        print(f"{name:17s} {med:9.1f} us  {med / len(prods):6.2f} us a product  rel err {err:.2e}", flush=True)
        if name.endswith("-stamps"):  # the last replay's timeline: per product, medians over CTAs (us)
            t = ts.view(len(prods), sms, 5).double()
            cycles = t[:, :, 4]
            t = t[:, :, :4] / 1e3
            t = t - t[0, :, 0].min()
            start, released, ready, stored = (t[:, :, i] for i in range(4))
            first = start.min(1).values
            phases = {"released_after_start": (released - start).median(1).values,
                      "ready_after_released": (ready - released).median(1).values,
                      "stored_after_ready": (stored - ready).median(1).values,
                      "last_store_to_first_release": released.min(1).values[1:] - stored.max(1).values[:-1],
                      "store_spread": stored.max(1).values - stored.min(1).values,
                      "product": first[1:] - first[:-1],
                      "compute_cycles_max": cycles.max(1).values}
            report[name]["timeline_us"] = {k: [round(x, 3) for x in v.tolist()] for k, v in phases.items()}
            print("   ", ", ".join(f"{k} {statistics.median(v.tolist()):.2f}" for k, v in phases.items()), flush=True)
    bw = copy_bandwidth(torch.cuda.current_stream().cuda_stream) / 1e9
    report["copy_gbs"] = bw
    report["floor_us"] = weight_bytes / (bw * 1e3)
    report["bit_equal"] = {n: bool(torch.equal(results[n], results["persistent"])) for n in results}

    for name in report:
        if isinstance(report[name], dict) and "us" in report[name]:
            report[name]["of_floor"] = report["floor_us"] / report[name]["us"]
    print(f"floor {report['floor_us']:.1f} us ({weight_bytes / 1e6:.0f} MB at {bw:.0f} GB/s); bit-equal "
          f"{report['bit_equal']}")
    json.dump(report, open(out, "w"), indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        compile_all(sys.argv[2])
    else:
        time_all(sys.argv[2], sys.argv[3])
