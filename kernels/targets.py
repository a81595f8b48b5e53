"""GPU targets Kestrel compiles for, with the facts and launch-rule tables the launch rules read.

A target names an architecture, not a part: its facts (``sms``, ``smem_optin``) are those of the
flagship part of that architecture (``part``). ``rules`` maps each kernel family to a frozen row of
that family's tunable constants; the launch functions in kernels/<family>.py read them from there.
Each row carries its ``provenance``: the bench/results files its values were read from (sweeps) or
checked against (reports of the rule's pick), and ``RULE_OF_THUMB`` where a value was not swept.
The sm_90 rows were tuned on the H200; every other target reuses them with ``tuned=False``
(``untuned_note`` says so, for the compiler to log).
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

RULE_OF_THUMB = "rule of thumb"
UNTUNED = "untuned: sm_90 (H200) values"
TUNED_ON = "sm_90"


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One family's launch constants. provenance: paths under bench/results and/or RULE_OF_THUMB
    (tuned rows), or (UNTUNED,) on targets that borrow the sm_90 row."""
    provenance: tuple[str, ...]
    tuned: bool = True


@dataclass(frozen=True, kw_only=True)
class MatvecRule(Rule):
    ctas_per_sm: int            # BLOCK_N doubles while the grid keeps >= ctas_per_sm CTAs per SM ...
    max_block_n: int            # ... up to this many rows per CTA
    q4_wide_ctas_per_sm: int    # q4, many rows (N >= 16 * q4_wide_ctas_per_sm * SMs): 16-row CTAs, ...
    q4_wide_block_k: int        # ... BLOCK_K q4_wide_block_k, one warp (two for the swiglu pair); the normed
    l2_prefetch_bytes: int = 9 << 19  # q4 matrices of at most this many bytes (4.5 MiB: the 0.8B ones) prefetch
    #                                   their rows into the L2 before the PDL wait (matvec_launch's L2_PREFETCH;
    #                                   sm_90 and later; bench/results/stop36 calls 4-5)
    q4_wide_norm_block_n: int = 32  # product (rmsnorm_matvec) this many rows a CTA and ...
    q4_wide_norm_warps: int = 2     # ... warps (bench/norm_matvec_probe.py, stop 35 call 11: 32 x 2 7% faster than
    #                                 16 x 1 alone at the 27B shapes; 27B q4 step 5.092 against 5.159 ms/token, A B B A,
    #                                 bench/results/stop36 call 1)
    q4_norm_short_k: int = 0    # normed q4 products (rmsnorm_matvec, not the swiglu pair) with K at most this: ...
    q4_norm_short_wide: tuple = ()  # ... many rows: (BLOCK_N, warps) in place of q4_wide_norm_*; fewer rows: the
    #                                 whole of K in one tile (NORM_TILE). (bench/norm_matvec_probe.py NMP_MODEL=80b,
    #                                 bench/results/stop38 call 5: at hidden 2048 in_proj 7.18 -> 6.34 us at 16 x 2,
    #                                 attention's q|gate|k|v 7.55 -> 5.76 us in one 2048-input tile)
    q4_pair_norm: tuple = ()    # the normed q4 gate / up pair (rmsnorm_matvec_swiglu): rows (max K, BLOCK_N, BLOCK_K,
    #                             warps), the first whose max K is at least K, in place of the rule's split; past the
    #                             last, the rule's (bench/norm_matvec_probe.py NMP_MODEL=swiglu, stop 40 call 7, 202
    #                             splits chained: 2B 9.48 -> 6.61 us, 4B 15.90 -> 11.88, 9B 25.70 -> 17.99; 0.8B's
    #                             8 x 1024 x 4 the best already. Whole step, A B B A, calls 8-9: 2B q4 0.770 -> 0.744,
    #                             4B 1.526 -> 1.414 ms/token; 9B 1.880 -> 1.882 (32 x 1024 x 4), 1.90 (16 x 1024 x 2),
    #                             1.94 (8 x 4096 x 4): its K = 4096 keeps the rule's 16 x 512 x 2)
    q4_min_block_n: int         # q4, fewer rows: q4_min_block_n rows per CTA, doubled (to q4_max_block_n) ...
    q4_max_block_n: int
    q4_ctas_per_sm: int         # ... while the grid keeps this many CTAs per SM;
    q4_block_k: int             # BLOCK_K q4_block_k, or q4_long_block_k from K >= q4_long_k (a masked
    q4_long_k: int              # last tile allowed), q4_warps warps
    q4_long_block_k: int
    q4_warps: int
    small_matrix_bytes: int     # bf16 / f32 with N * K * 2 below this: latency-bound rule
    small_max_block_k: int
    small_tile_elems: int       # small: BLOCK_N <= small_tile_elems / BLOCK_K
    small_max_warps: int
    small_elems_per_warp: int   # small: one warp per this many tile elements
    block_k: int                # large bf16 / f32: BLOCK_K, halved while it does not divide K ...
    min_block_k: int            # ... down to this
    rows_per_warp: int          # large: one warp per this many rows
    max_warps: int
    pdl_late_bytes: int = 32 << 20  # PDL_LATE (the next kernel launches after the K loop, not at the start) from
    #                                 this many bytes; below it the step also carries late variants (compiler/codegen.py)
    pdl_early_before: tuple = ()  # ... except ones before a one-token step op of these kinds (few programs, each
    #                               waiting cheaply: attention, the Gated DeltaNet step, which loads its state before
    #                               its wait): the trigger at the start (compiler/codegen.py; the late form is then
    #                               that launch's late variant). 27B q4 5.078 -> 5.004 ms/token (stop 38 call 10)
    pdl_early_q4_only: bool = True  # ... q4 ones only: for bf16 too, A B B A (stop 39 calls 1, 5), 27B bf16 13.167 ->
    #                                 13.116, 9B 4.357 -> 4.315, 4B 2.761 -> 2.755 ms/token, but 2B 1.289 -> 1.320
    #                                 (the load-time trial then kept the all-late graph, slower over a request)
    preload_bytes: int = 32 << 20  # PRELOAD (the first weight tile loaded before the PDL wait): bf16 / f32 matrices
                                   # of fewer bytes than this (0: none); q4 ones not by size (stop 29 call 3) ...
    q4_preload_after: tuple = ()   # ... but in the one-token step right after an op of these kinds (few programs:
    #                                the SMs are free for the matvec's, compiler/codegen.py), from
    q4_preload_min_bytes: int = 0  # this many bytes of weight. Stop 42 calls 2-4, A B B A: 80B-A3B q4 1.760 -> 1.728
    #                                ms/token, 2B 0.748 -> 0.731, 4B 1.414 -> 1.402, 27B 4.997 -> 4.981; 0.8B's 1 MiB
    #                                output projections 0.471 -> 0.525, hence the floor (kernels/matvec.py)
    q4_one_tile_together: bool = False  # TOGETHER: a q4 matrix of one tile (K == BLOCK_K) has its words and scales (the
    #                                    swiglu kernels: of both matrices) loaded at once, right after the PDL wait
    #                                    (before it with PRELOAD), not the scales after the products, a matrix after
    #                                    the other. H200, A B C D D C B A (stop 45 call 4, stop 46 call 1): 0.8B q4
    #                                    0.4687 -> 0.4552 ms/token, 2B 0.7260 -> 0.6959, 80B-A3B even (1.7253 /
    #                                    1.7265 -> 1.7246 / 1.7270); 4B-27B have no one-tile q4 matrix


@dataclass(frozen=True, kw_only=True)
class MatvecRowsRule(Rule):
    """The matvec at a few rows (kernels/matvec.py, matvec_rows_launch): the one-row rule's split except
    where a few rows measured better with another."""
    q4_ctas_per_sm: int         # q4, fewer rows: BLOCK_N doubles while the grid keeps this many CTAs per SM
    q4_block_k: int             # ... BLOCK_K for every K
    q4_warps: int               # ... and warps; q4 swiglu pairs with many rows also get this many warps
    small_short_k: int          # small bf16 matrices: (BLOCK_N, BLOCK_K, warps) small_short up to this K,
    small_short: tuple[int, int, int]
    small_long: tuple[int, int, int]  # small_long past it
    one_row_split: bool = False  # the one-row kernel's split at every shape, q4 and small bf16 too (each row's
    #                              products then the one-token step's bit for bit; speculative plans:
    #                              exact_verify_rules)
    fold_one_row: bool = True   # fuse's norm folded into one-row products stays; False: unfolded where a
    #                             floating-point matrix or a MoE block is in the chain (passes/fold_row_norms.py),
    #                             as the few-rows matvec and the MoE kernels run a verify's rows
    fp_fusion: bool = True      # floating-point matvecs (one row and few rows alike) with products contracted
    #                             into adds (FMA); False: not, so the one-row kernel and the few-rows kernel sum
    #                             a chunk's products in one rounding order (with contraction the compiler picks
    #                             which product of a chunk stays unfused, and picked differently for the two at
    #                             Qwen3-Next's router, bench/results/stop36 call 2; the verify's few-rows bf16
    #                             products then ran 1.22x slower at 27B, stop 39 call 3)
    pair_fma: bool = False      # floating-point matvecs (one row and few rows alike) make each pair of products as
    #                             an explicit fma (kernels/matvec.py _fp_part): no product left for the compiler
    #                             to contract, so both sum a chunk alike with contraction on (speculative plans)


@dataclass(frozen=True, kw_only=True)
class AttentionRule(Rule):
    split_programs: int         # attn_splits: about this many programs (kv heads x splits) in all
    max_splits: int
    min_rows_per_split: int     # cache rows per split at max_seq, at least
    tile_bytes: int             # bytes of one K (or V) tile: BLOCK_S * BLOCK_D * cache element size ...
    min_block_s: int
    max_block_s: int            # ... BLOCK_S within these bounds
    mma_min_heads: int          # BLOCK_H (query heads a program takes, padded) at least this with tensor cores
    pipe_bytes_max: int         # PIPE_BYTES cap ...
    smem_reserve: int           # ... and the opt-in shared memory left for other scratch (besides the query parts)
    min_tiles_in_flight: int    # BLOCK_S halves (to min_block_s) until PIPE_BYTES holds this many K/V tile pairs
    split_tiles: int            # SPLIT_ROWS = split_tiles * BLOCK_S: cache rows per active split, at least
    num_warps: int              # bf16 caches (tensor-core dots)
    fma_num_warps: int          # fp32 caches (fp32 FMA dots)
    merge_splits: int = 32      # the combine sums this many splits' partials a head at a time (MERGE_CH) ...
    merge_stages: int = 2       # ... with this many chunks' loads in flight (MERGE_STAGES); with more splits than
    merge_small: int = 8        # merge_splits, at up to this many active splits this many at a time (MERGE_SMALL) ...
    merge_small_stages: int = 4  # ... with this many in flight (bench/attn_step_probe.py; stop 35)
    fp_fusion: bool = True      # attn_step and the verify's step-order rows kernel (attn_rows_step) alike: see
    #                             GdnDeltaRule.fp_fusion
    narrow_queries: bool = True  # BLOCK_Q: the group's queries normed and roped as REP rows (a power of two), then
    #                              repeated to the BLOCK_H rows of the mma tile (else all BLOCK_H rows computed)


@dataclass(frozen=True, kw_only=True)
class AttnRowsRule(Rule):
    """The M-row (prefill) attention kernels (kernels/attention.py, attn_rows_kv / attn_rows_q)."""
    max_block_r: int            # query tile rows (GQA group heads x chunk rows) per program, halved ...
    min_block_r: int            # ... down to this while the grid has fewer than programs_per_sm * sms programs
    programs_per_sm: int
    tile_elems: int             # BLOCK_N * BLOCK_D of a K / V tile ...
    min_block_n: int
    max_block_n: int            # ... BLOCK_N within these bounds
    acc_elems_per_warp: int     # num_warps: one warp per this many [BLOCK_R, BLOCK_D] accumulator elements ...
    min_warps: int
    max_warps: int              # ... within these bounds
    pipe_bytes_max: int         # PIPE_BYTES cap (K/V tiles in flight) ...
    smem_reserve: int           # ... leaving the query tile and this much of the opt-in shared memory
    kv_num_warps: int           # attn_rows_kv: one program per (row, kv head)
    split_programs: int         # attn_rows_q's sequence splits: about this many programs in all, ...
    max_splits: int             # ... at most this many splits (a power of two), ...
    split_tiles: int            # ... each at least this many BLOCK_N tiles of max_seq (and of the context)
    step_order_rows: int = 0    # attn_rows_q at up to this many rows: attn_rows_step_kernel, each row as attn_step
    #                             computes it, and attn_rows_kv with attn_step's warps (a speculative verify's rows the
    #                             one-token step's; 0: never; speculative plans: exact_verify_rules)


@dataclass(frozen=True, kw_only=True)
class GdnDeltaRule(Rule):
    min_block_v: int
    max_block_v: int
    block_v_div: int            # BLOCK_V = pow2(Dv) / block_v_div, within the bounds
    num_warps: int
    preload: bool = True        # PRELOAD: the state tile, conv state and weights loaded before the PDL wait
    fp_fusion: bool = True      # products contracted into adds (FMA) by the compiler, in gdn_delta and in the
    #                             speculative verify's rows kernel (gdn_rows_delta_snap) alike: False compiles both
    #                             without, so that a verified row is the one-token step's bit for bit (where ptxas
    #                             contracts depends on the code around a product: one pair differed; stop 34)
    commit_block: int = 2048    # gdn_commit (the speculative iteration's state advance): state elements a program,
    commit_warps: int = 4       # ... its warps, and the software-pipeline stages of its loop over the kept rows
    commit_stages: int = 0      #     (0: Triton's default; 8192 x 8 and 1 stage no faster, stop 39 call 6)


@dataclass(frozen=True, kw_only=True)
class GdnRowsRule(Rule):
    """The M-row (prefill) Gated DeltaNet kernels of kernels/gated_delta.py."""
    chunk: int                  # gdn_rows_delta: rows a step of the chunk-parallel form, 0: always row by row
    row_min_programs: int       # ... taken when the row-by-row grid has fewer programs than this (latency-bound)
    min_block_v: int            # row by row: BLOCK_V = pow2(Dv) / block_v_div, within the bounds
    max_block_v: int
    block_v_div: int
    num_warps: int
    chunk_block_v: int          # chunked: BLOCK_V (at least 16), and its warps
    chunk_num_warps: int
    norm_block_m: int           # gdn_rows_norm: rows per program (at most), and its warps
    norm_num_warps: int
    snap_norm_block_m: int = 16  # gdn_rows_norm_snap (a verify's K + 1 rows): rows per program (at most)


@dataclass(frozen=True, kw_only=True)
class WarpsRule(Rule):
    num_warps: int


@dataclass(frozen=True, kw_only=True)
class RmsnormRule(Rule):
    wide_n: int                 # rows of at least wide_n elements get wide_warps, others num_warps
    wide_warps: int
    num_warps: int


@dataclass(frozen=True, kw_only=True)
class BlockRule(Rule):
    block: int
    num_warps: int


@dataclass(frozen=True, kw_only=True)
class MoeRule(Rule):
    """kernels/moe.py: moe_topk (the router's softmax and top-k, one program per row, all E logits in
    registers; the logits themselves are a matvec) and the grouped expert matvecs (the matvec row's tiles)."""
    router_warps: int           # moe_topk (the router's softmax and top-k over E logits, one program a row)
    max_block_n: int            # rows per program of moe_down, at most this
    down_stages: int            # moe_down: 0 the routed experts unrolled, else a pipeline over their tiles this deep
    gate_up_block_n: int        # moe_gate_up: rows per program
    gate_up_max_k: int          # moe_gate_up: the whole input in one tile up to this many inputs
    gate_up_warps: int
    group_warps: int            # moe_group (one program per expert over all the M-row pairs)
    combine_block: int          # moe_combine: output columns per program
    grouped_gate_up: tuple      # moe_gate_up_grouped: (BLOCK_N, BLOCK_K, num_warps)
    grouped_down: tuple         # moe_down_grouped: (BLOCK_N, BLOCK_K, num_warps)
    down_gather: tuple = ()     # moe_down of q4 experts: (BLOCK_N, num_warps) of the gathered form (every routed
                                # expert's rows in one tile, STAGES -1), () for down_stages' forms
    topk_sort: bool = False     # moe_topk: the top-k by one bitonic top-k (SORT) rather than k serial max rounds
    down_early: bool = False    # moe_down's gathered form: the routing and the routed rows loaded before the PDL wait
    carveout: int = -1          # every kernel of a plan with routed experts prefers this shared-memory carveout (percent
    #                             of the SM's shared memory, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, set by
    #                             the runtime at load); -1: no preference (the driver's choice, kernel by kernel)


@dataclass(frozen=True, kw_only=True)
class SampleRule(Rule):
    """sample (kernels/sample.py): one program per ``tile`` logits, each keeping its top ``cand``."""
    tile: int                   # logits per program (a power of two): G = ceil(V / tile) programs
    cand: int                   # candidates per program for the truncated merge (a power of two, <= tile)
    num_warps: int
    max_block: int              # the exact full-vocabulary fallback's slice: pow2(V) within these bounds
    min_block: int


@dataclass(frozen=True)
class GemmRule(Rule):
    """The M-row GEMM (kernels/gemm.py): tiles for many rows (m >= many_rows) and for few, per weight
    dtype; the wide-N tiles where N >= wide_n; at m <= skinny_rows (a verify step's k + 1 rows) their
    own tiles."""
    many_rows: int
    wide_n: int
    bf16_many: tuple[int, int, int, int]  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps
    bf16_few: tuple[int, int, int, int]
    bf16_few_wide: tuple[int, int, int, int]
    q4_many: tuple[int, int, int, int]
    q4_few: tuple[int, int, int, int]
    q4_wide: tuple[int, int, int, int]
    skinny_rows: int = 16
    few_rows_matvec: int = 0    # at m <= this the matmuls run kernels/matvec.py's few-rows form, not a GEMM
    bf16_skinny: tuple[int, int, int, int] = (16, 64, 256, 2)
    q4_skinny: tuple[int, int, int, int] = (16, 64, 128, 8)
    bf16_skinny_swiglu: tuple[int, int, int, int] = (16, 128, 128, 2)  # gemm_swiglu: BLOCK_N as given
    q4_skinny_swiglu: tuple[int, int, int, int] = (16, 64, 128, 4)


@dataclass(frozen=True, kw_only=True)
class StreamRule(Rule):
    """The one-row q4 product fed by bulk copies (kernels/q4_stream.py): the q4 matmuls of one row whose form is
    switched on (``pair``: rmsnorm + the gate / up pair, rmsnorm_matmul_swiglu; ``add``: matmul_add; ``plain``:
    matmul; ``norm_plain``: rmsnorm_matmul), with N >= min_rows (a multiple of the block) and min_k <= K <= max_k
    (else the Triton matvec); ``wide``: matmul_add at max_k < K <= wide_max_k (the down projection), with the
    ``wide_*`` split. One CTA an SM: rb rows a block, a ring of ``stages`` blocks, nc consumer warps in row
    groups of ``ks`` warps that split K between them, one producer warp, registers capped for ``minb`` CTAs an SM
    (the pair: the ``pair_*`` fields)."""
    pair: bool
    add: bool
    plain: bool
    norm_plain: bool
    rb: int                     # the single products (plain, add, norm_plain)
    stages: int
    nc: int
    pair_rb: int                # the normed gate / up pair (rmsnorm_matmul_swiglu): two weights a slot
    pair_stages: int
    pair_nc: int
    min_rows: int
    min_k: int                  # K from min_k to max_k: the shapes it was measured at (the 27B's)
    max_k: int
    ks: int = 1                 # K slices a row group (1: a warp takes its rows over the whole K)
    minb: int = 1               # 2: the next launch's CTA fits beside this one (bench/q4stream_probe.py time-layer)
    pair_ks: int = 1
    pair_minb: int = 1
    wide: bool = False          # matmul_add at max_k < K <= wide_max_k, with this split:
    wide_max_k: int = 17408
    wide_rb: int = 8
    wide_stages: int = 2
    wide_nc: int = 17
    wide_ks: int = 17
    wide_minb: int = 1


@dataclass(frozen=True, kw_only=True)
class MmaRule(Rule):
    """The tensor-core product at a few rows (kernels/q4_mma.py; its bf16 form kernels/bf16_mma.py, family
    ``bf16_mma``, where the grouped fields are unused): matmuls of the family's weights at 2..max_rows rows
    run it (0: never). Its split: RB row blocks of 16 x KS warps per CTA, DEPTH groups in flight; clusters of the
    smallest CS in ``clusters`` that gives the grid ctas_per_sm CTAs per SM (the largest otherwise)."""
    max_rows: int
    rb: int
    ks: int
    depth: int
    clusters: tuple[int, ...]
    ctas_per_sm: float
    stages: int = 0             # the cp.async ring's stages (kernels/q4_mma.py STAGES; 0: DEPTH groups in registers)
    swiglu_rb: int = 0          # the gate / up pair's split (0: rb, ks, stages as above)
    swiglu_ks: int = 0
    swiglu_stages: int = 0
    swiglu_persist: int = 0     # the pair: this many CTAs per SM looping over the row blocks (PERSIST, registers),
                                # where that many fit an SM's shared memory (else the split above), ...
    swiglu_persist_rows: int = 4  # ... at up to this many rows (where it was measured)
    grouped_rows: int = 0       # Qwen3-Next's grouped experts (q4): chunks of this many sorted pairs (0: not used)
    grouped_rb: int = 2         # ... RB x KS warps, DEPTH groups in flight, no clusters
    grouped_ks: int = 2
    grouped_depth: int = 2
    fold_norms: bool = True     # passes/fold_row_norms.py folds the residual add and norm between its products
    grouped_swiglu_ks: int = 0      # gate / up grouped: KS (0: grouped_ks) and the cp.async ring's stages
    grouped_swiglu_stages: int = 0
    max_weight_bytes: int = 0   # matrices of more bytes than this (a pair: each weight) keep the Triton kernels (0: any)
    one_row_as: int = 0         # > 0 (q4): matmuls at ONE row run this kernel too, split as at this many rows
    #                             (M = 1), as a verify of that many rows runs them (speculative plans:
    #                             exact_verify_rules)


_TUNING = "bench/results/tuning/"
_RESULTS = "bench/results/"
_ATTN_REPORTS = tuple(f"bench/results/kernels/attn-qwen3.5-{m}-pos{p}-h200.json"
                      for m in ("0.8b", "27b") for p in (80, 1000, 4000))

# The sm_90 (H200) rows: every number the launch rules use.
SM90_RULES: Mapping[str, Rule] = MappingProxyType({
    "matvec": MatvecRule(
        ctas_per_sm=4, max_block_n=16,
        q4_wide_ctas_per_sm=5, q4_wide_block_k=512, q4_min_block_n=4, q4_max_block_n=8, q4_ctas_per_sm=3,
        q4_block_k=1024, q4_long_k=16384, q4_long_block_k=2048, q4_warps=4, q4_norm_short_k=2048,
        q4_norm_short_wide=(16, 2), q4_pair_norm=((1024, 8, 1024, 4), (2048, 8, 2048, 8), (3072, 16, 512, 2)),
        small_matrix_bytes=32 << 20, small_max_block_k=2048, small_tile_elems=4096, small_max_warps=4,
        small_elems_per_warp=256,
        block_k=512, min_block_k=128, rows_per_warp=4, max_warps=4, pdl_late_bytes=32 << 20,
        pdl_early_before=("attn_step", "gdn_delta"),
        q4_preload_after=("moe_down_add", "gdn_norm", "attn_step"), q4_preload_min_bytes=3 << 19,
        q4_one_tile_together=True,
        provenance=(_TUNING + "q4-decode-sweep-h200.json", _TUNING + "matvec-sweep-small-h200.json",
                    _RESULTS + "stop29/call3/log.txt", _RESULTS + "stop29/call4/log.txt",
                    _RESULTS + "stop38/call5/norm-matvec-80b.json", _RESULTS + "stop38/call6/ab.tar",
                    _RESULTS + "stop38/call10/ab.tar", _RESULTS + "stop40/call7/swiglu.json",
                    _RESULTS + "stop40/call8/ab.tar", _RESULTS + "stop40/call9/ab.tar",
                    _RESULTS + "stop40/call11/small.json", _RESULTS + "stop41/call1/add8/ab.tar",
                    _RESULTS + "stop42/README.md",
                    _RESULTS + "stop45/call4/small/bench-qwen3.5-0.8b-sm90-q4-tog-1.json",
                    _RESULTS + "stop45/call4/next/bench-qwen3.5-2b-sm90-q4-tog-1.json",
                    _RESULTS + "stop46/call1/next/bench-qwen3-next-80b-a3b-sm90-q4-tog-1.json",
                    _RESULTS + "stop46/call1/e2e/e2e-qwen3.5-small4-sm90-q4-tog.json",
                    _RESULTS + "stop42/call3/bench-qwen3-next-80b-a3b-sm90-q4-preAB-1.json",
                    _RESULTS + "stop42/call3/bench-qwen3.5-0.8b-sm90-q4-preB-1.json",
                    _RESULTS + "stop42/call4/bench-qwen3.5-4b-sm90-q4-preB-1.json")),
    # the grouped decode kernel (one program per kv head and split): rules of thumb checked statically
    # (ptxas -v, SASS of the loop: 168 registers at 27B bf16, no spills) and timed on the H200 in stop 20
    # (27B at 4000 rows 22.3 us against the per-query-head kernel's 38.4, whose reports are listed too;
    # split_tiles from a same-call A/B at short contexts, call 5 / 6)
    "attention": AttentionRule(
        split_programs=128, max_splits=64, min_rows_per_split=128,
        tile_bytes=32 * 1024, min_block_s=16, max_block_s=64, mma_min_heads=16,
        pipe_bytes_max=128 * 1024, smem_reserve=8 * 1024, min_tiles_in_flight=2, split_tiles=2, num_warps=4,
        fma_num_warps=8,
        provenance=(RULE_OF_THUMB,) + _ATTN_REPORTS + (
            _RESULTS + "stop20/call4/attn-pos44.json", _RESULTS + "stop20/call4/attn-pos4000.json",
            _RESULTS + "stop20/call6/bench-qwen3.5-27b-sm90-q4.json",
            _RESULTS + "stop20/call6/bench-oldattn-qwen3.5-27b-sm90-q4.json")),
    # query tiles of at most 32 rows: ptxas -v at D = 256 (sm_80 / sm_90) gives ~240 registers and no
    # spills for 32 rows with 8 warps and 16 with 4; 64 rows spilled (8 warps) or spilled heavily (4)
    "attn_rows": AttnRowsRule(
        max_block_r=32, min_block_r=16, programs_per_sm=1, tile_elems=8192, min_block_n=16, max_block_n=64,
        acc_elems_per_warp=512, min_warps=4, max_warps=8, pipe_bytes_max=64 * 1024, smem_reserve=8 * 1024,
        kv_num_warps=2, split_programs=128, max_splits=32, split_tiles=4,
        # the split (27B heads, 4-16 rows, chained, stop 27 call 1): at 1000 / 4000 cache rows 25-27 / 32-48 us
        # against 42 / 124 unsplit; at 64 rows 17.7 against 16.8 (split_tiles 4: one split works; 1: 19.2);
        # 8 warps at BLOCK_R 16 (acc_elems_per_warp 512): 12.6 / 15.7 / 20.0 / 28.8 us at 64 / 256 / 1000 / 4000
        # rows against 4 warps' 17.2 / 20.9 / 25.4 / 33.0 (call 2)
        provenance=(RULE_OF_THUMB, _RESULTS + "stop27/call1/attn-rows.json", _RESULTS + "stop27/call2/attn-rows.json")),
    "gdn_delta": GdnDeltaRule(min_block_v=8, max_block_v=8, block_v_div=16, num_warps=1,
                              provenance=(_RESULTS + "stop24/call2/summary.txt", _RESULTS + "stop29/call5/log.txt")),
    "gdn_norm": WarpsRule(num_warps=4, provenance=(RULE_OF_THUMB,)),
    "gdn_rows": GdnRowsRule(chunk=16, row_min_programs=256, min_block_v=8, max_block_v=8, block_v_div=16,
                            num_warps=1, chunk_block_v=16, chunk_num_warps=8, norm_block_m=16, norm_num_warps=4,
                            snap_norm_block_m=1,  # stop 38 call 8: 27B q4 K = 3 7.3 -> 5.7 us a launch
                            provenance=(_RESULTS + "stop17/prefill-big.json", _RESULTS + "stop24/call2/summary.txt",
                                        _RESULTS + "stop38/call8/printed.txt")),
    "rmsnorm": RmsnormRule(wide_n=2048, wide_warps=8, num_warps=4, provenance=(RULE_OF_THUMB,)),
    "embedding": BlockRule(block=1024, num_warps=4, provenance=(RULE_OF_THUMB,)),
    # many-CTA sampling: not yet timed (sample-sweep-h200.json measured the one-program kernel before it)
    # not swept: the rule's pick timed on the H200 (3.6 us greedy, 21.6 us at 0.7 / 0.8 / top-k 20)
    "sample": SampleRule(tile=4096, cand=32, num_warps=8, max_block=2048, min_block=512,
                         provenance=(RULE_OF_THUMB, _RESULTS + "stop18/device-call3-console.txt")),
    "step_end": WarpsRule(num_warps=1, provenance=(RULE_OF_THUMB,)),
    # the speculative iteration's row argmax and the MTP head's join (kernels/speculative.py, kernels/mtp.py):
    # not timed (no device here when they were written)
    "speculative": BlockRule(block=2048, num_warps=4, provenance=(RULE_OF_THUMB,)),
    # the best of 9 configurations around the one-row rule's at 8 shapes (27B, 0.8B) x bf16 / q4 at 4 rows:
    # the 27B bf16 picks kept (within 1.07x of the best); q4 and the 0.8B bf16 ones changed
    "matvec_rows": MatvecRowsRule(q4_ctas_per_sm=2, q4_block_k=1024, q4_warps=4, small_short_k=2048,
                                  small_short=(8, 256, 2), small_long=(4, 1024, 2),
                                  provenance=(_TUNING + "rows-sweep-h200.json",)),
    # Qwen3-Next's router and expert kernels (kernels/moe.py), timed on the H200: the one-row kernels at the 80B-A3B
    # shape (bench/moe_sweep.py): moe_topk's bitonic form (SORT) at 4 warps
    # (stop 41 call 1: 2.73 us alone against the serial max rounds' 3.32 at one warp, 3.47 at 4; SORT at one
    # warp 4.74, and the step with it 1.840 -> 1.914 ms/token: the kernel's time reaches the step; call 6: 8 warps
    # 3.10); moe_down's routed rows loaded before its PDL wait (down_early; stop 41 call 7, A B B A: 80B-A3B q4
    # 1.787 -> 1.761 ms/token, where stop 37's L2 prefetch of them had lost 0.8%), moe_gate_up's best of 58 tiles
    # (6.94 us against 10.89 with the matvec rule's 8 x 1024 x 4);
    # moe_down: the matvec rule's tiles, its experts unrolled (bf16); q4 gathered (stop 38: 16 rows x 8 warps, 5.99
    # us alone against the unrolled rule's 8.20; the 80B-A3B q4 step 1.992 -> 1.894 ms/token at 8 x 4, 1.875 at 16 x 8);
    # every kernel of a MoE plan preferring a 100% shared-memory carveout (stop 50 calls 2-3, H100, A B B A and
    # A B C C B A: 80B-A3B q4 1.829 -> 1.777 ms/token at 100%, 1.809 at 70%, the least attn_step's 158 KiB CTA takes;
    # presumably, where the driver picks each kernel's split, SMs drain to change it (not measured); the dense
    # plans lose or tie with it: 0.8B q4 +0.9%, 2B q4 +4.6%, 0.8B bf16 +3.1%, 27B q4 even, so only MoE plans take it;
    # call 4, as built against KESTREL_RULES="moe.carveout=-1": 80B-A3B q4 1.832 -> 1.782, 35B-A3B q4 1.445 -> 1.414;
    # on the H200, stop 51 call 4, A B B A twice: 80B-A3B q4 1.725 -> 1.686, 35B-A3B q4 1.337 -> 1.327)
    "moe": MoeRule(router_warps=4, topk_sort=True, down_early=True, max_block_n=16, down_stages=0, gate_up_block_n=8,
                   carveout=100,
                   gate_up_max_k=2048, gate_up_warps=4, group_warps=4, combine_block=1024,
                   grouped_gate_up=(32, 512, 4), grouped_down=(32, 512, 4), down_gather=(16, 8),
                   provenance=(_TUNING + "moe-sweep-h200.json", _RESULTS + "stop38/call3/moe-sweep-gather.json",
                               _RESULTS + "stop38/call4/ab.tar", _RESULTS + "stop41/call1/topk/moe-sweep-topk.json",
                               _RESULTS + "stop41/call6/moe-sweep-topk.json", _RESULTS + "stop41/call7/ab.tar",
                               _RESULTS + "stop50/call2/carve/bench-qwen3-next-80b-a3b-sm90-q4-carveout-1.json",
                               _RESULTS + "stop50/call3/bench-qwen3-next-80b-a3b-sm90-q4-c100-1.json",
                               _RESULTS + "stop50/call3/bench-qwen3.5-2b-sm90-q4-c100-1.json",
                               _RESULTS + "stop50/call4/bench-qwen3-next-80b-a3b-sm90-q4-1.json",
                               _RESULTS + "stop50/call4/bench-qwen3.5-35b-a3b-sm90-q4-1.json",
                               _RESULTS + "stop51/call4-carve/ab/bench-qwen3-next-80b-a3b-sm90-q4-1.json")),
    # one rule of the 1,019-variant sweep (stop 25 call 1, every variant exact to <= 2.4e-7 of q4_mma_ref): RB 4 x
    # KS 4, DEPTH 2, the smallest cluster giving >= 1 CTA per SM: within 1.11x (M = 4) / 1.08x (M = 8) of each
    # shape's best (geometric mean), 1.4-1.9x the few-rows matvec at 4 rows on the 27B matrices, 1.6-2.9x at 8,
    # 2.0-2.7x the GEMM at 16; the 0.8B matrices at 4 rows 0.92-1.12x (kept: one rule). M = 1 stays the matvec
    # (0.64-1.06x there). Grouped experts: RB 4 x KS 1 (Qwen3-Next, 2.7-4.0x the few-rows grouped kernels).
    # The gate / up pair: RB 2 x KS 4 with a 3-stage cp.async ring, weights prefetched before the PDL wait
    # (stop 26's chained sweep, 1,007 variants: 27B gate + up at 4 rows 37.8 us against 50.6 with the plain
    # split; the plain products keep the register form: the ring was no better at 4 rows as one rule). Grouped
    # gate / up: KS 2 with a 2-stage ring (Qwen3-Next, chained: 217 / 247 us at 256 / 512 rows against 240 / 274).
    # The pair persistent, two CTAs per SM in registers, was faster alone (35.2 us against the ring's 38.4 in the
    # same call; every other shape no faster: q4mma-persist-m4-chained-h200.json), taken at up to 4 rows: in the
    # whole 27B q4 spec3 plan its iteration is 8.76 against 9.02 ms (stop 27 call 1, same call), and its folded
    # NORM + PERSIST form ran clean under compute-sanitizer (4 layers of 27B with the head, call 2) and equal to
    # the CPU reference (4 layers at the 27B MLP width, call 4: the same tokens, logits within 0.2%)
    "q4_mma": MmaRule(max_rows=16, rb=4, ks=4, depth=2, clusters=(1, 2, 4), ctas_per_sm=1,
                        swiglu_rb=2, swiglu_ks=4, swiglu_stages=3, swiglu_persist=2, swiglu_persist_rows=4,
                        grouped_rows=16,
                        grouped_rb=4, grouped_ks=1, grouped_depth=2, grouped_swiglu_ks=2, grouped_swiglu_stages=2,
                        provenance=(_TUNING + "q4mma-sweep-h200.json", _TUNING + "q4mma-grouped-sweep-h200.json",
                                    _TUNING + "q4mma-pipe-chained-h200.json", _TUNING + "q4mma-grouped-pipe-chained-h200.json",
                                    _TUNING + "q4mma-persist-m4-chained-h200.json",
                                    _RESULTS + "stop27/call1/spec-qwen3.5-27b-sm90-q4-spec3-persist.txt",
                                    _RESULTS + "stop27/call2/sanitizer-qwen3.5-27b-4l-sm90-q4-spec3-persist.txt",
                                    _RESULTS + "stop27/call4/e2e-qwen3.5-wide4-sm90-q4-m4.json")),
    # bf16 weights on the same kernel (WBF16), at 4 rows (stop 28, chained, every variant within 4e-6 of the fp32
    # product): on the 0.8B matrices the best splits take the one-row matvec's time (in_proj 5.05 us against 5.15,
    # gate + up 6.24 / 6.24, down 4.87 / 3.75) and 1.2-1.6x less than the few-rows matvec: RB 1 x KS 8 with a
    # 3-stage ring (pair RB 2 x KS 4), the clusters' pick at 0.8 CTAs per SM (0.8B gate + up unclustered, down in
    # pairs). On the 27B matrices (63-178 MB) the best of ~750 variants is 0.92-1.05x the few-rows matvec and one
    # rule 1.08x slower (geometric mean; down 1.32x): ncu shows the same DRAM rate (3.3 TB/s) with 12% issue slots
    # busy against the few-rows matvec's 57%, so FMA issue was not what held the few-rows matvec there. Off above 32 MB a
    # weight, where the fold's saved add_rmsnorm launches (0.8 ms at 27B) would not pay for the slower products.
    # bench/q4stream_probe.py (stop 31), each kernel in a chain of programmatic edges at the 27B q4 shapes against the
    # Triton kernels the step runs: rmsnorm + gate / up 17408 x 5120 32.4 -> 27.1 us (RB 8, 2 stages, 8 consumer
    # warps), matvec_add 5120 x 6144 10.5 -> 8.7 (RB 16, 2, 4), the normed in_proj 16480 x 5120 16.1 -> 16.4, the
    # down projection and every 0.8B shape slower (calls 3, 6). The whole 27B q4 step, A B B A (call 9): none 5.483 /
    # 5.488 ms/token, the pair 5.187 / 5.185, the pair and the adds 5.432 / 5.435, the adds alone 5.77: the pair only.
    "q4_stream": StreamRule(pair=True, add=False, plain=False, norm_plain=False, rb=16, stages=2, nc=4,
                            pair_rb=8, pair_stages=2, pair_nc=8, min_rows=4096, min_k=5120, max_k=8192,
                            provenance=(_RESULTS + "stop31/call3/ws3.json", _RESULTS + "stop31/call6/forms.json",
                                        _RESULTS + "stop31/call9/bench-qwen3.5-27b-sm90-q4-stream-pair-1.json",
                                        _RESULTS + "stop31/call8/e2e-qwen3.5-0.8b-sm90-q4-stream.json")),
    "bf16_mma": MmaRule(max_rows=8, rb=1, ks=8, depth=2, stages=3, clusters=(1, 2, 4), ctas_per_sm=0.8,
                        swiglu_rb=2, swiglu_ks=4, swiglu_stages=3, max_weight_bytes=32 << 20,
                        provenance=(_RESULTS + "stop28/call1/bf16mma-sweep.json", _RESULTS + "stop28/call2/wide.json",
                                    _RESULTS + "stop28/call2/ncu.csv",
                                    _RESULTS + "stop28/call1/spec-qwen3.5-27b-sm90-bf16-spec3.txt")),
    # the best of 22 tile / warp configurations at 4 projection shapes x M 128 / 512 x bf16 / q4
    "gemm": GemmRule(many_rows=256, wide_n=16384, bf16_many=(128, 256, 64, 8), bf16_few=(64, 128, 64, 4),
                     bf16_few_wide=(64, 256, 64, 4), q4_many=(128, 64, 64, 4), q4_few=(128, 64, 128, 8),
                     q4_wide=(128, 128, 128, 8), skinny_rows=16, few_rows_matvec=8, bf16_skinny=(16, 64, 256, 2), q4_skinny=(16, 64, 128, 8),
                     bf16_skinny_swiglu=(16, 128, 128, 2), q4_skinny_swiglu=(16, 64, 128, 4),
                     provenance=(_TUNING + "gemm-sweep-h200.json", _TUNING + "gemm-skinny-sweep-h200.json",
                                 _TUNING + "gemm-skinny-swiglu-sweep-h200.json")),
})
FAMILIES = tuple(SM90_RULES)


def untuned_rules() -> Mapping[str, Rule]:
    """The sm_90 rows, marked untuned: what a target without its own sweeps uses."""
    return MappingProxyType({f: dataclasses.replace(r, tuned=False, provenance=(UNTUNED,))
                             for f, r in SM90_RULES.items()})


@dataclass(frozen=True)
class Target:
    name: str
    cc: int  # compute capability as Triton's GPUTarget takes it (90 for sm_90)
    sms: int  # SMs of ``part``
    smem_optin: int  # largest dynamic shared memory a CTA may opt into (bytes)
    part: str
    memory_mib: int = 0  # device memory of the largest part of the class (nvidia-smi's total, MiB): the most a
    #                      plan's arena may take (kestrelc build refuses a plan that cannot fit)
    rules: Mapping[str, Rule] = dataclasses.field(default_factory=untuned_rules, hash=False, compare=False,
                                                  repr=False)

    @property
    def tuned(self) -> bool:
        """True when every family's launch rule was tuned on this target."""
        return all(r.tuned for r in self.rules.values())


def untuned_note(target: Target) -> str | None:
    """'launch rules for sm_120 are untuned (H200 sm_90 values)', or None for a tuned target."""
    return None if target.tuned else f"launch rules for {target.name} are untuned (H200 sm_90 values)"


TARGETS = {t.name: t for t in (
    Target("sm_80", 80, 108, 163 * 1024, "A100", 81920),  # A100 80GB
    Target("sm_86", 86, 84, 99 * 1024, "RTX A6000", 49140),
    Target("sm_89", 89, 142, 99 * 1024, "L40S", 46068),
    Target("sm_90", 90, 132, 227 * 1024, "H100 / H200 SXM", 143771, SM90_RULES),  # H200 (the one lent here: ~140 GiB)
    Target("sm_100", 100, 148, 227 * 1024, "B200", 183359),
    Target("sm_120", 120, 170, 99 * 1024, "RTX 5090", 32607),
)}
GPU_TARGETS = tuple(TARGETS)
ALL_TARGETS = ("cpu",) + GPU_TARGETS


RULES_ENV = "KESTREL_RULES"


def override_rules(target: str, spec: str) -> list[str]:
    """Replace fields of ``target``'s launch-rule rows in this process (an experiment, or a kernel not yet
    on by default): ``spec`` is ``family.field=value`` assignments separated by spaces or commas, values
    Python literals (``q4_mma.max_rows=0 q4_mma.grouped_rows=0``, ``moe.down_gather=(8,4)``). The rows changed say
    so in their provenance. Returns the assignments; raises ValueError naming a bad one."""
    t = TARGETS[target]
    rows: dict[str, dict] = {}
    done = []
    for a in re.split(r"(?:\s|,)+(?![^()\[\]]*[)\]])", spec.strip()):  # (inside brackets: the value's)
        if not a:
            continue
        name, eq, value = a.partition("=")
        family, dot, field = name.partition(".")
        if not (eq and dot) or family not in t.rules or field not in {f.name for f in dataclasses.fields(t.rules[family])}:
            raise ValueError(f"{RULES_ENV}: {a!r} is not family.field=value with a family and field of the {target} "
                             f"rules ({', '.join(t.rules)})")
        try:
            rows.setdefault(family, {})[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{RULES_ENV}: {a!r}: the value is not a Python literal") from None
        done.append(a)
    new = {f: dataclasses.replace(t.rules[f], **fields, provenance=t.rules[f].provenance + (f"{RULES_ENV} {spec}",))
           for f, fields in rows.items()}
    TARGETS[target] = dataclasses.replace(t, rules=MappingProxyType({**t.rules, **new}))
    return done


def pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def fp_fusion(enabled: bool) -> dict:
    """A launch's compile option ``fp_fusion`` (Triton's ``enable_fp_fusion``: products contracted into adds):
    the key only where it is off, the default being on (so launches, and their text, that keep it are unchanged)."""
    return {} if enabled else {"fp_fusion": False}


def exact_verify_rules(rows: int) -> str:
    """The rule fields (``override_rules``' form) a speculative plan whose verify takes ``rows`` rows is built with,
    so that the verify computes each row as the one-token step computes it, bit for bit, and greedy speculation
    emits plain decoding's tokens on the GPU too (issue 12; bench/results/stop34: 27B q4, K = 3, 8 prompts x 256
    tokens equal, against a first difference at tokens 14-220 without). Each field names the kernel pair it makes
    twins of: the q4 products at one row on the verify's tensor-core kernel and split (q4_mma.one_row_as; q4_stream
    has no rows form), bf16 and small products on the few-rows matvec at the one-row split (bf16_mma.max_rows,
    matvec_rows.one_row_split) with the norms between them unfolded at one row as they are at the verify's rows
    (matvec_rows.fold_one_row), the floating-point products of both made as explicit FMA pairs (matvec_rows.pair_fma:
    with the compiler's own contraction the two kernels sum a chunk differently at some shapes, stop 36; without
    contraction the verify's bf16 products ran 1.22x slower at 27B, stop 39), attention rows in
    the one-token kernel's order (attn_rows.step_order_rows, which also gives the verify's key rows attn_step's
    warps), and no FMA contraction in the Gated DeltaNet and attention twins (fp_fusion). Its cost falls on the
    one-token step of such a plan (27B q4 5.9 against 5.2 ms); the iteration costs what it did (2.40 against 2.39
    ms/token projected at 2.5 accepted)."""
    return (f"q4_mma.one_row_as={rows} q4_stream.pair=False bf16_mma.max_rows=0 matvec_rows.one_row_split=True "
            f"matvec_rows.fold_one_row=False matvec_rows.pair_fma=True attn_rows.step_order_rows={rows} "
            f"gdn_delta.fp_fusion=False attention.fp_fusion=False")


@contextlib.contextmanager
def overridden_rules(target: str, spec: str):
    """``override_rules(target, spec)`` for the ``with`` block (it yields the assignments); the target's rows as
    they were afterwards, whatever else changed them inside."""
    saved = TARGETS[target]
    try:
        yield override_rules(target, spec)
    finally:
        TARGETS[target] = saved
