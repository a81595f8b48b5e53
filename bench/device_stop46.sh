#!/usr/bin/env bash
# Stop 46's device calls, one part a call (each under the 10-minute limit); everything under OUTDIR.
#   ab      (run at commit 4ecc22c, whose compiler and build_stop_plans.sh made its plans: the fused router is gone)
#           the one-token router and its top-k in one launch (moe.router_topk, passes/fuse_router.py; -rt4: 4 router
#           rows a program, 128 programs drawing tickets instead of 512) and stop 43's one-tile q4 loads together
#           (matvec.q4_one_tile_together, -tog, never timed alone at 80B-A3B) against the rule: 80B-A3B q4 A B C D E E D C
#           B A, 35B-A3B q4 A B B A; compute-sanitizer on 4 layers of 80B-A3B with both forms (bash
#           bench/build_stop_plans.sh next80-q4 next80-q4-rt next80-q4-rt4 next80-q4-tog next80-q4-rt+tog 35b-q4
#           35b-q4-rt next4-q4-rt+tog small4-q4-tog small2b4-q4-tog: ~21 MB of plans); then against the CPU
#           reference: those 4 layers, and 4 layers of the 0.8B and 2B shapes with the one-tile loads together
#   rule    every kernel's preferred shared-memory carveout at 100% against the driver's choice at 80B-A3B q4
#           (bench/device_carveout_ab.sh, stop 30's A B B A: measured at 0.8B and 27B in stops 19 and 30, mixed, never at
#           80B-A3B, where attn_step's 158 KiB CTAs among kernels of at most 17 KiB cost 11 us a layer in the graph
#           against 8-9 us alone); then the one-tile loads together, now in the rule, against them off (-notog):
#           35B-A3B q4 (never timed with them), compute-sanitizer on 4 layers of the 0.8B shape and 4 layers of the
#           35B-A3B shape against the CPU reference at the rule, 0.8B and 2B q4, A B B A each; last, gdn_norm's warps 1
#           and 2 against the rule's 4 at 80B-A3B q4 (stop 44's gnw), A B C C B A (bash bench/build_stop_plans.sh
#           35b-q4 35b-q4-notog 0.8b-q4 0.8b-q4-notog 2b-q4 2b-q4-notog small4-q4 moe35x4-q4 next80-q4 next80-q4-gnw1
#           next80-q4-gnw2: ~21 MB)
# There: run(carry=["bench/plans"]): bash bench/device_stop46.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  ab)
    mkdir -p "$out/next" "$out/35b"
    STEP_TIMEOUT=100 SANITIZE="qwen3-next-4l-sm90-q4-rt+tog" \
      SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-rt qwen3-next-80b-a3b-sm90-q4-rt4 qwen3-next-80b-a3b-sm90-q4-tog qwen3-next-80b-a3b-sm90-q4-rt+tog" \
      bash bench/device_preload_ab.sh "$out/next"
    STEP_TIMEOUT=100 PAIRS="qwen3.5-35b-a3b-sm90-q4:qwen3.5-35b-a3b-sm90-q4-rt" bash bench/device_preload_ab.sh "$out/35b"
    mkdir -p "$out/e2e"  # (last: what a 600 s limit would cut) both forms against the CPU reference
    STEP_TIMEOUT=200 E2E="qwen3-next-4l-sm90-q4-rt+tog qwen3.5-small4-sm90-q4-tog qwen3.5-small2b4-sm90-q4-tog" \
      bash bench/device_preload_ab.sh "$out/e2e" ;;
  rule)  # (most wanted first: a call may be cut short)
    mkdir -p "$out/carve"
    PLANS="qwen3-next-80b-a3b-sm90-q4" CARVEOUT=100 bash bench/device_carveout_ab.sh "$out/carve"
    mkdir -p "$out/35b" "$out/checks" "$out/dense"
    STEP_TIMEOUT=100 PAIRS="qwen3.5-35b-a3b-sm90-q4-notog:qwen3.5-35b-a3b-sm90-q4" bash bench/device_preload_ab.sh "$out/35b"
    STEP_TIMEOUT=100 SANITIZE="qwen3.5-small4-sm90-q4" E2E="qwen3.5-moe35-4l-sm90-q4" bash bench/device_preload_ab.sh "$out/checks"
    STEP_TIMEOUT=100 PAIRS="qwen3.5-0.8b-sm90-q4-notog:qwen3.5-0.8b-sm90-q4 qwen3.5-2b-sm90-q4-notog:qwen3.5-2b-sm90-q4" \
      bash bench/device_preload_ab.sh "$out/dense"
    mkdir -p "$out/gnw"  # stop 44's gdn_norm warps (device_stop43.sh gnw's A/B, at this rule), where plans were carried
    [ -e bench/plans/qwen3-next-80b-a3b-sm90-q4-gnw1.plan ] && STEP_TIMEOUT=100 \
      SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-gnw1 qwen3-next-80b-a3b-sm90-q4-gnw2" \
      bash bench/device_preload_ab.sh "$out/gnw" ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
