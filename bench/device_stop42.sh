#!/usr/bin/env bash
# Stop 42's device calls, one part a call (each under the 10-minute limit); everything under OUTDIR.
#   l2      moe_topk_l2's L2 hints (moe.topk_l2 = (128, level): the top-k run by 128 programs that ask the L2 for the
#           experts' gate / up (1), and their down (2), and the next layer's first matrix (3)) and the q4 matvecs'
#           first tile before the PDL wait (matvec.q4_preload_bytes 16 MiB), against the rule, at 80B-A3B q4, A B C D E
#           E D C B A; 4 layers of 80B-A3B q4 at level 3 against the CPU reference, and under compute-sanitizer with
#           K = 3 MTP drafts too (bash bench/build_stop_plans.sh next80-q4 next80-q4-l21 next80-q4-l22 next80-q4-l23
#           next80-q4-q4pre16 next4-q4-l23 next4-q4-spec3-l23)
#   q4pre   (below)
# There: run(carry=["bench/plans", ...]): bash bench/device_stop42.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  l2)
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-l21 qwen3-next-80b-a3b-sm90-q4-l22 qwen3-next-80b-a3b-sm90-q4-l23 qwen3-next-80b-a3b-sm90-q4-q4pre16" \
      SANITIZE="qwen3-next-4l-sm90-q4-spec3-l23" E2E="qwen3-next-4l-sm90-q4-l23" bash bench/device_preload_ab.sh "$out" ;;
  q4pre)  # matvec.q4_preload_bytes (the q4 matvecs' first weight tile loaded before the PDL wait) at 16 MiB against
    # the rule (0: none) at 80B-A3B q4, 0.8B and 2B q4, A B B A; 4 layers of 80B-A3B and of the 0.8B shape with it
    # against the CPU reference and under compute-sanitizer (bash bench/build_stop_plans.sh next80-q4 next80-q4-q4pre16
    # 0.8b-q4 0.8b-q4-q4pre16 2b-q4 2b-q4-q4pre16 next4-q4-q4pre16 small4-q4-q4pre16: the working tree and the carried
    # plans stay under 64 MiB, so 4B-27B are q4pre2's)
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-q4pre16" \
      PAIRS="qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-q4pre16 qwen3.5-2b-sm90-q4:qwen3.5-2b-sm90-q4-q4pre16" \
      bash bench/device_preload_ab.sh "$out"
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=300 SANITIZE="qwen3.5-small4-sm90-q4-q4pre16 qwen3-next-4l-sm90-q4-q4pre16" E2E="qwen3.5-small4-sm90-q4-q4pre16 qwen3-next-4l-sm90-q4-q4pre16" \
      bash bench/device_preload_ab.sh "$out/e2e" ;;
  q4pre2) # the same pairs at 4B, 9B, 27B q4 (bash bench/build_stop_plans.sh 4b-q4 4b-q4-q4pre16 9b-q4 9b-q4-q4pre16
    # 27b-q4 27b-q4-q4pre16)
    STEP_TIMEOUT=150 PAIRS="qwen3.5-4b-sm90-q4:qwen3.5-4b-sm90-q4-q4pre16 qwen3.5-9b-sm90-q4:qwen3.5-9b-sm90-q4-q4pre16 qwen3.5-27b-sm90-q4:qwen3.5-27b-sm90-q4-q4pre16" \
      bash bench/device_preload_ab.sh "$out" ;;
  pre)  # matvec.q4_preload_after (the q4 matvecs of the one-token step load their first tile before the PDL wait right
    # after an op of these kinds, compiler/codegen.py): after moe_down_add (A: the layers' input projections at
    # 80B-A3B), after gdn_norm / attn_step (B: the mixers' output projections), both (AB), against the rule (none):
    # 80B-A3B q4 A B C D D C B A; 0.8B and 2B q4 with B, A B B A (bash bench/build_stop_plans.sh next80-q4
    # next80-q4-preA next80-q4-preB next80-q4-preAB 0.8b-q4 0.8b-q4-preB 2b-q4 2b-q4-preB)
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-preA qwen3-next-80b-a3b-sm90-q4-preB qwen3-next-80b-a3b-sm90-q4-preAB" \
      PAIRS="qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-preB qwen3.5-2b-sm90-q4:qwen3.5-2b-sm90-q4-preB" \
      bash bench/device_preload_ab.sh "$out" ;;
  pre2)  # matvec.q4_preload_after = B (after gdn_norm / attn_step) at 4B, 9B, 27B q4 against none, A B B A; 80B-A3B
    # q4 at the rule (after all three, from 1.5 MiB: call 3's AB) against none (bash bench/build_stop_plans.sh 4b-q4-pre0
    # 4b-q4-preB 9b-q4-pre0 9b-q4-preB 27b-q4-pre0 27b-q4-preB next80-q4 next80-q4-pre0)
    STEP_TIMEOUT=150 PAIRS="qwen3.5-4b-sm90-q4-pre0:qwen3.5-4b-sm90-q4-preB qwen3.5-9b-sm90-q4-pre0:qwen3.5-9b-sm90-q4-preB qwen3.5-27b-sm90-q4-pre0:qwen3.5-27b-sm90-q4-preB qwen3-next-80b-a3b-sm90-q4-pre0:qwen3-next-80b-a3b-sm90-q4" \
      bash bench/device_preload_ab.sh "$out" ;;
  final)  # the rule (matvec.q4_preload_after) on 4 layers of 80B-A3B q4 and of the 2B shape (whose output projections
    # take it) against the CPU reference and under compute-sanitizer (80B-A3B with K = 3 MTP drafts); the verify's
    # row 0 against the one-token step op by op (bench/device_row_diff.py) on 4 layers of 80B-A3B q4 / bf16 with
    # K = 3 drafts; the 80B-A3B q4 --profile (bash bench/build_stop_plans.sh next4-q4 next4-q4-spec3 next4-bf16-spec3
    # small2b4-q4 next80-q4)
    timeout 200 python3 bench/device_row_diff.py "$out/row-diff.json" bench/plans/qwen3-next-4l-sm90-q4-spec3.plan \
      bench/plans/qwen3-next-4l-sm90-bf16-spec3.plan > "$out/row-diff.txt" 2>&1
    echo "row diff: exit $?"; grep -E "outputs compared|^  " "$out/row-diff.txt" | head -20
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    p=qwen3-next-80b-a3b-sm90-q4
    timeout 150 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
      > "$out/profile-$p.txt" 2>&1; echo "profile: exit $?"; grep -A22 "^in the graph" "$out/profile-$p.txt" | head -24
    STEP_TIMEOUT=300 SANITIZE="qwen3.5-small2b4-sm90-q4 qwen3-next-4l-sm90-q4-spec3" E2E="qwen3.5-small2b4-sm90-q4 qwen3-next-4l-sm90-q4" \
      bash bench/device_preload_ab.sh "$out" ;;
  wk)  # (commit 192dc67, which had the field) matvec.q4_preload_whole_k = 4096 (the preloading q4 matvecs with K a power of two up to 4096 take all of K in
    # their first tile, so every weight byte of a program is loaded before its wait) against the rule, A B B A, at
    # 80B-A3B, 2B, 4B q4; 4 layers of the 2B shape with it against the CPU reference, compute-sanitizer (bash
    # bench/build_stop_plans.sh next80-q4 next80-q4-wk4096 2b-q4 2b-q4-wk4096 4b-q4 4b-q4-wk4096 small2b4-q4-wk4096)
    STEP_TIMEOUT=100 PAIRS="qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-sm90-q4-wk4096 qwen3.5-2b-sm90-q4:qwen3.5-2b-sm90-q4-wk4096 qwen3.5-4b-sm90-q4:qwen3.5-4b-sm90-q4-wk4096" \
      SANITIZE="qwen3.5-small2b4-sm90-q4-wk4096" E2E="qwen3.5-small2b4-sm90-q4-wk4096" bash bench/device_preload_ab.sh "$out" ;;
  pf)  # (prepared, not run: no machine was lent for it in stop 42) the output projections that preload (80B-A3B's 4 MiB, 2B's 2 MiB) without the L2 prefetch of their rows as
    # well (matvec.l2_prefetch_bytes = 1 MiB: the 0.8B's smaller matrices only), A B B A (bash bench/build_stop_plans.sh
    # next80-q4 next80-q4-pf1 2b-q4 2b-q4-pf1)
    STEP_TIMEOUT=60 PAIRS="qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-sm90-q4-pf1 qwen3.5-2b-sm90-q4:qwen3.5-2b-sm90-q4-pf1" \
      bash bench/device_preload_ab.sh "$out" ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
