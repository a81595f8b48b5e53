#!/usr/bin/env bash
# Stop 50's second device call: the 80B-A3B forms of the cluster mixer's phase-by-phase probe (call 1's printed tail
# lost them), then stop 48's prepared queue (bench/device_stop48.sh first: gfold / gfoldpre, the carveout, YaRN on
# the GPU; its plans as that script lists, plus bench/plans/gdn-probe from
# `python bench/gdn_cluster_probe.py compile bench/plans/gdn-probe`). A call returns at most 8 files, so everything
# is tarred into one at the end; the queue runs under a timeout that leaves time for the tar.
# There: run(carry=["bench/plans"]): bash bench/device_stop50.sh $OUT
set -u
out=$1
r=$out/r
mkdir -p "$r/probe"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
timeout 90 python3 bench/gdn_cluster_probe.py run bench/plans/gdn-probe "$r/probe/gdn-probe.json" > "$r/probe/probe.txt" 2>&1
echo "probe: exit $?"; grep -v '^{' "$r/probe/probe.txt" | grep -A13 '^80b' | head -100
timeout 470 bash bench/device_stop48.sh "$r" first
echo "queue: exit $?"
find "$r" -name '*.tar' -exec sh -c 'd=$(dirname "$1"); tar -C "$d" -xf "$1" && rm "$1"' _ {} \;
tar -C "$out" -cf "$out/stop50-call.tar" r && rm -rf "$r"
