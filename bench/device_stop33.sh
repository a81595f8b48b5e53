#!/usr/bin/env bash
# Stop 33's checks after the random-weights fill change (kernels/fill.py: each q4 weight's scales refilled, so
# 27B-width q4 plans are finite; before it their logits were NaN on the GPU and the CPU reference alike):
#   1. 4 layers of the 27B shape, q4: the GPU against the CPU reference (8 new tokens), graph == streaming;
#   2. the same shape with --speculative mtp --draft-tokens 3: speculative == plain greedy tokens on the GPU, the
#      controlled-acceptance table and sampled speculation (bench/device_spec.py);
#   3. 27B q4 and 0.8B q4 ms/token, greedy and sampled, on finite logits (A B B A).
# Here:  bash bench/build_stop_plans.sh 27b4-q4 27b4-q4-spec3 0.8b-q4 27b-q4
# There: run(carry=["bench/plans"]): bash bench/device_stop33.sh $OUT
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
timeout 200 python3 bench/device_spec.py "$out/spec-27b4-q4.json" bench/plans/qwen3.5-27b-4l-sm90-q4-spec3.plan \
  > "$out/spec-27b4-q4.txt" 2>&1
echo "spec: exit $?"; tail -25 "$out/spec-27b4-q4.txt"
KESTREL_E2E_NEW=8 STEP_TIMEOUT=240 SEQ="qwen3.5-27b-sm90-q4 qwen3.5-0.8b-sm90-q4" E2E="qwen3.5-27b-4l-sm90-q4" \
  bash bench/device_preload_ab.sh "$out"
