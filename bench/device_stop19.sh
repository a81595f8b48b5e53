#!/usr/bin/env bash
# Issue 13 on the GPU, one call (stop 19): programmatic dependent launch measured on whole plans, and the
# 27B figures stop 18 could not take. In order of priority (the tar in OUTDIR is rewritten after every
# step, so a call stopped at its limit still returns what ran):
#   1. 27B q4: --bench with the graph's programmatic edges (KESTREL_PDL=1; greedy, sampled, positions
#      4k / 32k / 128k) and without (KESTREL_PDL=0), --verify (graph vs streaming), --profile;
#   2. 0.8B bf16 and q4: --bench PDL on / off, --verify, --profile;
#   3. 27B bf16: --bench PDL on (positions) / off, --verify;
#   4. compute-sanitizer on the tiny M-row plans (PDL graphs, every sampling path);
#   5. the decode kernels against their references (bench/device_decode_kernels.py);
#   6. the q4 matvec sweep at the 0.8B / 9B / 27B decode shapes (bench/matvec_sweep.py, compiled into
#      bench/sweep-q4d here), its per-variant lines kept as they print.
#   bash bench/device_stop19.sh OUTDIR   (kestrel importable; bench/plans and bench/sweep-q4d carried)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
save() { tar -C "$w" -cf "$out/stop19.tar" .; echo "[$(( $(date +%s) - t0 )) s] $1"; }
run() {  # run NAME PLAN [extra --bench args]: bench PDL on / off, verify, profile
  local n=$1 p=bench/plans/$2.plan; shift 2
  KESTREL_PDL=1 kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 --bench "$w/bench-$n-pdl.json" "$@" 2>&1 | tail -5
  KESTREL_PDL=0 kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 --bench "$w/bench-$n-nopdl.json" 2>&1 | tail -3
  save "$n bench"
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 32 --verify --json > "$w/verify-$n.json" 2> "$w/verify-$n.err"
  echo "$n verify: $(cat "$w/verify-$n.json") $(tail -1 "$w/verify-$n.err")"
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 8 --profile "$w/profile-$n.json" > "$w/profile-$n.txt" 2>&1
  tail -8 "$w/profile-$n.txt"
  save "$n verify + profile"
}
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv,noheader
run 27b-q4 qwen3.5-27b-sm90-q4 --positions 4096,32768,131072
run 0.8b-bf16 qwen3.5-0.8b-sm90-bf16
run 0.8b-q4 qwen3.5-0.8b-sm90-q4
run 27b-bf16 qwen3.5-27b-sm90-bf16 --positions 4096,32768,131072
for q in bf16 q4; do
  p=bench/plans/tiny-sm90-$q-m8.plan
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py "$p" > "$w/sanitizer-tiny-$q-m8.txt" 2>&1
  echo "sanitizer tiny-$q-m8: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$w/sanitizer-tiny-$q-m8.txt") clean summaries)"
done
save sanitizer
python3 bench/device_decode_kernels.py "$w/decode-kernels.json" > "$w/decode-kernels.txt" 2>&1
grep -v -i warn "$w/decode-kernels.txt" | tail -24
save "decode kernels"
(cd bench && PYTHONUNBUFFERED=1 python3 matvec_sweep.py time sweep-q4d "$w/q4-decode-sweep.json") > "$w/q4-decode-sweep.txt" 2>&1
tail -60 "$w/q4-decode-sweep.txt"
save "q4 sweep"
