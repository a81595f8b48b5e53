#!/usr/bin/env bash
# The second call of stop 18: llama.cpp built in the background (CPU only, lowest priority) while the
# GPU runs compute-sanitizer on the tiny M-row plans (every sampling path; bench/device_sanitize.py)
# and Kestrel's --bench on the 0.8B plans (greedy and Qwen-sampled decode, the honest roofline); then
# llama-bench pp512 / tg128 on 0.8B bf16 and Q4_0 (GPU otherwise idle). Results in OUTDIR/peer18.tar.
#   bash bench/device_stop18_peer.sh OUTDIR   (kestrel importable; bench/plans and .peers carried)
set -u
out=$1; w=/tmp/kestrel-peer18; mkdir -p "$w"; here=../shared/peers/llamacpp
[ -f "$here/device.sh" ] || here=.peers/llamacpp-scripts
nice -n 19 bash "$here/device.sh" .peers/llamacpp.tar.xz "$w" > "$w/llamacpp-build.txt" 2>&1 &
build=$!
for q in bf16 q4; do
  p=bench/plans/tiny-sm90-$q-m8.plan
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py "$p" > "$w/sanitizer-tiny-$q-m8.txt" 2>&1
  echo "sanitizer tiny-$q-m8: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$w/sanitizer-tiny-$q-m8.txt") clean summaries)"
done
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
for q in bf16 q4; do
  kestrel-run bench/plans/qwen3.5-0.8b-sm90-$q.plan --prompt-ids "$ids" --max-new-tokens 128 \
    --bench "$w/bench-0.8b-$q-tg128.json" 2>&1 | tail -3
done
wait $build; tail -2 "$w/llamacpp-build.txt"
PP=512 TG=128 REPS=3 bash "$here/device.sh" .peers/llamacpp.tar.xz "$w" qwen3.5-0.8b:bf16 qwen3.5-0.8b:q4_0
tar -C "$w" -cf "$out/peer18.tar" .
