#!/usr/bin/env bash
# Stop 48's device calls, one part a call (each under the 10-minute limit; most wanted first: a call may be cut
# short, and every step leaves its tar under OUTDIR as it ends); everything under OUTDIR.
#   first   stop 47's gfold and stop 46's carveout in one call (the device refused starts for the first half hour):
#           80B-A3B q4 rule / gdn_norm folded into out_proj (gfold) / with its first tile before the wait (gfoldpre),
#           A B C C B A; every kernel's shared-memory carveout at 100% against the driver's choice at 80B-A3B q4,
#           A B B A; 0.8B and 2B q4 rule against gfold, A B B A; compute-sanitizer on 4 layers of the 0.8B shape with
#           gfold, and those and 4 layers of 80B-A3B with it against the CPU reference
#           (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-gfold 2b-q4 2b-q4-gfold next80-q4 next80-q4-gfold
#           next80-q4-gfoldpre small4-q4-gfold next4-q4-gfold: ~16 MB)
#   yarn    = device_stop47.sh yarn
# There: run(carry=["bench/plans"]): bash bench/device_stop48.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  first)
    mkdir -p "$out/next" "$out/carve" "$out/dense" "$out/checks"
    STEP_TIMEOUT=100 \
      SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-gfold qwen3-next-80b-a3b-sm90-q4-gfoldpre" \
      bash bench/device_preload_ab.sh "$out/next"
    PLANS="qwen3-next-80b-a3b-sm90-q4" CARVEOUT=100 bash bench/device_carveout_ab.sh "$out/carve"
    STEP_TIMEOUT=100 PAIRS="qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-gfold qwen3.5-2b-sm90-q4:qwen3.5-2b-sm90-q4-gfold" \
      bash bench/device_preload_ab.sh "$out/dense"
    STEP_TIMEOUT=100 SANITIZE="qwen3.5-small4-sm90-q4-gfold" \
      E2E="qwen3.5-small4-sm90-q4-gfold qwen3-next-4l-sm90-q4-gfold" bash bench/device_preload_ab.sh "$out/checks" ;;
  yarn) bash bench/device_stop47.sh "$out" yarn ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
