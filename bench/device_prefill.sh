#!/usr/bin/env bash
# On the GPU: the M-row step of the plans in bench/plans matching the NAME_GLOBs (bench/device_prefill.py:
# exactness vs the one-token prefill and the CPU reference, graph vs streaming, TTFT / prefill tokens
# per second), and with SANITIZE=1 compute-sanitizer on the tiny M-row plans (a prefill crossing chunk
# boundaries, and one filling max_seq exactly, both graph modes). Results in OUTDIR/prefill.tar.
#   bash bench/device_prefill.sh OUTDIR NAME_GLOB...   (kestrel importable; bench/plans carried)
set -u
out=$1; w=$(mktemp -d)
plans=(); for g in "${@:2}"; do for p in bench/plans/$g.plan; do [ -f "$p" ] && plans+=("$p"); done; done
python3 bench/device_prefill.py "$w/prefill-${TAG:-run}.json" "${plans[@]}"
if [ "${SANITIZE:-0}" = 1 ]; then
  for q in bf16 q4; do
    p=bench/plans/tiny-sm90-$q-m8.plan
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py "$p" > "$w/sanitizer-tiny-$q-m8.txt" 2>&1
    echo "sanitizer tiny-$q-m8: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$w/sanitizer-tiny-$q-m8.txt") clean summaries)"
    tail -3 "$w/sanitizer-tiny-$q-m8.txt"
  done
fi
tar -C "$w" -cf "$out/prefill-${TAG:-run}.tar" .
