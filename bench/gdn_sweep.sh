#!/usr/bin/env bash
# The Gated DeltaNet kernels' width (BLOCK_V state columns a program) and warps, swept in whole plans: the
# one-token gdn_delta (decode) and the row-by-row gdn_rows_delta (the M-row step) get the same (BLOCK_V, warps)
# in each variant plan; kestrel-run --profile times both kernel by kernel.
#   here:        bash bench/gdn_sweep.sh build MODEL_ARGS...   (e.g. a 4-layer qwen3-next config --weights random ...)
#   on the GPU:  bash bench/gdn_sweep.sh time OUTDIR
#   PREFIX=NAME (default gdn): the variant plans are bench/plans/NAME-vBV-wW.plan
set -u
mode=$1; shift
vars="4:1 4:2 8:1 8:2 8:4 16:1 16:2 16:4 32:4"
if [ "$mode" = build ]; then
  for v in $vars; do
    bv=${v%:*}; w=${v#*:}
    python bench/build_variant.py gdn_rows.min_block_v=$bv gdn_rows.max_block_v=$bv gdn_rows.num_warps=$w \
      gdn_delta.min_block_v=$bv gdn_delta.max_block_v=$bv gdn_delta.num_warps=$w \
      -- "$@" -o "bench/plans/${PREFIX:-gdn}-v$bv-w$w.plan" 2>&1 | tail -1
  done
  exit 0
fi
out=$1; ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
for v in $vars; do
  bv=${v%:*}; w=${v#*:}; p=bench/plans/${PREFIX:-gdn}-v$bv-w$w.plan; n=${PREFIX:-gdn}-v$bv-w$w
  [ -f "$p" ] || continue
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/$n.json" > "$out/$n.txt" 2>&1
  echo "$n: $(grep -E '^gdn_delta ' "$out/$n.txt" | head -1 | awk '{print "gdn_delta", $3, "us/step"}'); $(grep -E '^gdn_rows_delta ' "$out/$n.txt" | head -1 | awk '{print "gdn_rows_delta", $3, "us/run"}'); $(grep -o 'graph replay [0-9.]* ms' "$out/$n.txt" | tr '\n' ' ')"
done
