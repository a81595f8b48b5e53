#!/usr/bin/env bash
# The plans a stop's device call reads (bench/plans/, carried), built here; random weights store a seed, so each
# plan is small. Names as bench/device_stop.sh expects them. Pass names to build a subset:
#   bash bench/build_stop_plans.sh next4-bf16 tiny-next-q4-m16 tiny-next-bf16-m16 tiny-mtp-q4-spec3 0.8b-bf16 0.8b-q4
#     0.8b-q4-m8 next80-q4 next80-q4-m512 next4-bf16-spec3 next80-q4-spec3 27b-q4-spec3 27b-bf16-spec3
#     27b-q4-spec3-nosplit 27b-q4-spec3-persist 27b4-q4-m4-persist 27b4-q4-spec3-persist wide4-q4-m4
#     tiny-mtp-bf16-spec3 0.8b-bf16-m4 wide4-bf16-m4 27b-bf16-spec3-nomma 27b4-bf16-spec3
#     0.8b-bf16-spec3 0.8b-bf16-spec3-nomma 0.8b-bf16-nopre 27b-q4 27b-bf16 0.8b-bf16-gdnnopre 0.8b-q4-gdnnopre
#     27b-q4-gdnnopre next80-q4-decode next80-q4-decode-gdnnopre 27b-q4-norm32 next4-q4-spec3
#     27b-q4-pf24 27b-q4-pf64 0.8b-q4-pf24 27b4-q4-pf64 0.8b-bf16-pf24 2b-q4 4b-q4 9b-q4 2b-q4-pfN 4b-q4-pfN 9b-q4-pfN
#     0.8b-q4-pfN next80-q4-decode-pfN next80-q4-pfN (pfN: matvec.l2_prefetch_bytes = N MiB) small4-q4
#     MODEL-QUANT-lateN, e.g. 2b-q4-late1 next80-q4-late1 27b-bf16-late1 (matvec.pdl_late_bytes = N MiB)
#     0.8b-q4-attnold 0.8b-bf16-attnold 27b-q4-attnold
#     next80-q4-attnold (attn_step's queries as 16 rows: attention.narrow_queries=False)
#     0.8b-q4-base 27b-q4-base 0.8b-bf16-base next80-q4-base (built by commit badb274's compiler: the kernels before
#     stop 37; needs a worktree of it at /tmp/base: git worktree add /tmp/base badb274)
#     next80-q4-gNxW next4-q4-gNxW next4-q4-spec3-gNxW (moe.down_gather = (N, W): moe_down's gathered form, stop 38)
#     next80-q4-nshort0 2b-q4-nshort0 (matvec.q4_norm_short_k = 0: the normed q4 products at hidden 2048 as before
#     stop 38) small2b4-q4 (4 layers of the 2B shape, vocabulary 4,096) 27b-q4-spec3-snapmN 0.8b-bf16-spec3-snapmN
#     (gdn_rows.snap_norm_block_m = N) 27b-q4-early 27b-bf16-early 9b-bf16-early 27b-q4-earlyattn (matvec.pdl_early_before;
#     -bf16-early: matvec.pdl_early_q4_only=False)
#     27b-q4-spec3-base 27b-bf16-spec3-base 0.8b-bf16-spec3-base next80-q4-spec3-base (built by commit b431fa0's compiler, the verify's
#     per-row snapshots and gdn_rollback before stop 39's gdn_commit: git worktree add /tmp/base b431fa0; plan format
#     4, which the runtime since the format-5 commit refuses: stop 39's calls 2-5 ran before it)
#     27b-q4-spec3-cBxWxS (gdn_delta.commit_block / _warps / _stages = B, W, S)
#     2b-bf16-q4early 4b-bf16-q4early (matvec.pdl_early_q4_only=True: bf16 matvecs late as before stop 39)
#     2b-q4-pair0 4b-q4-pair0 9b-q4-pair0 (matvec.q4_pair_norm = (): the normed q4 gate / up pair's split as before stop 40)
#     4b-q4-add8 9b-q4-add8 (matvec.q4_ctas_per_sm=2 q4_long_k=16384: stop 40 call 11's sweep, not yet run as a step)
#     next80-q4-l2L next4-q4-l2L next4-q4-spec3-l2L (moe.topk_l2 = (128, L), stop 42 call 1: in this script at commit
#     79f3a66, which had moe_topk_l2 and matvec.q4_preload_bytes, the rule field of stop 42 call 2's MODEL-q4-q4preN
#     plans, since replaced by q4_preload_after) MODEL-q4-preA / -preB / -preAB, e.g. next80-q4-preA 0.8b-q4-preB (matvec.q4_preload_after: the q4
#     matvecs' first tile before the PDL wait after moe_down_add (A), gdn_norm and attn_step (B), all three, or none (0);
#     at every size: q4_preload_min_bytes=0) MODEL-q4-wkN, e.g. next80-q4-wk4096 small2b4-q4-wk4096
#     (matvec.q4_preload_whole_k = N, stop 42 call 6: in this script at commit 192dc67, which had the field)
#     next80-q4-sort next4-q4-sort (moe.topk_sort=True: moe_topk's bitonic top-k form at the rule's warps, stop 41
#     call 1, when the rule had 1) next80-q4-rounds (moe.topk_sort=False router_warps=1: moe_topk before stop 41)
#     9b-q4-long12k (matvec.q4_long_k=12288: 9B's down at 2048 inputs a tile, as before stop 41)
#     (stop 41 call 3's -base plans: /tmp/base a worktree of 8d4bd78, before embedding_rmsnorm; call 8's: aad81c4,
#     before moe_down's shared expert loaded early)
#     next80-q4-dearly next4-q4-dearly next4-q4-spec3-dearly (moe.down_early=True: moe_down's routed rows loaded
#     before its PDL wait)
#     (next80-q4-noroute / next4-q4-noroute, stop 40 call 1: in this script at commit 5cfc1de, which had the rule)
#     MODEL-QUANT-FORM[+FORM...] (stop 43's form tog, matvec.q4_one_tile_together: a one-tile q4 matrix's words and
#     scales at once, on since stop 46), e.g. 0.8b-q4-tog small4-q4-tog (stop 43's head, head16: attn_step's one
#     program a query head at short contexts, and eg: rmsnorm_moe_gate_up's loads before / right after its PDL wait,
#     with next4-q4-spec3-head: lost or even, removed; in this script at commit 2e5c32b, bench/results/stop45);
#     stop 44's gnw1, gnw2 (gdn_norm.num_warps = 1 / 2, a rule of thumb's 4 never timed: its one value head of 128
#     reduced inside one or two warps), e.g. 0.8b-q4-gnw1 next80-q4-gnw2
#     small4-q4-gnw1; stop 46's rt, rtN (moe.router_topk, the fused router: lost, removed; in this script at commit
#     4ecc22c, bench/results/stop46); notog (matvec.q4_one_tile_together=False: the rule before stop 46); the models
#     35b and moe35x4 take the forms too, e.g. 35b-q4-notog
#     stop 45: 35b-q4 35b-bf16 (Qwen3.5-35B-A3B, qwen3_5_moe: every layer a MoE block of 256 experts, top 8),
#     moe35x4-q4 moe35x4-bf16 moe35x4-q4-spec3 (4 layers of its shape with its MTP layer: GPU against CPU)
#     stop 47's forms gfold, gfoldpre (gdn_norm.fold: gdn_norm folded into the output projection; lost, removed in
#     stop 51; in this script at commit bf7c756, bench/results/stop50);
#     next4-yarn-bf16 next4-yarn-q4 (4 layers of the 80B-A3B shape with Qwen's YaRN settings, 8-row prefill:
#     GPU against CPU), next80-q4-yarn1m (the whole 80B-A3B q4 with them at --max-seq 1048576: 67.5 GB arena)
#     stop 49's forms gclus, gclus16 (gdn_cluster.on: a Gated DeltaNet mixer in one cluster launch; lost, removed in
#     stop 51; in this script at commit bf7c756, bench/results/stop50)
#     (any subset)
set -eu
cd "$(dirname "$0")/.."
mkdir -p bench/plans
R="--weights random --target sm_90"
next4() {  # 4 layers of the 80B-A3B shape (3 Gated DeltaNet + 1 attention, and its MTP layer): GPU against CPU
  d=$(mktemp -d); python3 -c "import json, sys; from kestrel.compiler.presets import SHAPES; c = dict(SHAPES['qwen3-next-80b-a3b']); c['num_hidden_layers'] = 4; c['mtp_num_hidden_layers'] = 1; json.dump(c, open(sys.argv[1] + '/config.json', 'w'))" "$d"
  echo "$d"
}
l27b4() {  # 4 layers of the 27B shape (3 Gated DeltaNet + 1 attention, and its MTP layer): GPU against CPU
  d=$(mktemp -d); python3 -c "import json, sys; from kestrel.compiler.presets import SHAPES; c = dict(SHAPES['qwen3.5-27b']); c['num_hidden_layers'] = 4; c['mtp_num_hidden_layers'] = 1; json.dump(c, open(sys.argv[1] + '/config.json', 'w'))" "$d"
  echo "$d"
}
wide4() {  # 4 layers of the 0.8B shape with the 27B's MLP width (17,408: the pair runs persistent at 4 rows) and a
  # 4,096-token vocabulary: the CPU reference's e2e fits a device call (4 layers of 27B did not in 5 minutes)
  d=$(mktemp -d); python3 -c "import json, sys; from kestrel.compiler.presets import SHAPES; c = dict(SHAPES['qwen3.5-0.8b']); c['num_hidden_layers'] = 4; c['intermediate_size'] = 17408; c['vocab_size'] = 4096; c['eos_token_id'] = 4095; c['tie_word_embeddings'] = False; c.pop('mtp_num_hidden_layers', None); json.dump(c, open(sys.argv[1] + '/config.json', 'w'))" "$d"
  echo "$d"
}
small4() {  # 4 layers of the 0.8B shape and a 4,096-token vocabulary: every q4 matrix under matvec.l2_prefetch_bytes,
  # the CPU reference's e2e within a device call
  d=$(mktemp -d); python3 -c "import json, sys; from kestrel.compiler.presets import SHAPES; c = dict(SHAPES['qwen3.5-0.8b']); c['num_hidden_layers'] = 4; c['vocab_size'] = 4096; c['eos_token_id'] = 4095; c['tie_word_embeddings'] = False; c.pop('mtp_num_hidden_layers', None); json.dump(c, open(sys.argv[1] + '/config.json', 'w'))" "$d"
  echo "$d"
}
small2b4() {  # 4 layers of the 2B shape (hidden 2048: the normed q4 products' short-K rule) and a 4,096-token
  # vocabulary: the CPU reference's e2e within a device call
  d=$(mktemp -d); python3 -c "import json, sys; from kestrel.compiler.presets import SHAPES; c = dict(SHAPES['qwen3.5-2b']); c['num_hidden_layers'] = 4; c['vocab_size'] = 4096; c['eos_token_id'] = 4095; c['tie_word_embeddings'] = False; c.pop('mtp_num_hidden_layers', None); json.dump(c, open(sys.argv[1] + '/config.json', 'w'))" "$d"
  echo "$d"
}
moe35x4() {  # 4 layers of the Qwen3.5-35B-A3B shape (3 Gated DeltaNet + 1 attention, every MLP a MoE block, and
  # its MTP layer): GPU against CPU
  d=$(mktemp -d); python3 -c "import json, sys; from kestrel.compiler.presets import SHAPES; c = dict(SHAPES['qwen3.5-35b-a3b']); c['num_hidden_layers'] = 4; c['mtp_num_hidden_layers'] = 1; json.dump(c, open(sys.argv[1] + '/config.json', 'w'))" "$d"
  echo "$d"
}
yarn80() {  # the 80B-A3B shape with Qwen's YaRN settings (factor 4 over 262,144 positions: 1,048,576), LAYERS layers
  d=$(mktemp -d); python3 -c "import json, sys; from kestrel.compiler.presets import SHAPES; c = dict(SHAPES['qwen3-next-80b-a3b']); c['num_hidden_layers'] = int(sys.argv[2]); c['rope_parameters'] = dict(c['rope_parameters'], rope_type='yarn', factor=4.0, original_max_position_embeddings=262144); json.dump(c, open(sys.argv[1] + '/config.json', 'w'))" "$d" "$1"
  echo "$d"
}
base_build() {  # kestrelc build ARGS... by the compiler of the worktree at /tmp/base (the -base plans)
  rm -rf /tmp/basepkg; mkdir -p /tmp/basepkg/kestrel
  for s in compiler passes kernels artifacts runtime; do ln -s /tmp/base/$s /tmp/basepkg/kestrel/$s; done
  (cd /tmp/base && PYTHONPATH=/tmp/basepkg python3 -m kestrel.compiler.cli build "$@")
}
for p in "$@"; do
  case $p in
    next4-bf16) kestrelc build "$(next4)" $R --quant bf16 -o bench/plans/qwen3-next-4l-sm90-bf16.plan ;;
    35b-q4|35b-bf16) kestrelc build qwen3.5-35b-a3b $R --quant ${p#35b-} --max-seq 4096 --prefill-rows 256 -o bench/plans/qwen3.5-35b-a3b-sm90-${p#35b-}.plan ;;
    moe35x4-q4|moe35x4-bf16) kestrelc build "$(moe35x4)" $R --quant ${p#moe35x4-} -o bench/plans/qwen3.5-moe35-4l-sm90-${p#moe35x4-}.plan ;;
    moe35x4-q4-spec3) kestrelc build "$(moe35x4)" $R --quant q4 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-moe35-4l-sm90-q4-spec3.plan ;;
    tiny-next-q4-m16) kestrelc build tiny-next --target sm_90 --quant q4 --prefill-rows 16 -o bench/plans/tiny-next-sm90-q4-m16.plan ;;
    tiny-next-bf16-m16) kestrelc build tiny-next --target sm_90 --quant bf16 --prefill-rows 16 -o bench/plans/tiny-next-sm90-bf16-m16.plan ;;
    tiny-mtp-bf16-spec3) kestrelc build tiny-mtp --target sm_90 --quant bf16 --speculative mtp --draft-tokens 3 -o bench/plans/tiny-mtp-sm90-bf16-spec3.plan ;;
    0.8b-bf16-m4) kestrelc build qwen3.5-0.8b $R --quant bf16 --prefill-rows 4 -o bench/plans/qwen3.5-0.8b-sm90-bf16-m4.plan ;;
    tiny-mtp-q4-spec3) kestrelc build tiny-mtp --target sm_90 --quant q4 --speculative mtp --draft-tokens 3 -o bench/plans/tiny-mtp-sm90-q4-spec3.plan ;;
    0.8b-bf16) kestrelc build qwen3.5-0.8b $R --quant bf16 -o bench/plans/qwen3.5-0.8b-sm90-bf16.plan ;;
    0.8b-q4) kestrelc build qwen3.5-0.8b $R --quant q4 -o bench/plans/qwen3.5-0.8b-sm90-q4.plan ;;
    0.8b-q4-m8) kestrelc build qwen3.5-0.8b $R --quant q4 --prefill-rows 8 -o bench/plans/qwen3.5-0.8b-sm90-q4-m8.plan ;;
    next4-q4-spec3) kestrelc build "$(next4)" $R --quant q4 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3-next-4l-sm90-q4-spec3.plan ;;
    next4-bf16-spec3) kestrelc build "$(next4)" $R --quant bf16 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3-next-4l-sm90-bf16-spec3.plan ;;
    27b-q4-norm32) python3 bench/build_variant.py matvec.q4_wide_norm_block_n=32 matvec.q4_wide_norm_warps=2 -- qwen3.5-27b $R --quant q4 -o bench/plans/qwen3.5-27b-sm90-q4-norm32.plan ;;
    next80-q4-spec3) kestrelc build qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-spec3.plan ;;
    next80-q4-m512) kestrelc build qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --prefill-rows 512 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-m512.plan ;;
    next80-q4) kestrelc build qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --prefill-rows 256 -o bench/plans/qwen3-next-80b-a3b-sm90-q4.plan ;;
    27b-q4-spec3) kestrelc build qwen3.5-27b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-sm90-q4-spec3.plan ;;
    27b-bf16-spec3) kestrelc build qwen3.5-27b $R --quant bf16 --max-seq 4096 --speculative mtp --draft-tokens 3 --draft-quant q4 -o bench/plans/qwen3.5-27b-sm90-bf16-spec3.plan ;;
    27b-q4-spec3-nosplit) python3 bench/build_variant.py attn_rows.max_splits=1 -- qwen3.5-27b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-sm90-q4-spec3-nosplit.plan ;;
    27b-q4-spec3-persist) python3 bench/build_variant.py q4_mma.swiglu_persist=2 -- qwen3.5-27b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-sm90-q4-spec3-persist.plan ;;
    27b4-q4-m4-persist) python3 bench/build_variant.py q4_mma.swiglu_persist=2 -- "$(l27b4)" $R --quant q4 --prefill-rows 4 -o bench/plans/qwen3.5-27b-4l-sm90-q4-m4-persist.plan ;;
    27b4-q4-spec3-persist) python3 bench/build_variant.py q4_mma.swiglu_persist=2 -- "$(l27b4)" $R --quant q4 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-4l-sm90-q4-spec3-persist.plan ;;
    wide4-q4-m4) kestrelc build "$(wide4)" $R --quant q4 --prefill-rows 4 -o bench/plans/qwen3.5-wide4-sm90-q4-m4.plan ;;
    wide4-bf16-m4) kestrelc build "$(wide4)" $R --quant bf16 --prefill-rows 4 -o bench/plans/qwen3.5-wide4-sm90-bf16-m4.plan ;;
    27b-bf16-spec3-nomma) python3 bench/build_variant.py bf16_mma.max_rows=0 -- qwen3.5-27b $R --quant bf16 --max-seq 4096 --speculative mtp --draft-tokens 3 --draft-quant q4 -o bench/plans/qwen3.5-27b-sm90-bf16-spec3-nomma.plan ;;
    0.8b-bf16-spec3) kestrelc build qwen3.5-0.8b $R --quant bf16 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-0.8b-sm90-bf16-spec3.plan ;;
    0.8b-bf16-spec3-nomma) python3 bench/build_variant.py bf16_mma.max_rows=0 -- qwen3.5-0.8b $R --quant bf16 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-0.8b-sm90-bf16-spec3-nomma.plan ;;
    27b4-bf16-spec3) kestrelc build "$(l27b4)" $R --quant bf16 --speculative mtp --draft-tokens 3 --draft-quant q4 -o bench/plans/qwen3.5-27b-4l-sm90-bf16-spec3.plan ;;
    0.8b-bf16-nopre) python3 bench/build_variant.py matvec.preload_bytes=0 -- qwen3.5-0.8b $R --quant bf16 -o bench/plans/qwen3.5-0.8b-sm90-bf16-nopre.plan ;;
    0.8b-bf16-gdnnopre) python3 bench/build_variant.py gdn_delta.preload=False -- qwen3.5-0.8b $R --quant bf16 -o bench/plans/qwen3.5-0.8b-sm90-bf16-gdnnopre.plan ;;
    0.8b-q4-gdnnopre) python3 bench/build_variant.py gdn_delta.preload=False -- qwen3.5-0.8b $R --quant q4 -o bench/plans/qwen3.5-0.8b-sm90-q4-gdnnopre.plan ;;
    27b-q4-gdnnopre) python3 bench/build_variant.py gdn_delta.preload=False -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-gdnnopre.plan ;;
    next80-q4-decode) kestrelc build qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-decode.plan ;;
    next80-q4-decode-gdnnopre) python3 bench/build_variant.py gdn_delta.preload=False -- qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-decode-gdnnopre.plan ;;
    27b-q4-pf24) python3 bench/build_variant.py matvec.l2_prefetch_bytes=25165824 -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-pf24.plan ;;
    27b-q4-pf64) python3 bench/build_variant.py matvec.l2_prefetch_bytes=67108864 -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-pf64.plan ;;
    27b4-q4-pf64) python3 bench/build_variant.py matvec.l2_prefetch_bytes=67108864 -- "$(l27b4)" $R --quant q4 -o bench/plans/qwen3.5-27b-4l-sm90-q4-pf64.plan ;;
    0.8b-bf16-pf24) python3 bench/build_variant.py matvec.l2_prefetch_bytes=25165824 -- qwen3.5-0.8b $R --quant bf16 -o bench/plans/qwen3.5-0.8b-sm90-bf16-pf24.plan ;;
    2b-q4|4b-q4|9b-q4) kestrelc build qwen3.5-${p%-q4} $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-${p%-q4}-sm90-q4.plan ;;
    next80-q4-pf*) python3 bench/build_variant.py matvec.l2_prefetch_bytes=$(( ${p##*-pf} << 20 )) -- qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --prefill-rows 256 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-pf${p##*-pf}.plan ;;
    0.8b-q4-pf*|2b-q4-pf*|4b-q4-pf*|9b-q4-pf*) m=qwen3.5-${p%-q4-pf*}
      python3 bench/build_variant.py matvec.l2_prefetch_bytes=$(( ${p##*-pf} << 20 )) -- $m $R --quant q4 --max-seq 4096 -o bench/plans/$m-sm90-q4-pf${p##*-pf}.plan ;;
    *-q4-late*|*-bf16-late*) m=${p%%-*}; q=${p#*-}; q=${q%%-*}; x=""
      case $m in next80) m=qwen3-next-80b-a3b; x="--prefill-rows 256";; *) m=qwen3.5-$m;; esac
      python3 bench/build_variant.py matvec.pdl_late_bytes=$(( ${p##*-late} << 20 )) -- $m $R --quant $q --max-seq 4096 $x -o bench/plans/$m-sm90-$q-late${p##*-late}.plan ;;
    2b-bf16|4b-bf16|9b-bf16) kestrelc build qwen3.5-${p%-bf16} $R --quant bf16 --max-seq 4096 -o bench/plans/qwen3.5-${p%-bf16}-sm90-bf16.plan ;;
    next80-q4-decode-pf*) python3 bench/build_variant.py matvec.l2_prefetch_bytes=$(( ${p##*-pf} << 20 )) -- qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-decode-pf${p##*-pf}.plan ;;
    next4-q4) kestrelc build "$(next4)" $R --quant q4 -o bench/plans/qwen3-next-4l-sm90-q4.plan ;;
    next80-q4-nshort0) python3 bench/build_variant.py matvec.q4_norm_short_k=0 -- qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --prefill-rows 256 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-nshort0.plan ;;
    2b-q4-pair0|4b-q4-pair0|9b-q4-pair0) m=qwen3.5-${p%-q4-pair0}  # the normed q4 gate / up pair on the rule before stop 40
      python3 bench/build_variant.py "matvec.q4_pair_norm=()" -- $m $R --quant q4 --max-seq 4096 -o bench/plans/$m-sm90-q4-pair0.plan ;;
    next80-q4-sort)  # moe_topk's bitonic top-k form
      python3 bench/build_variant.py moe.topk_sort=True -- qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --prefill-rows 256 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-sort.plan ;;
    next80-q4-rounds)  # moe_topk's serial max rounds at one warp (the rule before stop 41)
      python3 bench/build_variant.py moe.topk_sort=False moe.router_warps=1 -- qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --prefill-rows 256 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-rounds.plan ;;
    9b-q4-long12k)  # 9B's down at 2048 inputs a tile (the rule before stop 41)
      python3 bench/build_variant.py matvec.q4_long_k=12288 -- qwen3.5-9b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-9b-sm90-q4-long12k.plan ;;
    next80-q4-dearly)  # moe_down's routing and routed rows loaded before its PDL wait
      python3 bench/build_variant.py moe.down_early=True -- qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --prefill-rows 256 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-dearly.plan ;;
    next4-q4-dearly) python3 bench/build_variant.py moe.down_early=True -- "$(next4)" $R --quant q4 -o bench/plans/qwen3-next-4l-sm90-q4-dearly.plan ;;
    next4-q4-spec3-dearly) python3 bench/build_variant.py moe.down_early=True -- "$(next4)" $R --quant q4 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3-next-4l-sm90-q4-spec3-dearly.plan ;;
    *-q4-preA|*-q4-preB|*-q4-preAB|*-q4-pre0) m=${p%%-*}; v=${p##*-pre}; x="--max-seq 4096"  # matvec.q4_preload_after, stop 42
      case $v in A) a="('moe_down_add',)";; B) a="('gdn_norm','attn_step')";; AB) a="('moe_down_add','gdn_norm','attn_step')";; 0) a="()";; esac
      case $m in next80) m=qwen3-next-80b-a3b; o=$m; x="$x --prefill-rows 256";; 0.8b) m=qwen3.5-$m; o=$m; x="";;
        next4) m=$(next4); o=qwen3-next-4l; x="";; small4) m=$(small4); o=qwen3.5-small4; x="";; *) m=qwen3.5-$m; o=$m;; esac
      python3 bench/build_variant.py "matvec.q4_preload_after=$a" matvec.q4_preload_min_bytes=0 -- "$m" $R --quant q4 $x -o bench/plans/$o-sm90-q4-pre$v.plan ;;
    next4-q4-sort) d=$(next4)
      python3 bench/build_variant.py moe.topk_sort=True -- "$d" $R --quant q4 -o bench/plans/qwen3-next-4l-sm90-q4-sort.plan ;;
    4b-q4-add8|9b-q4-add8) m=qwen3.5-${p%-q4-add8}  # the q4 fewer-rows matvecs at 8 rows (4B) and 1024 inputs a tile (9B's down)
      python3 bench/build_variant.py matvec.q4_ctas_per_sm=2 matvec.q4_long_k=16384 -- $m $R --quant q4 --max-seq 4096 -o bench/plans/$m-sm90-q4-add8.plan ;;
    2b-q4-nshort0) python3 bench/build_variant.py matvec.q4_norm_short_k=0 -- qwen3.5-2b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-2b-sm90-q4-nshort0.plan ;;
    next80-q4-g[0-9]*|next4-q4-g[0-9]*|next4-q4-spec3-g[0-9]*) g=${p##*-g}; bn=${g%x*}; nw=${g#*x}  # moe.down_gather = (BLOCK_N, warps)
      case $p in next80*) m=qwen3-next-80b-a3b; x="--max-seq 4096 --prefill-rows 256"; o=qwen3-next-80b-a3b-sm90-q4;;
        next4-q4-spec3*) m=$(next4); x="--speculative mtp --draft-tokens 3"; o=qwen3-next-4l-sm90-q4-spec3;;
        *) m=$(next4); x=""; o=qwen3-next-4l-sm90-q4;; esac
      python3 bench/build_variant.py "moe.down_gather=($bn,$nw)" -- "$m" $R --quant q4 $x -o bench/plans/$o-g$g.plan ;;
    next4-q4-base) base_build "$(next4)" $R --quant q4 -o "$PWD/bench/plans/qwen3-next-4l-sm90-q4-base.plan" ;;
    0.8b-q4-attnold|0.8b-bf16-attnold) q=${p#0.8b-}; q=${q%-attnold}
      python3 bench/build_variant.py attention.narrow_queries=False -- qwen3.5-0.8b $R --quant $q -o bench/plans/qwen3.5-0.8b-sm90-$q-attnold.plan ;;
    27b-q4-attnold) python3 bench/build_variant.py attention.narrow_queries=False -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-attnold.plan ;;
    next80-q4-attnold) python3 bench/build_variant.py attention.narrow_queries=False -- qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --prefill-rows 256 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-attnold.plan ;;
    0.8b-q4-base|27b-q4-base|0.8b-bf16-base|next80-q4-base) m=${p%-*-base}; q=${p%-base}; q=${q##*-}
      x=""; case $m in next80) m=qwen3-next-80b-a3b; x="--prefill-rows 256";; *) m=qwen3.5-$m;; esac
      base_build $m $R --quant $q --max-seq 4096 $x -o "$PWD/bench/plans/$m-sm90-$q-base.plan" ;;
    *-q4-tog*|*-bf16-tog*|*-q4-gnw*|*-q4-notog)  # stop 43's forms, joined by +: MODEL-QUANT-FORM[+FORM...]
      m=${p%%-*}; q=${p#*-}; q=${q%%-*}; v=${p#*-*-}; x="--max-seq 4096"; a=""
      for f in $(echo "$v" | tr + ' '); do case $f in
        tog) a="$a matvec.q4_one_tile_together=True";;
        gnw1|gnw2) a="$a gdn_norm.num_warps=${f#gnw}";; notog) a="$a matvec.q4_one_tile_together=False";;
        *) echo "$p: unknown form $f (tog, notog, gnw1, gnw2)"; exit 2;; esac; done
      case $m in next80) m=qwen3-next-80b-a3b; o=$m; x="$x --prefill-rows 256";; 0.8b) m=qwen3.5-$m; o=$m; x="";;
        35b) m=qwen3.5-35b-a3b; o=$m; x="$x --prefill-rows 256";; moe35x4) m=$(moe35x4); o=qwen3.5-moe35-4l; x="";;
        next4) m=$(next4); o=qwen3-next-4l; x="";; small4) m=$(small4); o=qwen3.5-small4; x="";;
        small2b4) m=$(small2b4); o=qwen3.5-small2b4; x="";; *) m=qwen3.5-$m; o=$m;; esac
      python3 bench/build_variant.py $a -- "$m" $R --quant $q $x -o bench/plans/$o-sm90-$q-$v.plan ;;
    small4-q4) kestrelc build "$(small4)" $R --quant q4 -o bench/plans/qwen3.5-small4-sm90-q4.plan ;;
    27b-q4-spec3-base|27b-bf16-spec3-base|0.8b-bf16-spec3-base) m=qwen3.5-${p%%-*}; q=${p#*-}; q=${q%%-*}
      x="--max-seq 4096 --speculative mtp --draft-tokens 3"; [ $p = 27b-bf16-spec3-base ] && x="$x --draft-quant q4"
      base_build $m $R --quant $q $x -o "$PWD/bench/plans/$m-sm90-$q-spec3-base.plan" ;;
    next80-q4-spec3-base) base_build qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o "$PWD/bench/plans/qwen3-next-80b-a3b-sm90-q4-spec3-base.plan" ;;
    27b-q4-spec3-c*) v=${p#27b-q4-spec3-c}; b=${v%%x*}; v=${v#*x}; w=${v%%x*}; st=${v#*x}  # gdn_commit BLOCKxWARPSxSTAGES
      python3 bench/build_variant.py gdn_delta.commit_block=$b gdn_delta.commit_warps=$w gdn_delta.commit_stages=$st -- qwen3.5-27b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-sm90-q4-spec3-c$b"x"$w"x"$st.plan ;;
    2b-bf16-q4early|4b-bf16-q4early) m=qwen3.5-${p%%-*}  # the early PDL triggers for q4 matvecs only (before stop 39)
      python3 bench/build_variant.py matvec.pdl_early_q4_only=True -- $m $R --quant bf16 --max-seq 4096 -o bench/plans/$m-sm90-bf16-q4early.plan ;;
    27b-q4-early|27b-bf16-early|9b-bf16-early) m=qwen3.5-${p%%-*}; q=${p#*-}; q=${q%-early}  # matvec.pdl_early_before, bf16 too
      python3 bench/build_variant.py "matvec.pdl_early_before=('attn_step','gdn_delta')" matvec.pdl_early_q4_only=False -- $m $R --quant $q --max-seq 4096 -o bench/plans/$m-sm90-$q-early.plan ;;
    27b-q4-earlyattn) python3 bench/build_variant.py "matvec.pdl_early_before=('attn_step',)" -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-earlyattn.plan ;;
    27b-q4-spec3-snapm*|0.8b-bf16-spec3-snapm*) m=qwen3.5-${p%%-*}; q=${p#*-}; q=${q%%-*}; x="--max-seq 4096"
      python3 bench/build_variant.py gdn_rows.snap_norm_block_m=${p##*-snapm} -- $m $R --quant $q $x --speculative mtp --draft-tokens 3 -o bench/plans/$m-sm90-$q-spec3-snapm${p##*-snapm}.plan ;;
    small2b4-q4) kestrelc build "$(small2b4)" $R --quant q4 -o bench/plans/qwen3.5-small2b4-sm90-q4.plan ;;
    27b-q4) kestrelc build qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4.plan ;;
    27b-q4-stream) python3 bench/build_variant.py q4_stream.pair=True q4_stream.add=True -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-stream.plan ;;
    27b4-q4) kestrelc build "$(l27b4)" $R --quant q4 -o bench/plans/qwen3.5-27b-4l-sm90-q4.plan ;;
    27b-q4-spec3-tri) python3 bench/build_variant.py q4_mma.max_rows=0 q4_stream.pair=False -- qwen3.5-27b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-sm90-q4-spec3-tri.plan ;;
    27b-q4-spec3-tri1row) python3 bench/build_variant.py q4_mma.max_rows=0 q4_stream.pair=False matvec_rows.one_row_split=True -- qwen3.5-27b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-sm90-q4-spec3-tri1row.plan ;;
    27b-q4-spec3-mma1row) python3 bench/build_variant.py q4_mma.one_row_as=4 bf16_mma.max_rows=0 q4_stream.pair=False matvec_rows.one_row_split=True -- qwen3.5-27b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-sm90-q4-spec3-mma1row.plan ;;
    27b-q4-spec3-rowexact) python3 bench/build_variant.py q4_mma.one_row_as=4 bf16_mma.max_rows=0 q4_stream.pair=False matvec_rows.one_row_split=True attn_rows.step_order_rows=4 -- qwen3.5-27b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-sm90-q4-spec3-rowexact.plan ;;
    27b4-q4-spec3-rowexact) python3 bench/build_variant.py q4_mma.one_row_as=4 bf16_mma.max_rows=0 q4_stream.pair=False matvec_rows.one_row_split=True attn_rows.step_order_rows=4 -- "$(l27b4)" $R --quant q4 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-4l-sm90-q4-spec3-rowexact.plan ;;
    0.8b-q4-spec3) kestrelc build qwen3.5-0.8b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-0.8b-sm90-q4-spec3.plan ;;
    next80-q4-stream) python3 bench/build_variant.py q4_stream.norm_plain=True q4_stream.add=True q4_stream.min_k=2048 q4_stream.min_rows=1024 -- qwen3-next-80b-a3b $R --quant q4 --max-seq 4096 --prefill-rows 256 -o bench/plans/qwen3-next-80b-a3b-sm90-q4-stream.plan ;;
    next4-q4-stream) python3 bench/build_variant.py q4_stream.norm_plain=True q4_stream.add=True q4_stream.min_k=2048 q4_stream.min_rows=1024 -- "$(next4)" $R --quant q4 -o bench/plans/qwen3-next-4l-sm90-q4-stream.plan ;;
    27b-q4-spec3-exact) python3 bench/build_variant.py q4_mma.one_row_as=4 bf16_mma.max_rows=0 q4_stream.pair=False matvec_rows.one_row_split=True attn_rows.step_order_rows=4 gdn_delta.fp_fusion=False attention.fp_fusion=False -- qwen3.5-27b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-sm90-q4-spec3-exact.plan ;;
    27b4-q4-spec3-exact) python3 bench/build_variant.py q4_mma.one_row_as=4 bf16_mma.max_rows=0 q4_stream.pair=False matvec_rows.one_row_split=True attn_rows.step_order_rows=4 gdn_delta.fp_fusion=False attention.fp_fusion=False -- "$(l27b4)" $R --quant q4 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-4l-sm90-q4-spec3-exact.plan ;;
    27b-q4-nofuse) python3 bench/build_variant.py gdn_delta.fp_fusion=False attention.fp_fusion=False -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-nofuse.plan ;;
    0.8b-q4-nofuse) python3 bench/build_variant.py gdn_delta.fp_fusion=False attention.fp_fusion=False -- qwen3.5-0.8b $R --quant q4 -o bench/plans/qwen3.5-0.8b-sm90-q4-nofuse.plan ;;
    27b4-q4-spec3-mma1row) python3 bench/build_variant.py q4_mma.one_row_as=4 bf16_mma.max_rows=0 q4_stream.pair=False matvec_rows.one_row_split=True -- "$(l27b4)" $R --quant q4 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-4l-sm90-q4-spec3-mma1row.plan ;;
    27b4-q4-spec3) kestrelc build "$(l27b4)" $R --quant q4 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-4l-sm90-q4-spec3.plan ;;
    27b4-q4-stream) python3 bench/build_variant.py q4_stream.pair=True q4_stream.add=True -- "$(l27b4)" $R --quant q4 -o bench/plans/qwen3.5-27b-4l-sm90-q4-stream.plan ;;
    27b-q4-stream-pair) python3 bench/build_variant.py q4_stream.pair=True q4_stream.add=False -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-stream-pair.plan ;;
    27b-q4-stream-add) python3 bench/build_variant.py q4_stream.pair=False q4_stream.add=True -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-stream-add.plan ;;
    27b-q4-nostream) python3 bench/build_variant.py q4_stream.pair=False q4_stream.add=False -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-nostream.plan ;;
    27b-q4-pairminb2) python3 bench/build_variant.py q4_stream.pair_minb=2 -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-pairminb2.plan ;;
    27b-q4-pairks) python3 bench/build_variant.py q4_stream.pair_nc=10 q4_stream.pair_ks=5 -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-pairks.plan ;;
    27b-q4-down) python3 bench/build_variant.py q4_stream.wide=True -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-down.plan ;;
    27b-q4-down-out) python3 bench/build_variant.py q4_stream.wide=True q4_stream.add=True q4_stream.rb=8 q4_stream.nc=12 q4_stream.ks=6 -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-down-out.plan ;;
    27b-q4-pairks-minb2) python3 bench/build_variant.py q4_stream.pair_nc=10 q4_stream.pair_ks=5 q4_stream.pair_minb=2 -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-pairks-minb2.plan ;;
    27b-q4-all-minb2) python3 bench/build_variant.py q4_stream.pair_nc=10 q4_stream.pair_ks=5 q4_stream.pair_minb=2 q4_stream.add=True q4_stream.rb=8 q4_stream.nc=12 q4_stream.ks=6 q4_stream.minb=2 q4_stream.wide=True q4_stream.wide_rb=4 q4_stream.wide_minb=2 -- qwen3.5-27b $R --quant q4 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-q4-all-minb2.plan ;;
    0.8b-q4-streamks) python3 bench/build_variant.py q4_stream.pair=True q4_stream.add=True q4_stream.norm_plain=True q4_stream.wide=True q4_stream.min_rows=1024 q4_stream.min_k=0 q4_stream.max_k=2048 q4_stream.wide_max_k=3584 q4_stream.rb=8 q4_stream.nc=4 q4_stream.ks=2 q4_stream.minb=2 q4_stream.pair_rb=8 q4_stream.pair_nc=8 q4_stream.pair_ks=2 q4_stream.wide_rb=8 q4_stream.wide_nc=8 q4_stream.wide_ks=8 -- qwen3.5-0.8b $R --quant q4 --max-seq 256 -o bench/plans/qwen3.5-0.8b-sm90-q4-streamks.plan ;;
    0.8b-q4-stream) python3 bench/build_variant.py q4_stream.pair=True q4_stream.add=True q4_stream.min_rows=1024 q4_stream.min_k=0 -- qwen3.5-0.8b $R --quant q4 --max-seq 256 -o bench/plans/qwen3.5-0.8b-sm90-q4-stream.plan ;;
    27b-q4-spec3-stream) python3 bench/build_variant.py q4_stream.pair=True q4_stream.add=True -- qwen3.5-27b $R --quant q4 --max-seq 4096 --speculative mtp --draft-tokens 3 -o bench/plans/qwen3.5-27b-sm90-q4-spec3-stream.plan ;;
    27b-bf16) kestrelc build qwen3.5-27b $R --quant bf16 --max-seq 4096 -o bench/plans/qwen3.5-27b-sm90-bf16.plan ;;
    next4-yarn-bf16|next4-yarn-q4) kestrelc build "$(yarn80 4)" $R --quant ${p#next4-yarn-} --prefill-rows 8 -o bench/plans/qwen3-next-4l-yarn-sm90-${p#next4-yarn-}.plan ;;
    next80-q4-yarn1m) kestrelc build "$(yarn80 48)" $R --quant q4 --max-seq 1048576 --prefill-rows 256 -o bench/plans/qwen3-next-80b-a3b-yarn1m-sm90-q4.plan ;;
    *) echo "unknown plan $p"; exit 2 ;;
  esac
done
ls -la bench/plans
