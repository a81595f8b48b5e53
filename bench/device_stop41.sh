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
  *) echo "unknown part $2"; exit 2 ;;
esac
