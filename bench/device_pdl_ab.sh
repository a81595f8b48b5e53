#!/usr/bin/env bash
# The programmatic-dependent-launch A/B (stop 19): every plan in bench/plans matching the NAME_GLOBs
# (variants built by bench/build_variant.py: stop 19's *-pf0 / *-pf65536 were builds of its matvec L2
# prefetch before the PDL wait, since removed), --bench with the graph's programmatic edges (KESTREL_PDL=1) and without (0), 3 rounds
# of 64 new tokens after a 40-token prompt each. Reports in OUTDIR/pdl-ab.tar, one line per run here.
#   bash bench/device_pdl_ab.sh OUTDIR NAME_GLOB...   (kestrel importable; bench/plans carried)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
for g in "${@:2}"; do for p in bench/plans/$g.plan; do
  [ -f "$p" ] || continue
  n=$(basename "$p" .plan)
  for pdl in 1 0; do
    KESTREL_PDL=$pdl kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 --bench "$w/bench-$n-pdl$pdl.json" \
      > "$w/bench-$n-pdl$pdl.txt" 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); m=d['ms_per_token']
print(f\"{sys.argv[2]:34} PDL {sys.argv[3]} ({d['graph_pdl']!s:5})  graph {m['graph']:7.3f}  sampled {m['graph_sampled']:7.3f}  stream {m['stream']:7.3f} ms/token  {d['fraction_of_roofline']:6.1%} of {d['roofline_ms']:.3f} ms\")" \
      "$w/bench-$n-pdl$pdl.json" "$n" "$pdl" || tail -3 "$w/bench-$n-pdl$pdl.txt"
  done
  tar -C "$w" -cf "$out/pdl-ab.tar" .
done; done
echo "done in $(( $(date +%s) - t0 )) s"
