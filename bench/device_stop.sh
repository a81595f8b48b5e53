#!/usr/bin/env bash
# One device call of a stop (stop 23 on; it was bench/device_stop23.sh), the parts chosen by the environment:
# Qwen3-Next's one-row MoE kernels and its q4 matrices swept; compute-sanitizer; the GPU path against the CPU
# reference; Qwen3-Next decode / prefill / profile; the speculative plans with sampled speculation.
#   Q4MMA_SWEEP=1 BF16MMA_SWEEP=1 MOE_SWEEP=1 MV_SWEEP=1 SANITIZE_PLANS="..." E2E_PLANS="..." NEXT_PLANS="..." SPEC_PLANS="..." SPEC_KERNELS=1 \
#     bash bench/device_stop.sh OUTDIR     (kestrel importable; bench/plans, bench/moe-sweep, bench/sweep-next,
#     bench/q4mma-sweep, bench/bf16mma-sweep carried)
# Everything lands in OUTDIR/stop.tar.
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
save() { tar -C "$w" -cf "$out/stop.tar" .; echo "[$(( $(date +%s) - t0 )) s] $1"; }
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv,noheader
if [ "${Q4MMA_SWEEP:-0}" = 1 ]; then  # kernels/q4_mma.py's splits against the Triton kernels (bench/q4mma_sweep.py)
  (cd bench && python3 q4mma_sweep.py time q4mma-sweep "$w/q4mma-sweep.json") > "$w/q4mma-sweep.txt" 2>&1
  sed -n '/^shape /,$p' "$w/q4mma-sweep.txt"; tail -2 "$w/q4mma-sweep.txt"
  save "q4mma sweep"
fi
if [ "${BF16MMA_SWEEP:-0}" = 1 ]; then  # kernels/bf16_mma.py's splits against the few-rows matvec (bench/bf16mma-sweep)
  (cd bench && python3 q4mma_sweep.py time bf16mma-sweep "$w/bf16mma-sweep.json") > "$w/bf16mma-sweep.txt" 2>&1
  sed -n '/^shape /,$p' "$w/bf16mma-sweep.txt"; tail -2 "$w/bf16mma-sweep.txt"
  save "bf16mma sweep"
fi
if [ "${MOE_SWEEP:-0}" = 1 ]; then
  (cd bench && python3 moe_sweep.py time moe-sweep "$w/moe-sweep.json") > "$w/moe-sweep.txt" 2>&1
  sed -n '/^best per kernel/,$p' "$w/moe-sweep.txt"; tail -3 "$w/moe-sweep.txt"
  save "moe sweep"
fi
if [ "${MV_SWEEP:-0}" = 1 ]; then
  (cd bench && python3 matvec_sweep.py time sweep-next "$w/matvec-sweep-next.json") > "$w/matvec-sweep-next.txt" 2>&1
  sed -n '/^best per shape/,$p' "$w/matvec-sweep-next.txt"; tail -2 "$w/matvec-sweep-next.txt"
  save "matvec sweep (next)"
fi
if [ "${SPEC_KERNELS:-0}" = 1 ]; then  # the speculative sampling kernels alone at V = 248,320
  Q4=0 python3 bench/device_decode_kernels.py "$w/decode-kernels.json" > "$w/decode-kernels.txt" 2>&1
  grep -i -E "spec|draft|rows|iteration" "$w/decode-kernels.txt" | tail -30
  save "decode kernels"
fi
for p in ${SANITIZE_PLANS:-}; do  # memcheck over graph and streaming, greedy (speculative) and sampled requests
  KESTREL_SPEC_SAMPLING=1 compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py \
    "bench/plans/$p.plan" > "$w/sanitizer-$p.txt" 2>&1; echo "sanitizer $p: exit $?"; tail -3 "$w/sanitizer-$p.txt"
  save "sanitizer $p"
done
for p in ${E2E_PLANS:-}; do  # the GPU path against the CPU reference (tokens, logits), graph vs streaming bytes
  python3 bench/device_e2e.py "$w/e2e-$p.json" "bench/plans/$p.plan" > "$w/e2e-$p.txt" 2>&1
  python3 -c "import json, sys; r = json.load(open(sys.argv[1]))[0]; print(r['plan'], 'graph==stream', r['graph_equals_stream_tokens'], 'dump bytes identical', r['graph_vs_stream_dump_bytes_identical'], 'gpu vs cpu first divergence', r['gpu_vs_cpu_first_divergence'], 'max rel logits err', r['gpu_vs_cpu_max_rel_logits_err'], 'plain loop == stepwise', r['plain_loop_tokens_equal_stepwise'], r['plain_loop_first_divergence'], 'ms/token', r['ms_per_token_median'])" "$w/e2e-$p.json" || tail -5 "$w/e2e-$p.txt"
  save "e2e $p"
done
for n in ${NEXT_PLANS:-}; do  # Qwen3-Next: decode against the honest roofline, prefill, the kernel profile
  kestrel-run "bench/plans/$n.plan" --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 --prompt-lengths 512 \
    --bench "$w/bench-$n.json" > "$w/bench-$n.txt" 2>&1
  tail -4 "$w/bench-$n.txt"
  kestrel-run "bench/plans/$n.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$w/profile-$n.json" \
    > "$w/profile-$n.txt" 2>&1
  sed -n 1,18p "$w/profile-$n.txt"; grep "launches/step" "$w/profile-$n.txt"
  save "$n"
done
for p in ${SPEC_PLANS:-}; do  # greedy and sampled speculation against plain decoding
  KESTREL_SPEC_SAMPLING=1 python3 bench/device_spec.py "$w/spec-$p.json" "bench/plans/$p.plan" > "$w/spec-$p.txt" 2>&1
  grep -i -E "sampled|iteration|plain|as graphs|by kernel" "$w/spec-$p.txt" | tail -8
  save "spec $p"
done
save done
