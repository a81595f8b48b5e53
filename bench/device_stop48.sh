#!/usr/bin/env bash
# Stop 48's device call, prepared (under the 10-minute limit; most wanted first: a call may be cut
# short, and every step leaves its tar under OUTDIR as it ends); everything under OUTDIR.
#   first   stop 47's gfold and yarn and stop 46's carveout in one call (no device was lent in stop 48):
#           80B-A3B q4 rule / gdn_norm folded into out_proj (gfold) / with its first tile before the wait (gfoldpre),
#           A B C C B A; every kernel's shared-memory carveout at 100% against the driver's choice at 80B-A3B q4,
#           A B B A; compute-sanitizer on 4 layers of the 0.8B shape with gfold, those and 4 layers of 80B-A3B with it
#           against the CPU reference; the 1M-position YaRN plan's decode from positions 262,144 and 1,048,000; 0.8B
#           and 2B q4 rule against gfold, A B B A; YaRN's checks (compute-sanitizer on 4 layers of 80B-A3B in q4 with
#           it, those in bf16 and q4 against the CPU reference); the 1M-position plan against the rule's, A B B A
#           (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-gfold 2b-q4 2b-q4-gfold next80-q4 next80-q4-gfold
#           next80-q4-gfoldpre small4-q4-gfold next4-q4-gfold next4-yarn-bf16 next4-yarn-q4 next80-q4-yarn1m: 21.4 MB,
#           with the 42.4 MB tree under the 64 MiB a call carries)
# There: run(carry=["bench/plans"]): bash bench/device_stop48.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  first)
    mkdir -p "$out/next" "$out/carve" "$out/checks" "$out/dense" "$out/yarn" "$out/yarnab"
    STEP_TIMEOUT=100 \
      SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-gfold qwen3-next-80b-a3b-sm90-q4-gfoldpre" \
      bash bench/device_preload_ab.sh "$out/next"
    PLANS="qwen3-next-80b-a3b-sm90-q4" CARVEOUT=100 bash bench/device_carveout_ab.sh "$out/carve"
    STEP_TIMEOUT=100 SANITIZE="qwen3.5-small4-sm90-q4-gfold" \
      E2E="qwen3.5-small4-sm90-q4-gfold qwen3-next-4l-sm90-q4-gfold" bash bench/device_preload_ab.sh "$out/checks"
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    timeout 200 kestrel-run bench/plans/qwen3-next-80b-a3b-yarn1m-sm90-q4.plan --prompt-ids "$ids" --max-new-tokens 32 \
      --rounds 3 --positions 262144,1048000 --bench "$out/yarn/long.json" > "$out/yarn/long.txt" 2>&1
    echo "long positions: exit $?"; grep -E "^position|ms/token" "$out/yarn/long.txt" | head -8
    STEP_TIMEOUT=100 PAIRS="qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-gfold qwen3.5-2b-sm90-q4:qwen3.5-2b-sm90-q4-gfold" \
      bash bench/device_preload_ab.sh "$out/dense"
    STEP_TIMEOUT=150 SANITIZE="qwen3-next-4l-yarn-sm90-q4" E2E="qwen3-next-4l-yarn-sm90-bf16 qwen3-next-4l-yarn-sm90-q4" \
      bash bench/device_preload_ab.sh "$out/yarn"
    STEP_TIMEOUT=120 PAIRS="qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-yarn1m-sm90-q4" \
      bash bench/device_preload_ab.sh "$out/yarnab" ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
