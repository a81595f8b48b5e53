#!/usr/bin/env bash
# Stop 22 on the GPU, one call: the few-rows matvec against the skinny GEMM (kernel sweep), the
# speculative iteration and the 4-row M-row step with each (plans built both ways).
#   [SWEEP=1] SANITIZE_PLANS="..." E2E_PLANS="..." NEXT_PLANS="..." SPEC_PLANS="..." M4_PLANS="..." bash bench/device_stop22.sh OUTDIR
#   (kestrel importable; bench/plans and, for SWEEP=1, bench/rows-sweep carried)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
save() { tar -C "$w" -cf "$out/stop22.tar" .; echo "[$(( $(date +%s) - t0 )) s] $1"; }
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv,noheader
if [ "${SWEEP:-1}" = 1 ]; then
  (cd bench && python3 rows_sweep.py time rows-sweep "$w/rows-sweep.json") > "$w/rows-sweep.txt" 2>&1
  grep -v "^skip" "$w/rows-sweep.txt" | tail -40
  save "rows sweep"
fi
for p in ${SANITIZE_PLANS:-}; do  # memcheck over graph and streaming, greedy (speculative) and sampled requests
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py "bench/plans/$p.plan" \
    > "$w/sanitizer-$p.txt" 2>&1; echo "sanitizer $p: exit $?"; tail -3 "$w/sanitizer-$p.txt"
  save "sanitizer $p"
done
for p in ${E2E_PLANS:-}; do  # the GPU path against the CPU reference (tokens, logits), graph vs streaming bytes
  python3 bench/device_e2e.py "$w/e2e-$p.json" "bench/plans/$p.plan" > "$w/e2e-$p.txt" 2>&1
  python3 -c "import json, sys; r = json.load(open(sys.argv[1]))[0]; print(r['plan'], 'graph==stream', r['graph_equals_stream_tokens'], 'dump bytes identical', r['graph_vs_stream_dump_bytes_identical'], 'gpu vs cpu first divergence', r['gpu_vs_cpu_first_divergence'], 'max rel logits err', r['gpu_vs_cpu_max_rel_logits_err'], 'ms/token', r['ms_per_token_median'])" "$w/e2e-$p.json" || tail -5 "$w/e2e-$p.txt"
  save "e2e $p"
done
for p in ${SPEC_PLANS:-}; do
  python3 bench/device_spec.py "$w/spec-$p.json" "bench/plans/$p.plan" > "$w/spec-$p.txt" 2>&1
  tail -2 "$w/spec-$p.txt"
  save "spec $p"
done
for n in ${M4_PLANS:-}; do
  kestrel-run "bench/plans/$n.plan" --prompt-ids "$ids" --max-new-tokens 32 --rounds 3 --prompt-lengths 256 \
    --bench "$w/bench-$n.json" > "$w/bench-$n.txt" 2>&1
  tail -2 "$w/bench-$n.txt"
  save "$n"
done
for n in ${NEXT_PLANS:-}; do  # Qwen3-Next: decode against the honest roofline, prefill, the kernel profile
  kestrel-run "bench/plans/$n.plan" --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 --prompt-lengths 512 \
    --bench "$w/bench-$n.json" > "$w/bench-$n.txt" 2>&1
  tail -4 "$w/bench-$n.txt"
  kestrel-run "bench/plans/$n.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$w/profile-$n.json" \
    > "$w/profile-$n.txt" 2>&1
  sed -n 1,16p "$w/profile-$n.txt"
  save "$n"
done
python3 - "$w" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "spec-*.json"))):
    if "replay" in f:
        continue
    for r in json.load(open(f)):
        print(f"{os.path.basename(r['plan'])[:-5]:40} plain {r['ms_per_token_plain']:7.3f} iteration {r['ms_per_iteration']:7.3f} "
              f"({r['ms_per_iteration'] / r['ms_per_token_plain']:.2f}x) spec==plain {r['spec_equals_plain']} "
              f"(first diff {r['first_difference']}) graph==stream {r['graph_equals_streaming']}")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "bench-*.json"))):
    b = json.load(open(f))
    if "next" in f:
        continue  # (Qwen3-Next: its bench lines are printed above)
    ttft = (b.get("prefill") or [{}])[0].get("ttft_ms", {})
    print(f"{os.path.basename(f)[6:-5]:40} M=1 {b['ms_per_token']['graph']:.3f} ms/token; 4-row step "
          f"{ttft.get('rows_graph', float('nan')) / 64:.3f} ms")
PY
save done
