#!/usr/bin/env bash
# On the GPU: --verify (graph vs streaming, byte for byte) and --bench for every plan in bench/plans.
#   bash bench/device_models.sh OUTDIR [NAME_GLOB]   (kestrel importable; bench/plans carried)
set -u
out=$1
run() { python3 -c "import sys; from kestrel.runtime.cli import main; sys.argv = ['kestrel-run'] + sys.argv[1:]; main()" "$@"; }
ids=1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16
for p in bench/plans/${2:-*}.plan; do
  [ -f "$p" ] || continue
  n=$(basename "$p" .plan)
  echo "== $n"
  run "$p" --prompt-ids $ids --max-new-tokens 64 --verify --json | sed "s/^/{\"plan\": \"$n\", \"verify\": /; s/\$/}/" >> "$out/verify.jsonl"
  tail -1 "$out/verify.jsonl"
  run "$p" --prompt-ids $ids --max-new-tokens 64 --bench "$out/bench-$n.json" --rounds 3
done
