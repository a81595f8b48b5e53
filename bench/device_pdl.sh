#!/usr/bin/env bash
# Programmatic dependent launch on whole plans (stop 19): every plan in bench/plans matching the
# NAME_GLOBs, --bench (3 rounds of 64 new tokens after a 40-token prompt) for each KESTREL_PDL value in
# PDL_VALUES (default "auto": unset, the load-time trial decides; "1" / "0" force programmatic / plain
# edges), one line per run (the trial's verdict and each graph's median trial step beside the bench's
# ms/token); VERIFY=1 adds --verify per plan (the kept graph against streaming) and compute-sanitizer
# on tiny-sm90-q4-m8 when it is there. Reports in OUTDIR/pdl.tar.
#   PDL_VALUES="1 0" bash bench/device_pdl.sh OUTDIR NAME_GLOB...   (the A/B of calls 2 and 5)
#   VERIFY=1 bash bench/device_pdl.sh OUTDIR NAME_GLOB...           (the trial of calls 6 and 7)
#   (kestrel importable; bench/plans carried)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
for g in "${@:2}"; do for p in bench/plans/$g.plan; do
  [ -f "$p" ] || continue
  n=$(basename "$p" .plan)
  for pdl in ${PDL_VALUES:-auto}; do
    f="$w/bench-$n-pdl$pdl"
    if [ "$pdl" = auto ]; then env -u KESTREL_PDL kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 \
      --bench "$f.json" > "$f.txt" 2>&1
    else KESTREL_PDL=$pdl kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 --bench "$f.json" > "$f.txt" 2>&1; fi
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); m=d['ms_per_token']; t=d.get('pdl_trial_ms') or {}
med=lambda v: sorted(v)[len(v)//2] if v else float('nan')
print(f\"{sys.argv[2]:30} PDL {sys.argv[3]:4} kept {'programmatic' if d['graph_pdl'] else 'plain':12} trial plain {med(t.get('plain_ms')):.3f} programmatic {med(t.get('programmatic_ms')):.3f} ms | graph {m['graph']:.3f} sampled {m['graph_sampled']:.3f} stream {m['stream']:.3f} ms/token, {d['fraction_of_roofline']:.1%} of {d['roofline_ms']:.3f} ms\")" \
      "$f.json" "$n" "$pdl" || tail -3 "$f.txt"
  done
  if [ "${VERIFY:-0}" = 1 ]; then
    kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 16 --verify --json > "$w/verify-$n.json" 2> "$w/verify-$n.err"
    echo "  verify: $(cat "$w/verify-$n.json")"
  fi
  tar -C "$w" -cf "$out/pdl.tar" .
done; done
if [ "${VERIFY:-0}" = 1 ] && [ -f bench/plans/tiny-sm90-q4-m8.plan ]; then
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py bench/plans/tiny-sm90-q4-m8.plan \
    > "$w/sanitizer-tiny-q4-m8.txt" 2>&1
  echo "sanitizer tiny-q4-m8: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$w/sanitizer-tiny-q4-m8.txt") clean summaries)"
  tar -C "$w" -cf "$out/pdl.tar" .
fi
echo "done in $(( $(date +%s) - t0 )) s"
