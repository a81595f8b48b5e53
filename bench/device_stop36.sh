#!/usr/bin/env bash
# Prepared in stop 35 for the next device call (under the 10-minute limit):
#   norm     the normed q4 matvec's many-rows split (matvec.q4_wide_norm_block_n / _warps): stop 35 call 11 measured
#            32 rows x 2 warps 7% faster than the rule's 16 x 1 alone at the 27B in_proj and attention shapes; here
#            the whole 27B q4 step, the rule's plan against `27b-q4-norm32`, A B B A (kestrel-run --bench).
# Here:  bash bench/build_stop_plans.sh 27b-q4 27b-q4-norm32
# There: run(carry=["bench/plans"]): bash bench/device_stop36.sh $OUT norm
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  norm)
    STEP_TIMEOUT=150 PAIRS="qwen3.5-27b-sm90-q4:qwen3.5-27b-sm90-q4-norm32" bash bench/device_preload_ab.sh "$out" ;;
esac
