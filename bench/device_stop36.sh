#!/usr/bin/env bash
# Prepared in stop 35 for the next device call (under the 10-minute limit):
#   diff     which ops of the 80B-A3B shape's speculative verify compute row 0 differently from the one-token step
#            (stop 35: the 80B-A3B q4 K = 3 plan is not exact): bench/device_row_diff.py on the 4-layer q4 and bf16
#            K = 3 plans (bash bench/build_stop_plans.sh next4-q4-spec3 next4-bf16-spec3)
#   norm     the normed q4 matvec's many-rows split (matvec.q4_wide_norm_block_n / _warps): stop 35 call 11 measured
#            32 rows x 2 warps 7% faster than the rule's 16 x 1 alone at the 27B in_proj and attention shapes; here
#            the whole 27B q4 step, the rule's plan against `27b-q4-norm32`, A B B A (kestrel-run --bench).
#   spec80   the same diff after this stop's unfold of the MoE chains at one row (passes/fold_row_norms.py), then
#            bench/device_spec_exactness.py and device_spec.py on the 80B-A3B q4 and 0.8B bf16 K = 3 plans
#            (bash bench/build_stop_plans.sh next4-q4-spec3 next4-bf16-spec3 next80-q4-spec3 0.8b-bf16-spec3)
# Here:  bash bench/build_stop_plans.sh 27b-q4 27b-q4-norm32
# There: run(carry=["bench/plans"]): bash bench/device_stop36.sh $OUT norm
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  norm)
    STEP_TIMEOUT=150 PAIRS="qwen3.5-27b-sm90-q4:qwen3.5-27b-sm90-q4-norm32" bash bench/device_preload_ab.sh "$out" ;;
  spec80)  # after the MoE chains' unfold (passes/fold_row_norms.py): row diff, 80B-A3B q4 K = 3 exactness and speed
    python3 bench/device_row_diff.py "$out/row-diff-next4.json" bench/plans/qwen3-next-4l-sm90-q4-spec3.plan \
      bench/plans/qwen3-next-4l-sm90-bf16-spec3.plan 2>&1 | tail -30
    timeout 240 python3 bench/device_spec_exactness.py "$out/exactness.json" \
      bench/plans/qwen3-next-80b-a3b-sm90-q4-spec3.plan bench/plans/qwen3.5-0.8b-sm90-bf16-spec3.plan 2>&1 | tail -8
    for p in qwen3-next-80b-a3b-sm90-q4-spec3 qwen3.5-0.8b-sm90-bf16-spec3; do
      timeout 150 python3 bench/device_spec.py "$out/spec-$p.json" "bench/plans/$p.plan" > "$out/spec-$p.txt" 2>&1
      echo "$p: exit $?"; grep -E "spec==plain|verify at|as graphs|^ +[01]\.[0-9]  " "$out/spec-$p.txt"
    done ;;
  diff)
    python3 bench/device_row_diff.py "$out/row-diff-next4.json" bench/plans/qwen3-next-4l-sm90-q4-spec3.plan \
      bench/plans/qwen3-next-4l-sm90-bf16-spec3.plan 2>&1 | tail -40 ;;
esac
