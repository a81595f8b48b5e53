#!/usr/bin/env bash
# Issue 13 on the GPU, one call (stop 19): the whole-plan report with llama.cpp beside it. llama.cpp is
# built in the background first (lowest priority: about 4 minutes, GPU idle); meanwhile, in order (the
# tar in OUTDIR is rewritten after every step, so a call stopped at its limit still returns what ran):
#   1. per plan (27B q4, 0.8B bf16, 0.8B q4, 27B bf16): --bench as built (the launch plan's PDL choice;
#      greedy and sampled; 27B also at positions 4k / 32k / 128k), then with the graph's programmatic
#      edges forced on (KESTREL_PDL=1) and off (0), --verify (graph vs streaming, byte for byte), --profile;
#   2. compute-sanitizer on the tiny M-row plans (PDL graphs, every sampling path);
#   3. KERNELS=1: the decode kernels against their references (bench/device_decode_kernels.py);
#   4. SWEEP=1: the q4 matvec sweep (bench/matvec_sweep.py, compiled into bench/sweep-q4d here);
#   5. PEER=1: llama-bench pp512 / tg128 on 0.8B bf16 and Q4_0 (GPU otherwise idle).
#   bash bench/device_stop19.sh OUTDIR   (kestrel importable; bench/plans, .peers carried; bench/sweep-q4d
#                                          for SWEEP=1)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
save() { tar -C "$w" -cf "$out/stop19.tar" .; echo "[$(( $(date +%s) - t0 )) s] $1"; }
run() {  # run NAME PLAN [extra --bench args]: bench PDL on / off, verify, profile
  local n=$1 p=bench/plans/$2.plan; shift 2
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 --bench "$w/bench-$n.json" "$@" 2>&1 | tail -5
  KESTREL_PDL=1 kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 --bench "$w/bench-$n-pdl.json" 2>&1 | tail -3
  KESTREL_PDL=0 kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 --bench "$w/bench-$n-nopdl.json" 2>&1 | tail -3
  save "$n bench"
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 32 --verify --json > "$w/verify-$n.json" 2> "$w/verify-$n.err"
  echo "$n verify: $(cat "$w/verify-$n.json") $(tail -1 "$w/verify-$n.err")"
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 8 --profile "$w/profile-$n.json" > "$w/profile-$n.txt" 2>&1
  tail -8 "$w/profile-$n.txt"
  save "$n verify + profile"
}
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv,noheader
peer=/tmp/kestrel-peer19; mkdir -p "$peer"; here=.peers/llamacpp-scripts
if [ "${PEER:-0}" = 1 ]; then
  nice -n 19 bash "$here/device.sh" .peers/llamacpp.tar.xz "$peer" > "$w/llamacpp-build.txt" 2>&1 &
  build=$!
fi
run 27b-q4 qwen3.5-27b-sm90-q4 --positions 4096,32768,131072 --prompt-lengths 2048
run 0.8b-bf16 qwen3.5-0.8b-sm90-bf16 --prompt-lengths 2048
run 0.8b-q4 qwen3.5-0.8b-sm90-q4
run 27b-bf16 qwen3.5-27b-sm90-bf16 --positions 4096,32768,131072
for q in bf16 q4; do
  p=bench/plans/tiny-sm90-$q-m8.plan
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py "$p" > "$w/sanitizer-tiny-$q-m8.txt" 2>&1
  echo "sanitizer tiny-$q-m8: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$w/sanitizer-tiny-$q-m8.txt") clean summaries)"
done
save sanitizer
if [ "${KERNELS:-0}" = 1 ]; then
  python3 bench/device_decode_kernels.py "$w/decode-kernels.json" > "$w/decode-kernels.txt" 2>&1
  grep -v -i warn "$w/decode-kernels.txt" | tail -12
  save "decode kernels"
fi
if [ "${SWEEP:-0}" = 1 ]; then
  (cd bench && PYTHONUNBUFFERED=1 python3 matvec_sweep.py time sweep-q4d "$w/q4-decode-sweep.json") > "$w/q4-decode-sweep.txt" 2>&1
  tail -60 "$w/q4-decode-sweep.txt"
  save "q4 sweep"
fi
if [ "${PEER:-0}" = 1 ]; then
  wait $build; tail -2 "$w/llamacpp-build.txt"
  PP=512 TG=128 REPS=3 bash "$here/device.sh" .peers/llamacpp.tar.xz "$peer" qwen3.5-0.8b:bf16 qwen3.5-0.8b:q4_0 \
    > "$w/llamacpp-bench.txt" 2>&1
  tail -8 "$w/llamacpp-bench.txt"; cp "$peer"/llamacpp-*.json "$w"/ 2>/dev/null
  save "llama.cpp"
fi
