#!/usr/bin/env bash
# Stop 50: the shared-memory carveout every kernel prefers, per plan, A B C C B A in one device call:
# A the driver's choice (kestrel-run), B CARVEOUT=100, C CARVEOUT=$MID (the least that attn_step's 158 KiB CTA needs:
# 70% of sm_90's 228 KiB, which the driver rounds up to its 164 KB configuration); then PAIRS "x:y" run A B B A both
# at CARVEOUT=100 (e.g. the cluster mixer's plan against the rule's when no kernel changes the split).
#   PLANS="P ..." PAIRS="P:Q ..." MID=70 bash bench/device_carveout_sweep.sh OUTDIR   (names without .plan)
set -u
out=$1; mid=${MID:-70}; t0=$(date +%s)
mkdir -p "$out"
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
run() {  # plan tag [carveout]
  if [ -n "${3:-}" ]; then
    CARVEOUT=$3 timeout 150 python3 bench/carveout_probe.py "bench/plans/$1.plan" --prompt-ids "$ids" \
      --max-new-tokens 64 --rounds 3 --bench "$out/bench-$2.json" > "$out/bench-$2.txt" 2>&1
  else
    timeout 150 kestrel-run "bench/plans/$1.plan" --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 \
      --bench "$out/bench-$2.json" > "$out/bench-$2.txt" 2>&1
  fi
  python3 bench/bench_line.py "$out/bench-$2.json" "$2" 2>/dev/null || tail -3 "$out/bench-$2.txt"
}
for p in ${PLANS:-}; do
  run "$p" "$p-1"; run "$p" "$p-c100-1" 100; run "$p" "$p-c$mid-1" "$mid"
  run "$p" "$p-c$mid-2" "$mid"; run "$p" "$p-c100-2" 100; run "$p" "$p-2"
  echo "[$(( $(date +%s) - t0 )) s] $p"
done
for pq in ${PAIRS:-}; do
  p=${pq%%:*}; q=${pq#*:}
  run "$p" "$p-c100-p1" 100; run "$q" "$q-c100-1" 100; run "$q" "$q-c100-2" 100; run "$p" "$p-c100-p2" 100
  echo "[$(( $(date +%s) - t0 )) s] $pq"
done
