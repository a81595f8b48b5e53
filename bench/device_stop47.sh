#!/usr/bin/env bash
# Stop 47's device calls (prepared: no device was lent in stop 47), one part a call; everything under OUTDIR.
#   yarn    YaRN RoPE on the GPU (rope_type yarn, Qwen's settings: factor 4 over 262,144 positions): compute-sanitizer
#           on 4 layers of the 80B-A3B shape in q4 with them; those 4 layers in bf16 and q4 against the CPU reference
#           (greedy tokens, graph == streaming, dump bytes; the 14-token prompt through the 8-row M-row step); then the
#           whole 80B-A3B q4 at --max-seq 1048576 (67.5 GB arena) against the rule's plan at 4096 positions, A B B A
#           (the YaRN constants are compile-time: decode should cost the same), and decode from positions 262,144
#           and 1,048,000 (KV rows read but not prefilled)
#           (bash bench/build_stop_plans.sh next4-yarn-bf16 next4-yarn-q4 next80-q4 next80-q4-yarn1m: ~7 MB)
#   gfold   gdn_norm folded into the output projection (rule gdn_norm.fold, gdn_norm_matmul_add: a launch a Gated
#           DeltaNet layer fewer) against the rule: 0.8B and 2B q4 A B B A; 80B-A3B q4 with it, and with the fused
#           projection's first tile loaded before its wait after gdn_delta too (gfoldpre), A B C C B A; compute-
#           sanitizer on 4 layers of the 0.8B shape with it; those and 4 layers of 80B-A3B against the CPU reference
#           (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-gfold 2b-q4 2b-q4-gfold next80-q4 next80-q4-gfold
#           next80-q4-gfoldpre small4-q4-gfold next4-q4-gfold: ~15 MB)
# There: run(carry=["bench/plans"]): bash bench/device_stop47.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  yarn)
    mkdir -p "$out/checks" "$out/ab"
    STEP_TIMEOUT=150 SANITIZE="qwen3-next-4l-yarn-sm90-q4" E2E="qwen3-next-4l-yarn-sm90-bf16 qwen3-next-4l-yarn-sm90-q4" \
      bash bench/device_preload_ab.sh "$out/checks"
    STEP_TIMEOUT=120 PAIRS="qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-yarn1m-sm90-q4" \
      bash bench/device_preload_ab.sh "$out/ab"
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    timeout 200 kestrel-run bench/plans/qwen3-next-80b-a3b-yarn1m-sm90-q4.plan --prompt-ids "$ids" --max-new-tokens 32 \
      --rounds 3 --positions 262144,1048000 --bench "$out/long.json" > "$out/long.txt" 2>&1
    echo "long positions: exit $?"; grep -E "^position|ms/token" "$out/long.txt" | head -8 ;;
  gfold)  # (most wanted first: a call may be cut short)
    mkdir -p "$out/dense" "$out/next" "$out/checks"
    STEP_TIMEOUT=100 PAIRS="qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-gfold qwen3.5-2b-sm90-q4:qwen3.5-2b-sm90-q4-gfold" \
      bash bench/device_preload_ab.sh "$out/dense"
    STEP_TIMEOUT=100 SANITIZE="qwen3.5-small4-sm90-q4-gfold" \
      E2E="qwen3.5-small4-sm90-q4-gfold qwen3-next-4l-sm90-q4-gfold" bash bench/device_preload_ab.sh "$out/checks"
    STEP_TIMEOUT=100 \
      SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-gfold qwen3-next-80b-a3b-sm90-q4-gfoldpre" \
      bash bench/device_preload_ab.sh "$out/next" ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
