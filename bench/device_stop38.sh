#!/usr/bin/env bash
# Prepared in stop 37 for the next device calls (each under the 10-minute limit):
#   pf       the q4 L2 prefetch (matvec.l2_prefetch_bytes, 4.5 MiB: only 0.8B's matrices) at 2B-9B q4 now that their
#            step graphs keep programmatic edges with the late-trigger kernels (stop 36 measured it on plain edges,
#            where nothing runs before the wait, and it lost): rule against 8 / 16 MiB, A B C C B A
#            (bash bench/build_stop_plans.sh 2b-q4 2b-q4-pf8 2b-q4-pf16 4b-q4 4b-q4-pf8 4b-q4-pf16 9b-q4 9b-q4-pf8
#             9b-q4-pf16)
#   specpdl  bench/device_stop37.sh specpdl (prepared in stop 36, not yet run)
# There: run(carry=["bench/plans"]): bash bench/device_stop38.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  pf)
    mkdir -p "$out/a" "$out/b" "$out/c"
    for m in 2b 4b 9b; do
      d=$out/$(echo "$m" | tr 249 abc)
      STEP_TIMEOUT=120 SEQ="qwen3.5-$m-sm90-q4 qwen3.5-$m-sm90-q4-pf8 qwen3.5-$m-sm90-q4-pf16" bash bench/device_preload_ab.sh "$d"
    done ;;
  specpdl)
    bash bench/device_stop37.sh "$out" specpdl ;;
esac
