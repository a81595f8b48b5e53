#!/usr/bin/env bash
# Stop 29: plan pairs A/B in one device call (kestrel-run --bench, 40-token prompt, 64 new tokens, 3 rounds, each
# pair run A B B A), compute-sanitizer on plans, and plans against the CPU reference; everything in OUTDIR/ab.tar.
#   PAIRS="A:B ..." SEQ="A B C ..." SANITIZE="P ..." E2E="P ..." bash bench/device_preload_ab.sh OUTDIR
# (SEQ: the plans in order, then in reverse, each bench once a pass; STEP_TIMEOUT: seconds a step may take, 600)
# (kestrel installed; bench/plans carried; names without .plan). Call 3 (the matvec PRELOAD on every matrix against
# none) ran this script's first form at commit a7fecc9; call 4 (the final rule):
#   bash bench/build_stop_plans.sh 0.8b-bf16 0.8b-bf16-nopre tiny-mtp-bf16-spec3
#   PAIRS="qwen3.5-0.8b-sm90-bf16:qwen3.5-0.8b-sm90-bf16-nopre" SANITIZE="tiny-mtp-sm90-bf16-spec3" \
#     E2E="qwen3.5-0.8b-sm90-bf16" bash bench/device_preload_ab.sh $OUT
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
say() { tar -C "$w" -cf "$out/ab.tar" .; echo "[$(( $(date +%s) - t0 )) s] $1"; }  # (everything in one tar)
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv,noheader
for p in ${SANITIZE:-}; do
  KESTREL_SPEC_SAMPLING=1 timeout ${STEP_TIMEOUT:-600} compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py \
    "bench/plans/$p.plan" > "$w/sanitizer-$p.txt" 2>&1
  say "sanitizer $p: exit $?"; tail -1 "$w/sanitizer-$p.txt"
done
bench() {  # plan tag
  timeout ${STEP_TIMEOUT:-600} kestrel-run "bench/plans/$1.plan" --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 --bench "$w/bench-$2.json" \
    > "$w/bench-$2.txt" 2>&1
  python3 bench/bench_line.py "$w/bench-$2.json" "$2" 2>/dev/null || tail -3 "$w/bench-$2.txt"
}
for pair in ${PAIRS:-}; do
  a=${pair%%:*}; b=${pair##*:}
  bench "$a" "$a-1"; bench "$b" "$b-1"; bench "$b" "$b-2"; bench "$a" "$a-2"; say "$pair"
done
if [ -n "${SEQ:-}" ]; then  # several plans in one sequence, then back: A B C C B A
  for p in $SEQ; do bench "$p" "$p-1"; done
  for p in $(echo $SEQ | tr ' ' '\n' | tac); do bench "$p" "$p-2"; done
  say "seq"
fi
for p in ${E2E:-}; do
  timeout ${STEP_TIMEOUT:-600} python3 bench/device_e2e.py "$w/e2e-$p.json" "bench/plans/$p.plan" > "$w/e2e-$p.txt" 2>&1
  python3 -c "import json, sys; r = json.load(open(sys.argv[1]))[0]; print(r['plan'], 'graph==stream', r['graph_equals_stream_tokens'], 'dump bytes identical', r['graph_vs_stream_dump_bytes_identical'], 'gpu vs cpu first divergence', r['gpu_vs_cpu_first_divergence'], 'max rel logits err', r['gpu_vs_cpu_max_rel_logits_err'], 'ms/token', r['ms_per_token_median'])" "$w/e2e-$p.json" || tail -5 "$w/e2e-$p.txt"
  say "e2e $p"
done
say done
