#!/usr/bin/env bash
# Qwen3-Next on the GPU, one call (issue 15): compute-sanitizer on tiny-next (graph and streaming, the M-row
# step, greedy and sampled); the GPU path against the CPU reference at a reduced-depth real shape (4 layers of
# qwen3-next-80b-a3b, bf16 and q4: tokens, logits, graph vs streaming dump bytes); the whole 80B-A3B q4 plan:
# decode ms/token against the honest roofline (the routed experts' bytes) and prefill tokens/s.
#   bash bench/device_next.sh OUTDIR   (kestrel importable; bench/plans carried)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
save() { tar -C "$w" -cf "$out/next.tar" .; echo "[$(( $(date +%s) - t0 )) s] $1"; }
for q in bf16 q4; do
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py "bench/plans/tiny-next-sm90-$q-m8.plan" \
    > "$w/sanitizer-tiny-next-$q.txt" 2>&1; echo "sanitizer tiny-next $q: exit $?"; tail -2 "$w/sanitizer-tiny-next-$q.txt"
done
save sanitizer
python3 bench/device_e2e.py "$w/e2e-next-4l.json" bench/plans/qwen3-next-4l-sm90-bf16.plan bench/plans/qwen3-next-4l-sm90-q4.plan \
  > "$w/e2e-next-4l.txt" 2>&1; tail -4 "$w/e2e-next-4l.txt"
python3 - "$w/e2e-next-4l.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(r["plan"], "graph==stream", r["graph_equals_stream_tokens"], "dump bytes identical", r["graph_vs_stream_dump_bytes_identical"],
          "gpu vs cpu first divergence", r["gpu_vs_cpu_first_divergence"], "max rel logits err %.2e" % r["gpu_vs_cpu_max_rel_logits_err"],
          "ms/token", r["ms_per_token_median"])
PY
save e2e
kestrel-run bench/plans/qwen3-next-80b-a3b-sm90-q4.plan --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 --prompt-lengths 512 \
  --bench "$w/bench-next-80b-q4.json" > "$w/bench-next-80b-q4.txt" 2>&1
tail -6 "$w/bench-next-80b-q4.txt"
save bench
kestrel-run bench/plans/qwen3-next-80b-a3b-sm90-q4.plan --prompt-ids "$ids" --max-new-tokens 8 --profile "$w/profile-next-80b-q4.json" \
  > "$w/profile-next-80b-q4.txt" 2>&1
tail -30 "$w/profile-next-80b-q4.txt"
save done
