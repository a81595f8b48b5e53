#!/usr/bin/env bash
# One device call: Kestrel's M-row prefill beside llama.cpp's prompt processing (pp) at the same shapes.
# llama.cpp is built first in the background at the lowest CPU priority (CPU-only compile) while
# Kestrel's plans run on the GPU: bench/device_prefill.py on the 0.8B and 27B plans, `kestrel-run
# --verify` and `--bench --prompt-lengths` on the 0.8B bf16 plan; then llama-bench pp512/pp2048 (GPU
# otherwise idle) on 0.8B bf16 and Q4_0. Everything lands in OUTDIR/peer.tar.
#   bash bench/device_prefill_peer.sh OUTDIR   (kestrel importable; bench/plans and .peers carried:
#   .peers/llamacpp.tar.xz from ../shared/peers/llamacpp/fetch.sh, .peers/llamacpp-scripts a copy of that folder)
set -u
out=$1; w=${WORK:-/tmp/kestrel-peer}; mkdir -p "$w"; here=../shared/peers/llamacpp
[ -f "$here/device.sh" ] || here=.peers/llamacpp-scripts  # a copy of ../shared/peers/llamacpp, carried
nice -n 19 bash "$here/device.sh" .peers/llamacpp.tar.xz "$w" > "$w/llamacpp-build.txt" 2>&1 &
build=$!
run() { python3 -c "import sys; from kestrel.runtime.cli import main; sys.argv = ['kestrel-run'] + sys.argv[1:]; main()" "$@"; }
CPU_MAX_BYTES=0 ONE_TOKEN_MAX=512 ROUNDS=3 python3 bench/device_prefill.py "$w/prefill-final.json" \
  bench/plans/qwen3.5-0.8b-sm90-bf16.plan bench/plans/qwen3.5-0.8b-sm90-q4.plan \
  bench/plans/qwen3.5-27b-sm90-q4.plan bench/plans/qwen3.5-27b-sm90-bf16.plan | tail -12
p=bench/plans/qwen3.5-0.8b-sm90-bf16.plan
run "$p" --prompt-ids 1,2,3,4,5,6,7,8,9,10 --max-new-tokens 32 --verify | tee "$w/verify-0.8b-bf16.txt"
run "$p" --prompt-ids 1,2,3,4,5,6,7,8,9,10 --max-new-tokens 32 --bench "$w/bench-0.8b-bf16.json" \
  --prompt-lengths 512,2048 2>&1 | tail -4
wait $build; tail -2 "$w/llamacpp-build.txt"
PP=512,2048 TG=32 REPS=3 bash "$here/device.sh" .peers/llamacpp.tar.xz "$w" qwen3.5-0.8b:bf16 qwen3.5-0.8b:q4_0
tar -C "$w" -cf "$out/peer.tar" .
