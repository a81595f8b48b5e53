#!/usr/bin/env bash
# Stop 49's device call (under the 10-minute limit, most wanted first; each step's results tarred as it ends):
#   gclus   the Gated DeltaNet mixer as one cluster launch (rmsnorm_gdn, kernels/gdn_cluster.py, rule gdn_cluster.on):
#           0. where a launch's time goes, phase by phase, in a few forms (bench/gdn_cluster_probe.py; here first:
#              python bench/gdn_cluster_probe.py compile bench/plans/gdn-probe);
#           1. the kernel alone against its reference (rmsnorm_gdn_ref) at the 80B-A3B and 0.8B shapes, timed, beside
#              the three launches it replaces (bench/device_kernels.py); stops here if it is wrong or hangs;
#           2. 4 layers of the 0.8B shape with it against the CPU reference (e2e);
#           3. 80B-A3B q4: the rule, the cluster form at 8 and at 16 warps a CTA, A B C C B A;
#           4. compute-sanitizer on the 4 layers of 0.8B; 4 layers of 80B-A3B against the CPU reference;
#           5. 0.8B and 2B q4 against the rule, A B B A.
#           Here first: PROGRAMS="qwen3-next-80b-a3b:q4 qwen3.5-0.8b:q4" ONLY_OP=rmsnorm_gdn,gdn_delta,gdn_norm,rmsnorm_matmul
#             KESTREL_RULES="gdn_cluster.on=True" python bench/prepare_kernels.py bench/plans/cubins-gclus; the same
#             without KESTREL_RULES and ONLY_OP=gdn_delta,gdn_norm,rmsnorm_matmul into bench/plans/cubins-base;
#             bash bench/build_stop_plans.sh small4-q4-gclus next4-q4-gclus 0.8b-q4 0.8b-q4-gclus 2b-q4 2b-q4-gclus
#             next80-q4 next80-q4-gclus next80-q4-gclus16
#   short   0, 1 (the cluster kernel only), 2's 0.8B check and 80B-A3B's rule against the cluster form, A B B A
# There: run(carry=["bench/plans"]): bash bench/device_stop49.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  gclus)
    mkdir -p "$out/probe" "$out/kern" "$out/chk" "$out/next" "$out/chk2" "$out/dense"
    timeout 150 python3 bench/gdn_cluster_probe.py run bench/plans/gdn-probe "$out/probe/gdn-probe.json" \
      > "$out/probe/probe.txt" 2>&1
    echo "probe: exit $?"; grep -v '^{' "$out/probe/probe.txt" | tail -150
    for d in gclus base; do
      timeout 150 python3 bench/device_kernels.py bench/plans/cubins-$d "$out/kern/$d.json" > "$out/kern/$d.txt" 2>&1
      echo "kernels $d: exit $?"; tail -11 "$out/kern/$d.txt"
    done
    tar -C "$out" -cf "$out/kern.tar" kern
    python3 - "$out/kern/gclus.json" <<'PY' || { echo "the cluster kernel is wrong or did not finish: stopping"; exit 3; }
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["kernels"] if r["op"] == "rmsnorm_gdn"]
bad = [r for r in rows if "error" in r or r["max_rel_err"] > 1e-3]
print(len(rows), "rmsnorm_gdn launches checked;", "bad:", bad if bad else "none")
sys.exit(1 if bad or not rows else 0)
PY
    STEP_TIMEOUT=90 E2E="qwen3.5-small4-sm90-q4-gclus" bash bench/device_preload_ab.sh "$out/chk"
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-gclus qwen3-next-80b-a3b-sm90-q4-gclus16" \
      bash bench/device_preload_ab.sh "$out/next"
    STEP_TIMEOUT=150 SANITIZE="qwen3.5-small4-sm90-q4-gclus" E2E="qwen3-next-4l-sm90-q4-gclus" \
      bash bench/device_preload_ab.sh "$out/chk2"
    STEP_TIMEOUT=100 PAIRS="qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-gclus qwen3.5-2b-sm90-q4:qwen3.5-2b-sm90-q4-gclus" \
      bash bench/device_preload_ab.sh "$out/dense" ;;
  short)  # (little device time left: the probe, the kernel check, 0.8B's e2e, 80B-A3B A B B A)
    mkdir -p "$out/probe" "$out/kern" "$out/chk" "$out/next"
    timeout 100 python3 bench/gdn_cluster_probe.py run bench/plans/gdn-probe "$out/probe/gdn-probe.json" \
      > "$out/probe/probe.txt" 2>&1
    echo "probe: exit $?"; grep -v '^{' "$out/probe/probe.txt" | tail -150
    timeout 100 python3 bench/device_kernels.py bench/plans/cubins-gclus "$out/kern/gclus.json" > "$out/kern/gclus.txt" 2>&1
    echo "kernels gclus: exit $?"; tail -4 "$out/kern/gclus.txt"
    STEP_TIMEOUT=60 E2E="qwen3.5-small4-sm90-q4-gclus" bash bench/device_preload_ab.sh "$out/chk"
    STEP_TIMEOUT=60 PAIRS="qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-sm90-q4-gclus" \
      bash bench/device_preload_ab.sh "$out/next" ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
