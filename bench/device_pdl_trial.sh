#!/usr/bin/env bash
# The load-time PDL trial on the GPU (stop 19): every plan in bench/plans matching the NAME_GLOBs, run
# as a user would (no KESTREL_PDL): --bench (3 rounds of 64 new tokens after a 40-token prompt), and
# the trial's verdict (graph_pdl, each graph's median trial step) printed beside the bench's ms/token;
# --verify on each (the kept graph against streaming); compute-sanitizer on tiny-sm90-q4-m8 if present.
#   bash bench/device_pdl_trial.sh OUTDIR NAME_GLOB...   (kestrel importable; bench/plans carried)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
for g in "${@:2}"; do for p in bench/plans/$g.plan; do
  [ -f "$p" ] || continue
  n=$(basename "$p" .plan)
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 --bench "$w/bench-$n.json" > "$w/bench-$n.txt" 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); m=d['ms_per_token']; t=d['pdl_trial_ms'] or {}
med=lambda v: sorted(v)[len(v)//2] if v else float('nan')
print(f\"{sys.argv[2]:30} kept {'programmatic' if d['graph_pdl'] else 'plain':12} trial plain {med(t.get('plain_ms')):.3f} programmatic {med(t.get('programmatic_ms')):.3f} ms | bench graph {m['graph']:.3f} sampled {m['graph_sampled']:.3f} ms/token, {d['fraction_of_roofline']:.1%} of {d['roofline_ms']:.3f} ms\")" \
    "$w/bench-$n.json" "$n" || tail -3 "$w/bench-$n.txt"
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 16 --verify --json > "$w/verify-$n.json" 2> "$w/verify-$n.err"
  echo "  verify: $(cat "$w/verify-$n.json")"
  tar -C "$w" -cf "$out/pdl-trial.tar" .
done; done
if [ -f bench/plans/tiny-sm90-q4-m8.plan ]; then
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py bench/plans/tiny-sm90-q4-m8.plan \
    > "$w/sanitizer-tiny-q4-m8.txt" 2>&1
  echo "sanitizer tiny-q4-m8: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$w/sanitizer-tiny-q4-m8.txt") clean summaries)"
  tar -C "$w" -cf "$out/pdl-trial.tar" .
fi
echo "done in $(( $(date +%s) - t0 )) s"
