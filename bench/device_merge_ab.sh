#!/usr/bin/env bash
# Stop 29: the one-launch Gated DeltaNet step (passes/merge_gdn_norm.py) against the gdn_delta + gdn_norm pair, and
# the bf16 tensor-core normed products at one row (bf16_mma one_row_norm) against the Triton matvec, in one device
# call: compute-sanitizer on tiny plans, decode A/B per plan pair (kestrel-run --bench, same call), the 0.8B GPU
# path against the CPU reference, and the 0.8B profiles.   bash bench/device_merge_ab.sh OUTDIR
# (kestrel installed; bench/plans carried: bash bench/build_stop_plans.sh 0.8b-bf16 0.8b-bf16-nomerge 0.8b-bf16-noone
#  0.8b-q4 0.8b-q4-nomerge 27b-q4 27b-q4-nomerge next80-q4-decode next80-q4-decode-nomerge tiny-mtp-q4-spec3
#  tiny-mtp-bf16-spec3)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
say() { tar -C "$w" -cf "$out/merge.tar" .; echo "[$(( $(date +%s) - t0 )) s] $1"; }  # (everything in one tar)
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv,noheader
for q in q4 bf16; do
  KESTREL_SPEC_SAMPLING=1 compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py \
    bench/plans/tiny-mtp-sm90-$q-spec3.plan > "$w/sanitizer-tiny-mtp-$q-spec3.txt" 2>&1
  say "sanitizer tiny-mtp $q spec3: exit $?"; tail -2 "$w/sanitizer-tiny-mtp-$q-spec3.txt"
done
bench() {  # plan tag
  kestrel-run "bench/plans/$1.plan" --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 --bench "$w/bench-$2.json" \
    > "$w/bench-$2.txt" 2>&1
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[2], 'ms/token', r['ms_per_token'], 'pdl', r.get('graph_pdl'))" "$w/bench-$2.json" "$2" 2>/dev/null || tail -3 "$w/bench-$2.txt"
}
for m in "" -nomerge -noone -noone -nomerge ""; do bench "qwen3.5-0.8b-sm90-bf16$m" "08bf16$m-$RANDOM"; done
say "0.8B bf16"
for m in "" -nomerge -nomerge ""; do bench "qwen3.5-0.8b-sm90-q4$m" "08q4$m-$RANDOM"; done; say "0.8B q4"
for m in "" -nomerge; do bench "qwen3.5-27b-sm90-q4$m" "27bq4$m"; done; say "27B q4"
python3 bench/device_e2e.py "$w/e2e-08bf16.json" bench/plans/qwen3.5-0.8b-sm90-bf16.plan > "$w/e2e-08bf16.txt" 2>&1
python3 -c "import json, sys; r = json.load(open(sys.argv[1]))[0]; print(r['plan'], 'graph==stream', r['graph_equals_stream_tokens'], 'dump bytes identical', r['graph_vs_stream_dump_bytes_identical'], 'gpu vs cpu first divergence', r['gpu_vs_cpu_first_divergence'], 'max rel logits err', r['gpu_vs_cpu_max_rel_logits_err'], 'plain loop == stepwise', r['plain_loop_tokens_equal_stepwise'], r['plain_loop_first_divergence'], 'ms/token', r['ms_per_token_median'])" "$w/e2e-08bf16.json" || tail -5 "$w/e2e-08bf16.txt"
say "e2e 0.8B bf16"
for m in "" -nomerge; do bench "qwen3-next-80b-a3b-sm90-q4-decode$m" "next80q4$m"; done; say "next 80B q4"
for m in "" -nomerge -noone; do
  kestrel-run "bench/plans/qwen3.5-0.8b-sm90-bf16$m.plan" --prompt-ids "$ids" --max-new-tokens 8 \
    --profile "$w/profile-08bf16$m.json" > "$w/profile-08bf16$m.txt" 2>&1; sed -n 1,16p "$w/profile-08bf16$m.txt"
done
say done
