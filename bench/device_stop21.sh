#!/usr/bin/env bash
# Stop 21 on the GPU, one call: the M-row step at the verify step's few rows (issue 12's "verify at
# k + 1 rows against the M = 1 step"), the small-M GEMM sweep, and the sampling kernel (issue 13 part 5).
#   [GEMM=1] [KERNELS=1] [PROFILE=1] [BENCH=0] [Q4MMA=1] PLANS="..." bash bench/device_stop21.sh OUTDIR
#   (kestrel importable; bench/plans and, for GEMM=1, bench/gemm-small carried)
# Per plan of PLANS (bench/plans/NAME.plan, built with --prefill-rows 4): --bench with a 40-token prompt,
# 32 new tokens and --prompt-lengths 256 (64 replays of the 4-row step), greedy.
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
save() { tar -C "$w" -cf "$out/stop21.tar" .; echo "[$(( $(date +%s) - t0 )) s] $1"; }
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv,noheader
if [ "${KERNELS:-0}" = 1 ]; then
  SAMPLE_CANDS=${SAMPLE_CANDS:-0} Q4=0 python3 bench/device_decode_kernels.py "$w/decode-kernels.json" > "$w/decode-kernels.txt" 2>&1
  grep -i "sample\|done" "$w/decode-kernels.txt" | tail -40
  save "decode kernels"
fi
for n in ${PLANS:-}; do
  if [ "${BENCH:-1}" = 1 ]; then
    kestrel-run "bench/plans/$n.plan" --prompt-ids "$ids" --max-new-tokens 32 --rounds 3 --prompt-lengths 256 \
      --bench "$w/bench-$n.json" > "$w/bench-$n.txt" 2>&1
    tail -3 "$w/bench-$n.txt"
  fi
  if [ "${PROFILE:-0}" = 1 ]; then  # the decode step and (with --prefill-rows) the M-row step, kernel by kernel
    kestrel-run "bench/plans/$n.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$w/profile-$n.json" \
      > "$w/profile-$n.txt" 2>&1
    tail -22 "$w/profile-$n.txt"
  fi
  save "$n"
done
if [ "${Q4MMA:-0}" = 1 ]; then
  (cd bench && python3 q4mma_probe.py time q4mma-cubins "$w/q4mma.json") > "$w/q4mma.txt" 2>&1
  tail -32 "$w/q4mma.txt"
  save "q4mma"
fi
if [ "${GEMM:-0}" = 1 ]; then
  (cd bench && python3 gemm_sweep.py time "${GEMM_DIR:-gemm-small}" "$w/${GEMM_DIR:-gemm-small}.json") > "$w/gemm-small.txt" 2>&1
  tail -12 "$w/gemm-small.txt"
  save "gemm small"
fi
python3 - "$w" <<'PY'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "bench-*.json"))):
    b = json.load(open(f))
    pre = (b.get("prefill") or [{}])[0]
    ttft = pre.get("ttft_ms", {})
    print(f"{os.path.basename(f)[6:-5]:28} M=1 {b['ms_per_token']['graph']:.3f} ms/token; 256-token prompt in 4-row steps "
          f"{ttft.get('rows_graph', float('nan')):.2f} ms = {ttft.get('rows_graph', float('nan')) / 64:.3f} ms per step")
PY
save done
