"""The q4 matrix product for a few rows of x on the tensor cores: y [M, N] = x [M, K] @ W^T, W in the q4
layout of kernels/matvec.py (unchanged: the one-token matvec reads the same bytes), 1 <= M <= 16.

CUDA C compiled by NVRTC (DESIGN: "CUDA C via NVRTC where Triton falls short"): Triton's few-rows q4
kernel spends 9 + 7 R instructions per 8 weights for R rows (f16x2 products per row); Triton's own
tensor-core GEMM loses more to its layout changes (bench/results/stop21). Here each weight is converted
once and multiplied by every row of x in one MMA instruction (mma.sync m16n8k16, f16 operands, fp32
accumulation): by the source, ~21 instructions per 16 weights whatever M <= 8 (the SASS not counted).

How the q4 words map to MMA fragments (no repacking). A warp owns 16 weight rows r0 .. r0 + 15. Lane
(g, t) = (lane / 4, lane % 4) loads V = GROUP / 32 consecutive 32-bit words of rows r0 + g and r0 + g + 8,
words t V .. t V + V - 1 of one group (a group is 4 V words: the warp reads the group whole). A word
holds inputs 8j .. 8j + 7 with the even inputs in the low 16 bits (Q4_NIBBLE): masked with 0x000F000F,
0x00F000F0 (and the same after a shift by 8) and OR-ed with 0x6400 it gives the f16x2 pairs of inputs
(0, 1), (2, 3), (4, 5), (6, 7) of the word as 1024 + q (or 1024 + 16 q), and one HSUB2 / HFMA2 makes
them q - 8, exactly. A 16 x 16 A fragment (rows g and g + 8; "inputs" 2t, 2t + 1, 2t + 8, 2t + 9) takes
pairs (0, 1) and (2, 3) of the lane's word (the tile's 16 inputs are 4 inputs of each of the 4 lanes'
words: the MMA sums over them, so any assignment works as long as B's lane t holds x at the same
inputs); pairs (4, 5) and (6, 7) make a second tile. B (x, 8 columns = x rows; g >= M reads row M - 1,
its column is not stored) comes from shared memory, where the CTA stages its K-range of x once as
f16x2 of x / 64 (one 16-byte load gives a lane both tiles' B fragments). A group's MMAs accumulate in
fp32 from zero; the sum is multiplied by the rows' scales (fp32) and added to the row's total; 64
times the total is y.

Work split: a CTA is RB row blocks x KS warps each (warp (rb, ks) takes the ks-th run of the CTA's
groups); a cluster of CS CTAs (sm_90: thread-block clusters) splits K into CS ranges, one per CTA. The
warps' totals meet in shared memory in ks order, then the cluster's CTAs' in rank order (read by rank 0
through distributed shared memory): the result does not depend on timing. ``PDL``: the kernel waits for
the previous kernel of the step before it reads x (kernels/pdl.py). ``SWIGLU``: two weights (gate and
up) over the same x, y = silu(gate) * up.

Options (constexprs; the launch rule picks them, stop 26's chained sweeps): ``STAGES`` > 0, each lane copies
its words and their scales with cp.async into its warp's ring STAGES - 1 groups ahead of the MMAs (the
non-grouped kernel issues the first ones before its PDL wait, so it streams weights while the previous kernel
finishes); ``PERSIST``, the grid's clusters loop over the row blocks and x is staged once per CTA; ``ADD``
(matmul_add, passes/fold_row_norms.py), y = r + W x and each row's sum of y^2 per 16 outputs; ``NORM``
(rmsnorm_matmul), x normed while it is staged, each row's rstd from the producer's NP partials.

The reference (``q4_mma_ref``): x / 64 rounded to fp16, each group's products (q - 8) * xh summed
exactly, times the group's scale, the groups summed, times 64. The GPU sums a group's products in the
MMA's fp32 accumulator and the groups in fp32: within 2.4e-7 of max |y| at every configuration swept on
the H200 (bench/results/stop25), not bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kestrel.kernels.matvec import Q4_X_SCALE, q4_codes

MAX_ROWS = 16  # two MMA column tiles of 8
PAD_BYTES = 64  # each staged x row is padded so rows g and g + 1 fall in different bank halves
NORM_PARTIAL_ROWS = 16  # ADD: one partial sum of squares per row block of 16 outputs (the warp that stores them)
CTA_RESERVED_SMEM = 1024  # shared memory the hardware reserves per resident CTA (sm_80 on)


@dataclass(frozen=True)
class CudaKernel:
    """A kernel written in CUDA C: ``source`` is compiled by NVRTC (compiler/codegen.py) with one
    ``#define`` per constexpr; ``emulate`` runs a launch on the CPU (the launch-plan tests, where Triton
    kernels run in its interpreter); ``shared(consts)`` is its dynamic shared memory in bytes."""

    name: str
    module: str
    source: str
    params: tuple[str, ...]  # runtime parameters, in order (the op's operands and results)
    constexprs: tuple[str, ...]
    shared: object
    emulate: object

    def __getitem__(self, grid):
        return lambda *args, **consts: self.emulate(grid, *args, **consts)

    @property
    def arg_names(self) -> list[str]:
        """All parameters, as a Triton function lists them: the runtime ones, then the constexprs."""
        return list(self.params) + list(self.constexprs)

    @property
    def jit_name(self) -> str:
        return f"{self.module}:{self.name}"


def q4_mma_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] (fp32), q (q - 8, int8 [N, K]), scales (fp32 [N, K / G]) -> y [M, N] as the kernel defines
    it (module doc): float64 sums of fp16(x / 64) * (q - 8) per group, scaled, summed, times 64, to fp32."""
    m, k = x.shape
    n = q.shape[0]
    xh = (x.float() / Q4_X_SCALE).half().double().reshape(m, k // group, group)
    qg = q.double().reshape(n, k // group, group)
    sums = torch.einsum("mgi,ngi->mng", xh, qg)  # exact: |terms| < 2**-1 * 2**16, few enough
    return ((sums * scales.double()[None]).sum(-1) * Q4_X_SCALE).float()


def q4_mma_swiglu_ref(x, qg, sg, qu, su, group: int) -> torch.Tensor:
    g, u = q4_mma_ref(x, qg, sg, group), q4_mma_ref(x, qu, su, group)
    return g / (1.0 + torch.exp(-g)) * u


def ring_bytes(consts: dict) -> int:
    """The cp.async ring (STAGES > 0): per warp, stage and weight, each lane's words of rows g and g + 8 and
    (q4) the 32-bit words holding their scales; bf16 (WBF16): 16-byte words, no scales."""
    v = consts["GROUP"] // 32
    nw = 2 if consts["SWIGLU"] else 1
    per = 2 * 32 * 16 if consts.get("WBF16") else 2 * 32 * 4 * v + 2 * 32 * 4
    return consts["RB"] * consts["KS"] * consts.get("STAGES", 0) * nw * per


def shared_bytes(consts: dict) -> int:
    """The staged x, the ring, the rows' rstd (NORM), then the warps' and the CTA's sums: over the staged x,
    or after it where x stays for the next row-block group (PERSIST)."""
    m, k, cs = consts["M"], consts["K"], consts["CS"]
    xv = 2 if consts.get("WBF16") else 1  # bf16: x staged as hi and lo rows
    warps = consts["RB"] * consts["KS"]
    nt, nw = -(-xv * m // 8), 2 if consts["SWIGLU"] else 1
    staged = xv * m * (2 * (k // cs) + PAD_BYTES)
    red = warps * 32 * nt * 4 * nw * 4
    part = consts["RB"] * 32 * nt * 4 * nw * 4
    front = staged + ring_bytes(consts) + (4 * m if consts.get("NORM") else 0)
    if consts.get("PERSIST"):
        return -(-front // 16) * 16 + red + part
    return max(front, red + part)


def launch(m: int, n: int, k: int, group: int, rb: int, ks: int, cs: int, depth: int, swiglu: bool,
           stages: int = 0, persist: int = 0, bf16: bool = False) -> dict:
    """The launch of one configuration: grid [CS x ceil(N / 16 RB)], RB x KS warps; ``persist`` > 0: at most
    that many clusters, each looping over the row-block groups (PERSIST). ``bf16``: bf16 weights (WBF16,
    kernels/bf16_mma.py; group 32)."""
    consts = {"M": m, "N": n, "K": k, "GROUP": group, "RB": rb, "KS": ks, "CS": cs, "DEPTH": depth,
              "SWIGLU": int(swiglu), "STAGES": stages, "PERSIST": int(persist > 0)} | ({"WBF16": 1} if bf16 else {})
    groups = -(-n // (16 * rb))
    return {"grid": [cs * (min(groups, persist) if persist else groups), 1, 1], "num_warps": rb * ks,
            "constexprs": consts}


def rule_launch(m: int, n: int, k: int, group: int, target, pair: bool = False, norm: bool = False,
                bf16: bool = False) -> dict | None:
    """The launch ``target.rules["q4_mma"]`` gives a q4 matmul at m rows, or None where the kernel is not
    used (m past the rule's max_rows, or no configuration fits the shape and target). ``norm``: the input
    normed in the kernel (its rstd in shared memory). ``bf16``: a bf16 matmul under ``rules["bf16_mma"]``
    (kernels/bf16_mma.py; ``group`` 32)."""
    r = target.rules["bf16_mma" if bf16 else "q4_mma"]
    if not 2 <= m <= r.max_rows or r.max_weight_bytes and n * k * (2 if bf16 else 0.5) > r.max_weight_bytes:
        return None
    rb, ks0, stages = ((r.swiglu_rb, r.swiglu_ks, r.swiglu_stages) if pair and r.swiglu_rb
                       else (r.rb, r.ks, r.stages))
    blocks = -(-n // (16 * rb))
    options = []  # (CTAs per cluster, warps per row block, stages): KS at most the CTA's groups; the ring
    for st in dict.fromkeys((stages, 0)):  # where it fits (sm_80 and later, shared memory), else registers
        for cs in r.clusters:
            ks = min(ks0, k // group // cs)
            if ks >= 1 and fits(m, n, k, group, rb, ks, cs, target, pair, st, norm, bf16=bf16) is None:
                options.append((cs, ks, st))
        if options:
            break
    if not options:
        return None
    cs, ks, st = next((o for o in options if o[0] * blocks >= r.ctas_per_sm * target.sms), options[-1])
    c = launch(m, n, k, group, rb, ks, cs, r.depth, pair, st, bf16=bf16)
    # the pair persistent, per_sm CTAs an SM, where that many fit one (at up to swiglu_persist_rows rows)
    per_sm = r.swiglu_persist if pair and m <= r.swiglu_persist_rows else 0
    if per_sm and blocks > per_sm * target.sms and (ks_p := min(ks0, k // group)) >= 1 and fits(
            m, n, k, group, rb, ks_p, 1, target, pair, 0, norm, persist=True, bf16=bf16) is None:
        p = launch(m, n, k, group, rb, ks_p, 1, r.depth, pair, 0, per_sm * target.sms, bf16=bf16)
        if per_sm * (shared_bytes(p["constexprs"] | {"NORM": int(norm)}) + CTA_RESERVED_SMEM) <= \
                target.smem_optin + CTA_RESERVED_SMEM:  # (an SM holds the opt-in maximum plus one reservation)
            c = p
    if norm:
        c["constexprs"] |= {"NORM": 1, "NP": k // NORM_PARTIAL_ROWS}
    return c


def add_launch(m: int, n: int, k: int, group: int, target, bf16: bool = False) -> dict | None:
    """matmul_add at m rows (the residual add folded in: passes/fold_row_norms.py): rule_launch's split,
    with ADD and BLOCK_N, the outputs per partial sum of squares (NORM_PARTIAL_ROWS, one row block)."""
    c = rule_launch(m, n, k, group, target, bf16=bf16)
    if c is not None:
        c["constexprs"] |= {"ADD": 1, "BLOCK_N": NORM_PARTIAL_ROWS}
    return c


def _grouped_split(m: int, n: int, k: int, group: int, target, gate_up: bool) -> tuple[int, int, int] | None:
    """(RB, KS, STAGES) of a grouped product at chunks of m pairs: the rule's (gate / up: its own KS and ring,
    the register form where the ring does not fit), or None where neither fits."""
    r = target.rules["q4_mma"]
    ks = max(1, min(r.grouped_swiglu_ks if gate_up and r.grouped_swiglu_ks else r.grouped_ks, k // group))
    for st in dict.fromkeys((r.grouped_swiglu_stages if gate_up else 0, 0)):
        if fits(m, n, k, group, r.grouped_rb, ks, 1, target, gate_up, st) is None:
            return r.grouped_rb, ks, st
    return None


def grouped_rows(e: int, inter: int, hidden: int, groups: tuple[int, int], target) -> int | None:
    """Rows a chunk of Qwen3-Next's grouped experts holds when both its q4 products (gate / up [E I, H] and
    down [E H, I]) run this kernel on ``target`` (``target.rules["q4_mma"].grouped_rows``), else None (the
    Triton few-rows kernels, kernels/moe.py's GROUPED_CHUNK). ``groups``: the q4 groups of gate / up and of
    down. select_kernels sizes the chunk table by it."""
    m = target.rules["q4_mma"].grouped_rows
    if not m:
        return None
    for (n, k, pair), group in zip(((inter, hidden, True), (hidden, inter, False)), groups):
        if _grouped_split(m, n, k, group, target, pair) is None:
            return None
    return m


def grouped_launch(pairs: int, e: int, n: int, k: int, group: int, chunks: int, target, gate_up: bool) -> dict:
    """moe_gate_up_grouped's (``gate_up``: n = I, k = H) or moe_down_grouped's (n = H, k = I) launch: grid
    [row blocks / RB, the chunk table's rows], a chunk's rows staged once per CTA."""
    r = target.rules["q4_mma"]
    rb, ks, stages = _grouped_split(r.grouped_rows, n, k, group, target, gate_up)
    c = launch(r.grouped_rows, n, k, group, rb, ks, 1, r.grouped_depth, gate_up, stages)
    c["grid"][1] = chunks
    c["constexprs"] |= {"GROUPED": 1 if gate_up else 2, "E": e, "P": pairs}
    return c


def fits(m: int, n: int, k: int, group: int, rb: int, ks: int, cs: int, target, pair: bool = False,
         stages: int = 0, norm: bool = False, persist: bool = False, bf16: bool = False) -> str | None:
    """None when the configuration can run on ``target``, else why not."""
    if not 1 <= m <= MAX_ROWS:
        return f"{m} rows (1..{MAX_ROWS})"
    if group not in ((32,) if bf16 else (32, 64, 128)):
        return f"group {group}"
    if bf16 and target.cc < 80:
        return "bf16 MMAs need sm_80"
    if n % 16 or k % (group * cs):
        return f"N {n} not a multiple of 16, or K {k} not of {group} x {cs} CTAs"
    if cs > 1 and target.cc < 90:
        return "clusters need sm_90"
    if not 1 <= rb * ks <= 32:
        return f"{rb * ks} warps"
    if stages and (stages < 2 or target.cc < 80):
        return f"{stages} cp.async stages (2 or more, sm_80 and later)"
    if norm and k % NORM_PARTIAL_ROWS:
        return f"K {k} not a multiple of {NORM_PARTIAL_ROWS} (the producer's partials)"
    consts = {"M": m, "K": k, "CS": cs, "RB": rb, "KS": ks, "SWIGLU": int(pair), "GROUP": group, "STAGES": stages,
              "NORM": int(norm), "PERSIST": int(persist), "WBF16": int(bf16)}
    if (s := shared_bytes(consts)) > target.smem_optin:
        return f"{s} bytes of shared memory"
    return None


def _codes(w, rows: int, k: int, group: int):
    return q4_codes(w[:rows * k // 2 + rows * (k // group) * 2], rows, k, group)


def _emulate(swiglu: bool):
    def run(grid, x, *rest, M, N, K, GROUP, RB, KS, CS, DEPTH, SWIGLU, STAGES=0, PERSIST=0, PDL=False):
        _check_grid(grid, N, RB, CS, PERSIST)
        ws, y = rest[:-1], rest[-1]
        codes = [_codes(w, N, K, GROUP) for w in ws]
        xm = x[:M * K].reshape(M, K)
        out = (q4_mma_swiglu_ref(xm, *codes[0], *codes[1], GROUP) if swiglu
               else q4_mma_ref(xm, *codes[0], GROUP))
        y[:M * N] = out.reshape(-1)
    return run


def _check_grid(grid, n: int, rb: int, cs: int, persist: int) -> None:
    """The grid a launch must have: a cluster per row-block group, or (PERSIST) at most that many."""
    groups = -(-n // (16 * rb))
    ok = grid[0] % cs == 0 and (1 <= grid[0] // cs <= groups if persist else grid[0] == cs * groups)
    assert ok and list(grid[1:]) == [1, 1], f"grid {grid}"


def _emulate_add(grid, x, w, r, s, ss, partial_rows, *, M, N, K, GROUP, RB, KS, CS, DEPTH, SWIGLU, ADD, BLOCK_N,
                 STAGES=0, PERSIST=0, PDL=False):
    """matmul_add at M rows: s = r + the product, ss [M, N / 16] each row block's sum of s^2."""
    _check_grid(grid, N, RB, CS, PERSIST)
    assert ADD == 1 and partial_rows == BLOCK_N
    out = r[:M * N].reshape(M, N) + q4_mma_ref(x[:M * K].reshape(M, K), *_codes(w, N, K, GROUP), GROUP)
    s[:M * N] = out.reshape(-1)
    ss[:M * (N // BLOCK_N)] = (out.double() ** 2).reshape(M, N // BLOCK_N, BLOCK_N).sum(-1).float().reshape(-1)


def _emulate_norm(swiglu: bool):
    """rmsnorm_matmul(_swiglu) at M rows: the product of x * rstd * (1 + nw), rstd from the NP partials."""
    def run(grid, x, ss, nw, *rest, M, N, K, GROUP, RB, KS, CS, DEPTH, SWIGLU, NORM, NP, STAGES=0, PERSIST=0,
            PDL=False):
        _check_grid(grid, N, RB, CS, PERSIST)
        assert NORM == 1
        *ws, y, eps = rest
        rstd = torch.rsqrt(ss[:M * NP].reshape(M, NP).double().sum(-1, keepdim=True) / K + eps).float()
        xm = x[:M * K].reshape(M, K) * rstd * (1.0 + nw[:K].float())
        codes = [_codes(w, N, K, GROUP) for w in ws]
        out = (q4_mma_swiglu_ref(xm, *codes[0], *codes[1], GROUP) if swiglu
               else q4_mma_ref(xm, *codes[0], GROUP))
        y[:M * N] = out.reshape(-1)
    return run


def _emulate_grouped(gate_up: bool):
    """moe_gate_up_grouped (x, src, chunks, wg, wu -> act) or moe_down_grouped (act, chunks, wd -> y):
    each used chunk's rows through ``q4_mma_ref`` with its expert's rows of the stacked weights."""
    def run(grid, x, *rest, M, N, K, GROUP, RB, KS, CS, DEPTH, SWIGLU, GROUPED, E, P, STAGES=0, PERSIST=0, PDL=False):
        if gate_up:
            src, chunks, wg, wu, y, _experts, _chunk = rest
            ws = [wg, wu]
        else:
            chunks, wd, y, _experts, _chunk = rest
            src, ws = None, [wd]
        c = grid[1]
        assert list(grid) == [CS * -(-N // (16 * RB)), c, 1], f"grid {grid}"
        codes = [_codes(w, E * N, K, GROUP) for w in ws]
        xm = x[:x.numel() // K * K].reshape(-1, K)
        for e, first, n, _ in chunks[:4 * c].reshape(c, 4).tolist():
            n = min(n, M)
            if n <= 0:
                continue
            e, first = min(max(e, 0), E - 1), min(max(first, 0), P - 1)
            rows = src[first:first + n].long() if gate_up else torch.arange(first, first + n)
            part = [(q[e * N:(e + 1) * N], sc[e * N:(e + 1) * N]) for q, sc in codes]
            xs = xm[rows]
            out = (q4_mma_swiglu_ref(xs, *part[0], *part[1], GROUP) if gate_up
                   else q4_mma_ref(xs, *part[0], GROUP))
            y[first * N:(first + n) * N] = out.reshape(-1)
    return run


SOURCE = r"""
#ifndef GROUPED
#define GROUPED 0           /* 1: MoE gate / up over a chunk of sorted pairs (x rows through src); 2: MoE down */
#define E 1                 /* experts stacked in each weight */
#define P 1                 /* sorted pairs (rows of y) */
#endif
#ifndef ADD
#define ADD 0               /* matmul_add: y = r + W x, and ss: the sum of y^2 per row and 16 outputs */
#endif
#ifndef NORM
#define NORM 0              /* rmsnorm_matmul: x <- x * rstd * (1 + nw), rstd from the producer's NP partials */
#define NP 1
#endif
#ifndef WBF16
#define WBF16 0             /* 1: bf16 weights (kernels/bf16_mma.py): a lane's word is 16 bytes (8 inputs), no scales;
                               x staged as two bf16 rows, hi = bf16(x) and lo = bf16(x - hi) */
#endif
#if WBF16
#if GROUP != 32 || GROUPED
#error "bf16 weights: GROUP 32 (one 16-byte word per lane and row), not grouped"
#endif
#define XV 2                /* staged x rows per row of x: hi, lo (MMA columns 2t, 2t + 1: the lane sums them) */
#define WORD_BYTES 16
#define ROW_BYTES ((size_t)K * 2)
#define SCALE_WORDS 0
#else
#define XV 1
#define WORD_BYTES 4
#define ROW_BYTES ((size_t)K / 2)
#define SCALE_WORDS (2 * 32) /* the ring's 32-bit words holding a stage's scales (rows g and g + 8) */
#endif
#define V (GROUP / 32)
#define NG (K / GROUP)
#define NGC (NG / CS)
#define KC (K / CS)
#define NT ((XV * M + 7) / 8)
#define WARPS (RB * KS)
#define NW (SWIGLU ? 2 : 1)
#define XROW (KC / 8 + 4)   /* uint4 slots per staged x row: KC / 8 words' pairs, 64 bytes of padding */
#define STAGED_BYTES (XV * M * (2 * KC + 64))   /* the staged x: XV M rows of XROW uint4 */
#define LANE_BYTES (V * WORD_BYTES)              /* a lane's bytes of one row and group */
#define RING_WORDS (2 * 32 * LANE_BYTES / 4 + SCALE_WORDS)   /* 32-bit words per ring stage and weight */
#define NORM_AT (STAGED_BYTES + WARPS * STAGES * NW * 4 * RING_WORDS)  /* NORM: rstd [M], after the ring */
#ifndef PERSIST
#define PERSIST 0           /* 1: the grid's CTAs loop over the row-block groups, x staged once per CTA */
#endif
/* the warps' sums and the CTA's (reduction): over the staged x, or (PERSIST: x stays) after the rstd */
#define RED_AT (PERSIST ? ((NORM_AT + (NORM ? 4 * M : 0) + 15) / 16 * 16) : 0)

#if WBF16 || V == 4
typedef uint4 wvec;
#elif V == 2
typedef uint2 wvec;
#else
typedef unsigned wvec;
#endif

__device__ __forceinline__ unsigned word_of(const wvec& w, int v) {
#if V == 4
  return v == 0 ? w.x : v == 1 ? w.y : v == 2 ? w.z : w.w;
#elif V == 2
  return v == 0 ? w.x : w.y;
#elif WBF16
  return w.x;  /* (not used: bf16 words are their own fragments) */
#else
  return w;
#endif
}

__device__ __forceinline__ wvec ldg_stream(const wvec* p) {
  wvec r;
#if WBF16 || V == 4
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
#elif V == 2
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
#else
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
#endif
  return r;
}

__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
  return r;
}

/* the four f16x2 (q - 8) pairs of a word: inputs (0, 1), (2, 3), (4, 5), (6, 7) */
__device__ __forceinline__ void dequant(unsigned q, unsigned* p) {
  const unsigned t = q >> 8;
  asm("lop3.b32 %0, %1, 0x000f000f, 0x64006400, 0xea;" : "=r"(p[0]) : "r"(q));
  asm("lop3.b32 %0, %1, 0x00f000f0, 0x64006400, 0xea;" : "=r"(p[1]) : "r"(q));
  asm("lop3.b32 %0, %1, 0x000f000f, 0x64006400, 0xea;" : "=r"(p[2]) : "r"(t));
  asm("lop3.b32 %0, %1, 0x00f000f0, 0x64006400, 0xea;" : "=r"(p[3]) : "r"(t));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(p[0]) : "r"(0x64086408u));
  asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(p[1]) : "r"(0x2c002c00u), "r"(0xd480d480u));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(p[2]) : "r"(0x64086408u));
  asm("fma.rn.f16x2 %0, %0, %1, %2;" : "+r"(p[3]) : "r"(0x2c002c00u), "r"(0xd480d480u));
}

/* bf16 x pairs (a, b) split into hi = bf16(x) and lo = bf16(x - hi): x = hi + lo within 2^-16 |x| */
__device__ __forceinline__ unsigned pack_bf162(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(r) : "f"(lo), "f"(hi));
  return r;
}

__device__ __forceinline__ void split_bf16(float a, float b, unsigned& hi, unsigned& lo) {
  hi = pack_bf162(a, b);
  lo = pack_bf162(a - __uint_as_float(hi << 16), b - __uint_as_float(hi & 0xffff0000u));
}

#if WBF16
#define MMA_AB "bf16"
#else
#define MMA_AB "f16"
#endif

__device__ __forceinline__ void mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                    unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." MMA_AB "." MMA_AB ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float half_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

/* one group (CTA-local gl) of one weight: rows g and g + 8's words qa, qb with their scales sa, sb, times the
   staged x's B fragments; the group's MMA sums scaled into tot */
__device__ __forceinline__ void group_mma(const wvec& qa, const wvec& qb, float sa, float sb, const uint4* xs, int gl,
                                          int t, const int* xrow, float (*tot)[4]) {
#if WBF16
  /* bf16: the 16-byte words are the f16x2-style pairs (0, 1) .. (6, 7) themselves; no scale, the MMAs
     accumulate in the totals */
  const int slot = gl * 4 + t;
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    const uint4 b = xs[xrow[nt] * XROW + slot];
    mma(tot[nt], qa.x, qb.x, qa.y, qb.y, b.x, b.y);
    mma(tot[nt], qa.z, qb.z, qa.w, qb.w, b.z, b.w);
  }
#else
  float c[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; nt++) c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.f;
#pragma unroll
  for (int v = 0; v < V; v++) {
    unsigned pa[4], pb[4];
    dequant(word_of(qa, v), pa);
    dequant(word_of(qb, v), pb);
    const int slot = gl * 4 * V + v * 4 + t;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const uint4 b = xs[xrow[nt] * XROW + slot];
      mma(c[nt], pa[0], pb[0], pa[1], pb[1], b.x, b.y);
      mma(c[nt], pa[2], pb[2], pa[3], pb[3], b.z, b.w);
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; nt++) {
    tot[nt][0] += c[nt][0] * sa; tot[nt][1] += c[nt][1] * sa;
    tot[nt][2] += c[nt][2] * sb; tot[nt][3] += c[nt][3] * sb;
  }
#endif
}

/* D groups (CTA-local gl0 ..) of the NW weights: every word in flight first, then the MMAs */
template <int D>
__device__ __forceinline__ void groups(const unsigned char* const* w, const unsigned short* const* scales,
                                       const uint4* xs, int row0, int gl0, int cta_g0, int g, int t, const int* xrow,
                                       float (*tot)[NT][4]) {
  const size_t rowbytes = ROW_BYTES;
  wvec qa[NW][D], qb[NW][D];
#pragma unroll
  for (int i = 0; i < NW; i++) {
    const wvec* wa = reinterpret_cast<const wvec*>(w[i] + (size_t)(row0 + g) * rowbytes) + t;
    const wvec* wb = reinterpret_cast<const wvec*>(w[i] + (size_t)(row0 + g + 8) * rowbytes) + t;
#pragma unroll
    for (int d = 0; d < D; d++) {
      qa[i][d] = ldg_stream(wa + (size_t)(cta_g0 + gl0 + d) * 4);
      qb[i][d] = ldg_stream(wb + (size_t)(cta_g0 + gl0 + d) * 4);
    }
  }
#pragma unroll
  for (int i = 0; i < NW; i++) {
#if WBF16
#pragma unroll
    for (int d = 0; d < D; d++) group_mma(qa[i][d], qb[i][d], 1.f, 1.f, xs, gl0 + d, t, xrow, tot[i]);
#else
    const unsigned short* sc = scales[i];
#pragma unroll
    for (int d = 0; d < D; d++) {
      const int gi = cta_g0 + gl0 + d;
      const float sa = half_to_float(__ldg(sc + (size_t)(row0 + g) * NG + gi));
      const float sb = half_to_float(__ldg(sc + (size_t)(row0 + g + 8) * NG + gi));
      group_mma(qa[i][d], qb[i][d], sa, sb, xs, gl0 + d, t, xrow, tot[i]);
    }
#endif
  }
}

#if STAGES
/* The cp.async ring (STAGES > 0): each lane copies its own words of rows g and g + 8 and the 32-bit words
   holding their scales into its warp's ring, STAGES - 1 groups ahead of the group it multiplies, so the weight
   bytes in flight do not depend on registers. A lane reads back only what it copied: no barrier is needed. */
__device__ __forceinline__ void cp_async(unsigned dst, const void* src, int bytes) {
  if (bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  else if (bytes == 8)
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(src) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

__device__ __forceinline__ void issue(const unsigned char* const* w, const unsigned short* const* scales,
                                      unsigned ring, int stage, int row0, int gi, int g, int lane) {
  const size_t rowbytes = ROW_BYTES;
#pragma unroll
  for (int i = 0; i < NW; i++) {
    const unsigned base = ring + 4u * (unsigned)((stage * NW + i) * RING_WORDS);
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int row = row0 + g + 8 * h;
      const unsigned char* src = w[i] + (size_t)row * rowbytes + ((size_t)gi * 4 + (lane & 3)) * LANE_BYTES;
      cp_async(base + (unsigned)((h * 32 + lane) * LANE_BYTES), src, LANE_BYTES);
#if !WBF16
      const size_t si = (size_t)row * NG + gi;   /* the scale's 32-bit word: (si & ~1), half si & 1 */
      cp_async(base + 4u * (unsigned)(2 * 32 * V + h * 32 + lane), scales[i] + (si & ~(size_t)1), 4);
#endif
    }
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

/* the ring's first STAGES - 1 groups of gl0 .. gl1 - 1 (CTA-local): weights only, so the non-grouped kernel
   issues them before its PDL wait, while the previous kernel of the step finishes */
__device__ __forceinline__ void prologue(const unsigned char* const* w, const unsigned short* const* scales,
                                         unsigned ring, int row0, int gl0, int gl1, int cta_g0, int g, int lane) {
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < gl1 - gl0) issue(w, scales, ring, s, row0, cta_g0 + gl0 + s, g, lane);
    else asm volatile("cp.async.commit_group;" ::: "memory");
  }
}

/* groups gl0 .. gl1 - 1 through the ring, after the prologue */
__device__ __forceinline__ void pipelined(const unsigned char* const* w, const unsigned short* const* scales,
                                          const uint4* xs, unsigned ring, const unsigned* ringp, int row0,
                                          int gl0, int gl1, int cta_g0, int g, int t, int lane, const int* xrow,
                                          float (*tot)[NT][4]) {
  const int n = gl1 - gl0;
  for (int j = 0; j < n; j++) {
    const int ahead = j + STAGES - 1;
    if (ahead < n) issue(w, scales, ring, ahead % STAGES, row0, cta_g0 + gl0 + ahead, g, lane);
    else asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory");
    const int stage = j % STAGES, gi = cta_g0 + gl0 + j;
#pragma unroll
    for (int i = 0; i < NW; i++) {
      const unsigned* st = ringp + (stage * NW + i) * RING_WORDS;
      const wvec qa = reinterpret_cast<const wvec*>(st)[lane], qb = reinterpret_cast<const wvec*>(st)[32 + lane];
#if WBF16
      group_mma(qa, qb, 1.f, 1.f, xs, gl0 + j, t, xrow, tot[i]);
#else
      const size_t sia = (size_t)(row0 + g) * NG + gi, sib = (size_t)(row0 + g + 8) * NG + gi;
      const unsigned swa = st[2 * 32 * V + lane], swb = st[2 * 32 * V + 32 + lane];
      const float sa = half_to_float((unsigned short)((sia & 1) ? swa >> 16 : swa & 0xffff));
      const float sb = half_to_float((unsigned short)((sib & 1) ? swb >> 16 : swb & 0xffff));
      group_mma(qa, qb, sa, sb, xs, gl0 + j, t, xrow, tot[i]);
#endif
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
}
#endif

__device__ __forceinline__ void cluster_sync() {
#if CS > 1
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

#if CS > 1
#define CLUSTER_DIMS __cluster_dims__(CS, 1, 1)
#else
#define CLUSTER_DIMS
#endif

/* expert e's rows (stacked weights: E N rows of nibbles, then E N rows of scales): ws, ss */
#define SCALES_OF(w, e_) (reinterpret_cast<const unsigned short*>((w) + (size_t)E * N * (K / 2)) + (size_t)(e_) * N * NG)
#if SWIGLU
#define WEIGHTS(e_) \
  const unsigned char* const ws[2] = {w0 + (size_t)(e_) * N * (K / 2), w1 + (size_t)(e_) * N * (K / 2)}; \
  const unsigned short* const ss[2] = {SCALES_OF(w0, e_), SCALES_OF(w1, e_)};
#else
#define WEIGHTS(e_) \
  const unsigned char* const ws[1] = {w0 + (size_t)(e_) * N * (K / 2)}; \
  const unsigned short* const ss[1] = {SCALES_OF(w0, e_)};
#endif

extern "C" __global__ void __launch_bounds__(32 * WARPS) CLUSTER_DIMS
ENTRY(const float* __restrict__ x,
#if GROUPED == 1
      const int* __restrict__ src, const int* __restrict__ chunks,
#elif GROUPED == 2
      const int* __restrict__ chunks,
#endif
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
#if GROUPED
      int experts, int chunk,
#endif
      void* scratch0, void* scratch1) {
  extern __shared__ uint4 smem[];
  uint4* xs = smem;                                          /* [M][XROW] staged x */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int rank = blockIdx.x % CS;
  const int cta_g0 = rank * NGC;                             /* this CTA's first group */
  const int rb = warp / KS, ks = warp - rb * KS;
  const int gl0 = ks * NGC / KS, gl1 = (ks + 1) * NGC / KS;  /* this warp's groups (CTA-local) */
  /* PERSIST: the grid's clusters loop over the row-block groups (x staged once per CTA, not once per group) */
  int block_group = blockIdx.x / CS;
  int row0 = (block_group * RB + rb) * 16;
  bool live = row0 < N;
#if STAGES
  /* this warp's ring, after the staged x (STAGED_BYTES, 16-byte aligned) */
  const unsigned* ringp = reinterpret_cast<const unsigned*>(reinterpret_cast<const unsigned char*>(smem) + STAGED_BYTES)
                          + warp * STAGES * NW * RING_WORDS;
  const unsigned ring = (unsigned)__cvta_generic_to_shared(ringp);
#endif
#if !GROUPED
  const int first = 0, rows = M;
  WEIGHTS(0)
#if STAGES
  if (live) prologue(ws, ss, ring, row0, gl0, gl1, cta_g0, g, lane);
#endif
#endif
#if PDL
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;");
#endif
#if GROUPED
  /* chunk blockIdx.y: (expert, first sorted pair, pairs); its x rows are x[src[first + i]] (1) or
     x[first + i] (2), its results rows first + i of y. A cluster shares its chunk: all its CTAs leave. */
  const int e = min(max(chunks[4 * blockIdx.y], 0), E - 1);
  const int first = min(max(chunks[4 * blockIdx.y + 1], 0), P - 1);
  const int rows = min(chunks[4 * blockIdx.y + 2], M);
  if (rows <= 0) return;
  WEIGHTS(e)
#if STAGES
  if (live) prologue(ws, ss, ring, row0, gl0, gl1, cta_g0, g, lane);
#endif
#endif
#if NORM
  /* each row's rstd from the producer's partial sums of squares (NP a row), summed in a fixed order */
  float* rstd = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(smem) + NORM_AT);
  for (int n = warp; n < rows; n += WARPS) {
    float q = 0.f;
    for (int i = lane; i < NP; i += 32) q += ss_in[(size_t)(first + n) * NP + i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) q += __shfl_xor_sync(0xffffffffu, q, o);
    if (lane == 0) rstd[n] = rsqrtf(q / (float)K + eps);
  }
  __syncthreads();
#endif
  /* stage x [rows][KC] (this CTA's K range) as f16x2 of x / 64: slot of word j of group gl, lane t, v */
  for (int i = threadIdx.x; i < rows * (KC / 8); i += 32 * WARPS) {
    const int n = i / (KC / 8), j = i - n * (KC / 8);
#if GROUPED == 1
    const size_t xr = (size_t)src[first + n];
#else
    const size_t xr = (size_t)(first + n);
#endif
    const float4* xp = reinterpret_cast<const float4*>(x + xr * K + (size_t)rank * KC + 8 * j);
#if NORM
    float4 f0 = xp[0], f1 = xp[1];
    {
      const float4* wp = reinterpret_cast<const float4*>(nw + (size_t)rank * KC + 8 * j);
      const float4 a = wp[0], b = wp[1];
      const float q = rstd[n];
      f0 = make_float4(f0.x * q * (1.f + a.x), f0.y * q * (1.f + a.y), f0.z * q * (1.f + a.z), f0.w * q * (1.f + a.w));
      f1 = make_float4(f1.x * q * (1.f + b.x), f1.y * q * (1.f + b.y), f1.z * q * (1.f + b.z), f1.w * q * (1.f + b.w));
    }
#else
    const float4 f0 = xp[0], f1 = xp[1];
#endif
    const int gl = j / (4 * V), r = j - gl * 4 * V, tt = r / V, v = r - tt * V;
#if WBF16
    uint4 hi, lo;  /* staged rows 2 n (hi) and 2 n + 1 (lo) */
    split_bf16(f0.x, f0.y, hi.x, lo.x); split_bf16(f0.z, f0.w, hi.y, lo.y);
    split_bf16(f1.x, f1.y, hi.z, lo.z); split_bf16(f1.z, f1.w, hi.w, lo.w);
    xs[2 * n * XROW + gl * 4 + tt] = hi;
    xs[(2 * n + 1) * XROW + gl * 4 + tt] = lo;
#else
    xs[n * XROW + gl * 4 * V + v * 4 + tt] =
        make_uint4(pack_half2(f0.x * 0.015625f, f0.y * 0.015625f), pack_half2(f0.z * 0.015625f, f0.w * 0.015625f),
                   pack_half2(f1.x * 0.015625f, f1.y * 0.015625f), pack_half2(f1.z * 0.015625f, f1.w * 0.015625f));
#endif
  }
  __syncthreads();
  int xrow[NT];  /* the staged row of B column g in tile nt (past the last: the last row, its column not stored) */
#pragma unroll
  for (int nt = 0; nt < NT; nt++) xrow[nt] = min(nt * 8 + g, XV * rows - 1);
#if PERSIST
  for (;;) {
#endif
  float tot[NW][NT][4];
#pragma unroll
  for (int i = 0; i < NW; i++)
#pragma unroll
    for (int nt = 0; nt < NT; nt++) tot[i][nt][0] = tot[i][nt][1] = tot[i][nt][2] = tot[i][nt][3] = 0.f;
  if (live) {
#if STAGES
    if (block_group >= (int)(gridDim.x / CS)) prologue(ws, ss, ring, row0, gl0, gl1, cta_g0, g, lane);
    pipelined(ws, ss, xs, ring, ringp, row0, gl0, gl1, cta_g0, g, t, lane, xrow, tot);
#else
    int gl = gl0;
    for (; gl + DEPTH <= gl1; gl += DEPTH) groups<DEPTH>(ws, ss, xs, row0, gl, cta_g0, g, t, xrow, tot);
    for (; gl < gl1; gl++) groups<1>(ws, ss, xs, row0, gl, cta_g0, g, t, xrow, tot);
#endif
  }
  /* the warps' totals, in ks order, per row block; then the cluster's CTAs' in rank order */
  __syncthreads();
  float* red = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(smem) + RED_AT);
  const int per = NW * NT * 4;
#pragma unroll
  for (int i = 0; i < NW; i++)
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
      for (int e = 0; e < 4; e++) red[(warp * 32 + lane) * per + (i * NT + nt) * 4 + e] = tot[i][nt][e];
  __syncthreads();
  float* part = red + WARPS * 32 * per;                      /* [RB][32][per]: this CTA's sums */
  if (ks == 0) {
    for (int j = 0; j < per; j++) {
      float s = 0.f;
      for (int k2 = 0; k2 < KS; k2++) s += red[((rb * KS + k2) * 32 + lane) * per + j];
      part[(rb * 32 + lane) * per + j] = s;
    }
  }
  cluster_sync();
  if (rank == 0 && ks == 0 && live) {
    float s[NW * NT * 4];
#pragma unroll
    for (int j = 0; j < per; j++) s[j] = part[(rb * 32 + lane) * per + j];
#if CS > 1
    for (int r = 1; r < CS; r++) {
      const unsigned local = (unsigned)__cvta_generic_to_shared(part + (rb * 32 + lane) * per);
      unsigned remote;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(r));
#pragma unroll
      for (int j = 0; j < per; j++) {
        float v;
        asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote + 4 * j));
        s[j] += v;
      }
    }
#endif
#if WBF16
    /* columns 2t (hi) and 2t + 1 (lo) of tile nt are x row nt * 4 + t: their sum is the product */
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const int n = nt * 4 + t;
      const int ra = row0 + g, rbw = row0 + g + 8;
      float va = s[nt * 4] + s[nt * 4 + 1], vb = s[nt * 4 + 2] + s[nt * 4 + 3];
#if SWIGLU
      const float ua = s[(NT + nt) * 4] + s[(NT + nt) * 4 + 1], ub = s[(NT + nt) * 4 + 2] + s[(NT + nt) * 4 + 3];
      va = va / (1.f + expf(-va)) * ua;
      vb = vb / (1.f + expf(-vb)) * ub;
#endif
#if ADD
      const size_t rr = (size_t)(first + min(n, rows - 1)) * N;
      va = r_in[rr + ra] + va;
      vb = r_in[rr + rbw] + vb;
      float sq = va * va + vb * vb;  /* the 16 rows' sum for x row n: over g (lanes 4 apart), in a fixed order */
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) sq += __shfl_xor_sync(0xffffffffu, sq, o);
      if (g == 0 && n < rows) ss_out[(size_t)(first + n) * (N / 16) + row0 / 16] = sq;
#endif
      if (n < rows) {
        y[(size_t)(first + n) * N + ra] = va;
        y[(size_t)(first + n) * N + rbw] = vb;
      }
    }
#else
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
      const int n0 = nt * 8 + 2 * t;
      const int ra = row0 + g, rbw = row0 + g + 8;
      float sq[2] = {0.f, 0.f};  /* ADD: y^2 of this lane's two rows, per x row n0, n0 + 1 */
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int n = n0 + (e & 1), r = e < 2 ? ra : rbw;
        float v = 64.f * s[nt * 4 + e];
#if SWIGLU
        const float u = 64.f * s[(NT + nt) * 4 + e];
        v = v / (1.f + expf(-v)) * u;
#endif
#if ADD
        v = r_in[(size_t)(first + min(n, rows - 1)) * N + r] + v;
        sq[e & 1] += v * v;
#endif
        if (n < rows) y[(size_t)(first + n) * N + r] = v;
      }
#if ADD
      /* the 16 rows' sum for each x row: over g (lanes 4 apart), in a fixed order */
#pragma unroll
      for (int h = 0; h < 2; h++) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) sq[h] += __shfl_xor_sync(0xffffffffu, sq[h], o);
        if (g == 0 && n0 + h < rows) ss_out[(size_t)(first + n0 + h) * (N / 16) + row0 / 16] = sq[h];
      }
#endif
    }
#endif
  }
  cluster_sync();  /* rank 0 has read every CTA's sums: they may leave (or, PERSIST, overwrite them) */
#if PERSIST
  block_group += gridDim.x / CS;
  row0 = (block_group * RB + rb) * 16;
  live = row0 < N;
  if (block_group * RB * 16 >= N) break;
  __syncthreads();
  }
#endif
}
"""

Q4MMA_ROWS = CudaKernel("q4mma_rows", __name__, SOURCE, ("x_ptr", "w_ptr", "y_ptr"),
                        ("M", "N", "K", "GROUP", "RB", "KS", "CS", "DEPTH", "SWIGLU", "STAGES", "PERSIST", "PDL"),
                        shared_bytes, _emulate(False))
Q4MMA_ROWS_SWIGLU = CudaKernel("q4mma_rows_swiglu", __name__, SOURCE, ("x_ptr", "wg_ptr", "wu_ptr", "y_ptr"),
                               Q4MMA_ROWS.constexprs, shared_bytes, _emulate(True))
# the residual add and the next norm folded in at M rows (passes/fold_row_norms.py; ops matmul_add,
# rmsnorm_matmul, rmsnorm_matmul_swiglu): the operands and results in the op's order, then its attribute
Q4MMA_ADD = CudaKernel("q4mma_add", __name__, SOURCE, ("x_ptr", "w_ptr", "r_ptr", "s_ptr", "ss_ptr", "partial_rows"),
                       Q4MMA_ROWS.constexprs + ("ADD", "BLOCK_N"), shared_bytes, _emulate_add)
Q4MMA_NORM = CudaKernel("q4mma_norm", __name__, SOURCE, ("x_ptr", "ss_ptr", "nw_ptr", "w_ptr", "y_ptr", "eps"),
                        Q4MMA_ROWS.constexprs + ("NORM", "NP"), shared_bytes, _emulate_norm(False))
Q4MMA_NORM_SWIGLU = CudaKernel("q4mma_norm_swiglu", __name__, SOURCE,
                               ("x_ptr", "ss_ptr", "nw_ptr", "wg_ptr", "wu_ptr", "y_ptr", "eps"),
                               Q4MMA_NORM.constexprs, shared_bytes, _emulate_norm(True))
_GROUPED_CONSTS = Q4MMA_ROWS.constexprs + ("GROUPED", "E", "P")
Q4MMA_GATE_UP_GROUPED = CudaKernel("q4mma_gate_up_grouped", __name__, SOURCE,
                                   ("x_ptr", "src_ptr", "chunks_ptr", "wg_ptr", "wu_ptr", "act_ptr", "experts", "chunk"),
                                   _GROUPED_CONSTS, shared_bytes, _emulate_grouped(True))
Q4MMA_DOWN_GROUPED = CudaKernel("q4mma_down_grouped", __name__, SOURCE,
                                ("act_ptr", "chunks_ptr", "wd_ptr", "y_ptr", "experts", "chunk"),
                                _GROUPED_CONSTS, shared_bytes, _emulate_grouped(False))
# the kernel table names these through jit_name ("kestrel.kernels.q4_mma:q4mma_rows")
q4mma_rows = Q4MMA_ROWS
q4mma_rows_swiglu = Q4MMA_ROWS_SWIGLU
q4mma_add = Q4MMA_ADD
q4mma_norm = Q4MMA_NORM
q4mma_norm_swiglu = Q4MMA_NORM_SWIGLU
q4mma_gate_up_grouped = Q4MMA_GATE_UP_GROUPED
q4mma_down_grouped = Q4MMA_DOWN_GROUPED
