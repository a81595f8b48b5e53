#!/usr/bin/env bash
# Issue 13 on the GPU, one call: the decode kernels at the real shapes (bench/device_decode_kernels.py),
# then per plan in bench/plans matching NAME_GLOBs: --verify (graph vs streaming, both programs),
# --bench (greedy and sampled ms/token, the honest roofline; 27B: long-context positions), --profile;
# compute-sanitizer on the tiny M-row plans (every sampling path). Results in OUTDIR/stop18.tar.
#   bash bench/device_stop18.sh OUTDIR NAME_GLOB...   (kestrel importable; bench/plans carried)
set -u
out=$1; w=$(mktemp -d)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
python3 bench/device_decode_kernels.py "$w/decode-kernels.json" 2>&1 | grep -v -i warn
for g in "${@:2}"; do for p in bench/plans/$g.plan; do
  [ -f "$p" ] || continue
  n=$(basename "$p" .plan)
  extra=""; case $n in *27b*) extra="--positions 4096,32768,131072";; esac
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 32 --verify --json > "$w/verify-$n.json" 2> "$w/verify-$n.err"
  echo "$n verify: $(cat "$w/verify-$n.json") $(tail -1 "$w/verify-$n.err")"
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 --bench "$w/bench-$n.json" $extra 2>&1 | tail -4
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 8 --profile "$w/profile-$n.json" > "$w/profile-$n.txt" 2>&1
  tail -14 "$w/profile-$n.txt"
done; done
if [ "${SANITIZE:-0}" = 1 ]; then  # (stop 18 ran it in the second call: device_stop18_peer.sh)
  for q in bf16 q4; do
    p=bench/plans/tiny-sm90-$q-m8.plan
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py "$p" > "$w/sanitizer-tiny-$q-m8.txt" 2>&1
    echo "sanitizer tiny-$q-m8: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$w/sanitizer-tiny-$q-m8.txt") clean summaries)"
  done
fi
tar -C "$w" -cf "$out/stop18.tar" .
