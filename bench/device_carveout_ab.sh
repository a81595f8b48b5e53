#!/usr/bin/env bash
# Stop 30: every kernel's preferred shared-memory carveout at CARVEOUT percent (bench/carveout_probe.py) against
# the runtime as it is, per plan, A B B A in one device call (kestrel-run --bench: 40-token prompt, 64 new tokens,
# 3 rounds); the load-time PDL trial decides the edges in both. Everything in OUTDIR/carveout.tar.
#   PLANS="P ..." CARVEOUT=100 bash bench/device_carveout_ab.sh OUTDIR      (names without .plan; plans carried)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
run() {  # plan tag [carveout]
  if [ -n "${3:-}" ]; then
    CARVEOUT=$3 python3 bench/carveout_probe.py "bench/plans/$1.plan" --prompt-ids "$ids" --max-new-tokens 64 \
      --rounds 3 --bench "$w/bench-$2.json" > "$w/bench-$2.txt" 2>&1
  else
    kestrel-run "bench/plans/$1.plan" --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 --bench "$w/bench-$2.json" \
      > "$w/bench-$2.txt" 2>&1
  fi
  python3 bench/bench_line.py "$w/bench-$2.json" "$2" 2>/dev/null || tail -3 "$w/bench-$2.txt"
}
for p in ${PLANS:-}; do
  run "$p" "$p-1"; run "$p" "$p-carveout-1" "$CARVEOUT"; run "$p" "$p-carveout-2" "$CARVEOUT"; run "$p" "$p-2"
  tar -C "$w" -cf "$out/carveout.tar" .; echo "[$(( $(date +%s) - t0 )) s] $p"
done
