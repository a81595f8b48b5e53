#!/usr/bin/env bash
# Stop 29 call 3: the matvecs' first weight tile loaded before the PDL wait (matvec PRELOAD) against after it, in one
# device call: compute-sanitizer on tiny plans, decode A/B per plan pair (kestrel-run --bench, interleaved), the
# 0.8B q4 GPU path against the CPU reference.   bash bench/device_preload_ab.sh OUTDIR
# (kestrel installed; bench/plans carried: bash bench/build_stop_plans.sh 0.8b-bf16 0.8b-bf16-nopre 0.8b-q4
#  0.8b-q4-nopre 27b-q4 27b-q4-nopre 27b-bf16 27b-bf16-nopre tiny-mtp-q4-spec3 tiny-mtp-bf16-spec3)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
say() { tar -C "$w" -cf "$out/preload.tar" .; echo "[$(( $(date +%s) - t0 )) s] $1"; }  # (everything in one tar)
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv,noheader
for q in q4 bf16; do
  KESTREL_SPEC_SAMPLING=1 compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py \
    bench/plans/tiny-mtp-sm90-$q-spec3.plan > "$w/sanitizer-tiny-mtp-$q-spec3.txt" 2>&1
  say "sanitizer tiny-mtp $q spec3: exit $?"; tail -1 "$w/sanitizer-tiny-mtp-$q-spec3.txt"
done
bench() {  # plan tag
  kestrel-run "bench/plans/$1.plan" --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 --bench "$w/bench-$2.json" \
    > "$w/bench-$2.txt" 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); t=r.get('pdl_trial_ms') or {}; med=lambda v: sorted(v)[len(v)//2]; print(sys.argv[2], 'ms/token', {k: round(v, 4) for k, v in r['ms_per_token'].items()}, 'pdl', r.get('graph_pdl'), 'trial', {k: round(med(v), 4) for k, v in t.items()})" "$w/bench-$2.json" "$2" 2>/dev/null || tail -3 "$w/bench-$2.txt"
}
for m in "" -nopre -nopre ""; do bench "qwen3.5-0.8b-sm90-bf16$m" "08bf16$m-$RANDOM"; done; say "0.8B bf16"
for m in "" -nopre -nopre ""; do bench "qwen3.5-0.8b-sm90-q4$m" "08q4$m-$RANDOM"; done; say "0.8B q4"
for m in "" -nopre -nopre ""; do bench "qwen3.5-27b-sm90-q4$m" "27bq4$m-$RANDOM"; done; say "27B q4"
for m in "" -nopre; do bench "qwen3.5-27b-sm90-bf16$m" "27bbf16$m"; done; say "27B bf16"
python3 bench/device_e2e.py "$w/e2e-08q4.json" bench/plans/qwen3.5-0.8b-sm90-q4.plan > "$w/e2e-08q4.txt" 2>&1
python3 -c "import json, sys; r = json.load(open(sys.argv[1]))[0]; print(r['plan'], 'graph==stream', r['graph_equals_stream_tokens'], 'dump bytes identical', r['graph_vs_stream_dump_bytes_identical'], 'gpu vs cpu first divergence', r['gpu_vs_cpu_first_divergence'], 'max rel logits err', r['gpu_vs_cpu_max_rel_logits_err'], 'ms/token', r['ms_per_token_median'])" "$w/e2e-08q4.json" || tail -5 "$w/e2e-08q4.txt"
say "e2e 0.8B q4"
for m in "" -nopre; do
  kestrel-run "bench/plans/qwen3.5-0.8b-sm90-bf16$m.plan" --prompt-ids "$ids" --max-new-tokens 8 \
    --profile "$w/profile-08bf16$m.json" > "$w/profile-08bf16$m.txt" 2>&1; sed -n 3,9p "$w/profile-08bf16$m.txt"
done
say done
