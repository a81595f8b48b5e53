#!/usr/bin/env bash
# Stop 41's device calls, one part a call (each under the 10-minute limit); everything under OUTDIR.
#   topk    moe_topk's two forms (serial max rounds; SORT: one bitonic top-k, moe.topk_sort) at 1 / 2 / 4 warps,
#           chained alone (bench/moe_sweep.py MOE_SWEEP_KINDS=topk; carry bench/moe-sweep-topk:
#           MOE_SWEEP_KINDS=topk python bench/moe_sweep.py compile bench/moe-sweep-topk), then the whole 80B-A3B q4
#           step with each form, A B B A, and 4 layers of it with SORT against the CPU reference and under
#           compute-sanitizer (bash bench/build_stop_plans.sh next80-q4 next80-q4-sort next4-q4-sort)
#   add8    stop 40 call 11's splits for the q4 products with fewer rows as a whole step, A B B A:
#           matvec.q4_ctas_per_sm=2 (4B's 2560-row products at 8 rows) and q4_long_k=16384 (9B's down at 1024
#           inputs a tile) (bash bench/build_stop_plans.sh 4b-q4 9b-q4 4b-q4-add8 9b-q4-add8)
# There: run(carry=["bench/plans", ...]): bash bench/device_stop41.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
case $2 in
  topk)
    (cd bench && timeout 120 python3 moe_sweep.py time moe-sweep-topk "$out/moe-sweep-topk.json" > "$out/moe-sweep-topk.txt" 2>&1)
    echo "sweep: exit $?"; grep "^topk" "$out/moe-sweep-topk.txt" | head -8
    STEP_TIMEOUT=100 PAIRS="qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-sm90-q4-sort" \
      SANITIZE="qwen3-next-4l-sm90-q4-sort" E2E="qwen3-next-4l-sm90-q4-sort" bash bench/device_preload_ab.sh "$out" ;;
  add8)
    STEP_TIMEOUT=100 PAIRS="qwen3.5-4b-sm90-q4:qwen3.5-4b-sm90-q4-add8 qwen3.5-9b-sm90-q4:qwen3.5-9b-sm90-q4-add8" \
      bash bench/device_preload_ab.sh "$out" ;;
  confirm)  # call 1's picks as the rule (moe_topk SORT at 4 warps, matvec.q4_long_k=16384) against the rules before,
    # A B B A; 4 layers of 80B-A3B q4 on the rule against the CPU reference and under compute-sanitizer
    # (bash bench/build_stop_plans.sh next80-q4 next80-q4-rounds 9b-q4 9b-q4-long12k next4-q4)
    STEP_TIMEOUT=100 PAIRS="qwen3-next-80b-a3b-sm90-q4-rounds:qwen3-next-80b-a3b-sm90-q4 qwen3.5-9b-sm90-q4-long12k:qwen3.5-9b-sm90-q4" \
      bash bench/device_preload_ab.sh "$out"
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=300 SANITIZE="qwen3-next-4l-sm90-q4" E2E="qwen3-next-4l-sm90-q4" bash bench/device_preload_ab.sh "$out/e2e" ;;
  embnorm)  # embedding_rmsnorm (the gather and the first layer's norm in one program) against the step before it
    # (8d4bd78's compiler: git worktree add /tmp/base 8d4bd78), A B B A; 4 layers of 0.8B (q4) and 80B-A3B (q4)
    # against the CPU reference, compute-sanitizer on them and on 4 layers of 80B-A3B with K = 3 MTP drafts (the
    # drafts' embeddings take it too) (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-base 0.8b-bf16 0.8b-bf16-base
    # next80-q4 next80-q4-base small4-q4 next4-q4 next4-q4-spec3)
    STEP_TIMEOUT=100 PAIRS="qwen3.5-0.8b-sm90-q4-base:qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-bf16-base:qwen3.5-0.8b-sm90-bf16 qwen3-next-80b-a3b-sm90-q4-base:qwen3-next-80b-a3b-sm90-q4" \
      bash bench/device_preload_ab.sh "$out"
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=240 SANITIZE="qwen3.5-small4-sm90-q4 qwen3-next-4l-sm90-q4-spec3" E2E="qwen3.5-small4-sm90-q4 qwen3-next-4l-sm90-q4" \
      bash bench/device_preload_ab.sh "$out/e2e" ;;
  profile)  # llama.cpp built for the next part (kept in /tmp/llamacpp while the machine stays warm: run `next` right
    # after), and the 80B-A3B q4 plan's --profile (carry .peers and bench/plans; bash bench/build_stop_plans.sh next80-q4)
    timeout 330 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$out" > "$out/llamacpp-build.txt" 2>&1; echo "llama.cpp build: exit $?"
    p=qwen3-next-80b-a3b-sm90-q4
    timeout 150 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
      > "$out/profile-$p.txt" 2>&1; echo "profile: exit $?"; grep -A22 "^in the graph" "$out/profile-$p.txt" | head -24 ;;
  next)  # llama.cpp on the whole 80B-A3B shape (Q4_0, bench/llamacpp_next.sh) and Kestrel's 80B-A3B q4 at this stop's
    # rules in the same call (carry .peers: llamacpp.tar.xz and llamacpp-scripts, a copy of ../shared/peers/llamacpp;
    # bash bench/build_stop_plans.sh next80-q4), on the warm machine of `profile`
    PP=512 TG=128 REPS=3 CLEAN=1 timeout 420 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$out" qwen3-next-80b-a3b
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4" bash bench/device_preload_ab.sh "$out" ;;
  final)  # moe_topk's forms again with 8 warps added (carry bench/moe-sweep-topk, compiled as in `topk`), and the dense
    # q4 / bf16 plans at this stop's rules, A ... A (bash bench/build_stop_plans.sh 2b-q4 4b-q4 9b-q4 27b-q4 27b-bf16)
    (cd bench && timeout 120 python3 moe_sweep.py time moe-sweep-topk "$out/moe-sweep-topk.json" > "$out/moe-sweep-topk.txt" 2>&1)
    echo "sweep: exit $?"; grep "^topk" "$out/moe-sweep-topk.txt" | head -8
    STEP_TIMEOUT=150 SEQ="qwen3.5-2b-sm90-q4 qwen3.5-4b-sm90-q4 qwen3.5-9b-sm90-q4 qwen3.5-27b-sm90-q4 qwen3.5-27b-sm90-bf16" \
      bash bench/device_preload_ab.sh "$out" ;;
  dearly)  # moe.down_early (moe_down's routing and routed rows loaded before its PDL wait) against the rule, A B B A,
    # at 80B-A3B q4; 4 layers of it against the CPU reference, and under compute-sanitizer with K = 3 MTP drafts too
    # (bash bench/build_stop_plans.sh next80-q4 next80-q4-dearly next4-q4-dearly next4-q4-spec3-dearly)
    STEP_TIMEOUT=100 PAIRS="qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-sm90-q4-dearly" bash bench/device_preload_ab.sh "$out"
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=240 SANITIZE="qwen3-next-4l-sm90-q4-dearly qwen3-next-4l-sm90-q4-spec3-dearly" E2E="qwen3-next-4l-sm90-q4-dearly" \
      bash bench/device_preload_ab.sh "$out/e2e" ;;
  shared)  # moe_down's shared expert's words and scales loaded before its wait too (with down_early) against call 7's
    # rule (git worktree add /tmp/base aad81c4), A B B A; 4 layers of 80B-A3B against the CPU reference, and
    # compute-sanitizer with and without K = 3 MTP drafts. (The change, no faster, was not kept: its plans need
    # that uncommitted tree; the record is bench/results/stop41 call 8.)
    # (bash bench/build_stop_plans.sh next80-q4 next80-q4-base next4-q4 next4-q4-spec3)
    STEP_TIMEOUT=100 PAIRS="qwen3-next-80b-a3b-sm90-q4-base:qwen3-next-80b-a3b-sm90-q4" bash bench/device_preload_ab.sh "$out"
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=200 SANITIZE="qwen3-next-4l-sm90-q4 qwen3-next-4l-sm90-q4-spec3" E2E="qwen3-next-4l-sm90-q4" \
      bash bench/device_preload_ab.sh "$out/e2e" ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
