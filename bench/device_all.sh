#!/usr/bin/env bash
# On the device: whole-plan checks on tiny (bench/device_e2e.py) and compute-sanitizer on tiny; with
# NAME_GLOB, then --verify and --bench for the plans matching it. Writes everything under OUTDIR.
#   bash bench/device_all.sh OUTDIR [NAME_GLOB]   (kestrel importable; bench/plans carried)
set -u
out=$1
python3 bench/device_e2e.py "$out/e2e-h200-tiny.json" bench/plans/tiny-sm90-bf16.plan bench/plans/tiny-sm90-q4.plan
for q in bf16 q4; do
  compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py bench/plans/tiny-sm90-$q.plan \
    > "$out/sanitizer-tiny-$q.txt" 2>&1
  echo "sanitizer tiny-$q: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$out/sanitizer-tiny-$q.txt") clean summaries)"
  tail -2 "$out/sanitizer-tiny-$q.txt"
done
if [ -n "${2:-}" ]; then bash bench/device_models.sh "$out" "$2"; fi
