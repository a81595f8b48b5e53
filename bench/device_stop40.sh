#!/usr/bin/env bash
# Stop 40's device calls (each under the 10-minute limit); plans from bench/build_stop_plans.sh as each part says.
#   route   the router's top-k folded into the normed gate / up kernel (passes/fold_routing.py) against its own
#           launch (moe.route_in_gate_up=False): 80B-A3B q4 A B B A (kestrel-run --bench), its --profile; 4 layers of
#           the 80B-A3B shape against the CPU reference (graph == streaming, dump bytes) and under compute-sanitizer
#           (bash bench/build_stop_plans.sh next80-q4 next80-q4-noroute next4-q4, at commit 5cfc1de: the fold was
#            removed after call 1, and with it the rule and the -noroute plans)
#   models  every plan at this stop's rules, A B ... ... B A (kestrel-run --bench: greedy, and sampled at temperature
#           0.7 / top-p 0.8 / top-k 20 in its JSON); llama.cpp 0.8B bf16 / Q4_0 and 2B Q4_0 in the same call (carry
#           .peers) (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-bf16 2b-q4 4b-q4 9b-q4 27b-q4 next80-q4)
#   profiles each plan's --profile (per kernel: alone, in the graph, its floor and the time over it); 27B bf16
#           A ... A (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-bf16 2b-q4 27b-q4 27b-bf16 next80-q4)
#   swiglu  bench/norm_matvec_probe.py NMP_MODEL=swiglu: the normed q4 gate / up pair at the 0.8B / 2B / 4B / 9B MLP
#           shapes over 202 splits (here: cd bench && NMP_MODEL=swiglu python norm_matvec_probe.py compile
#           norm-matvec-swiglu; carry bench/norm-matvec-swiglu)
#   small   bench/norm_matvec_probe.py NMP_MODEL=small: matvec_add at the 0.8B-9B output / down projections and
#           rmsnorm_matvec at their GDN in_proj over 520 splits (here: cd bench && NMP_MODEL=small python
#           norm_matvec_probe.py compile norm-matvec-small; carry bench/norm-matvec-small)
#   add8    (prepared, not run: the device budget ran out) call 11's splits for the q4 products with fewer rows as a
#           whole step, A B B A: matvec.q4_ctas_per_sm=2 (4B's 2560-row products at 8 rows) and q4_long_k=16384 (9B's
#           down at 1024 inputs a tile) (bash bench/build_stop_plans.sh 4b-q4 9b-q4 4b-q4-add8 9b-q4-add8)
#   pair    the normed q4 gate / up pair on call 7's splits (matvec.q4_pair_norm) against the rule before
#           (-pair0), A B B A: 2B, 4B, 9B q4; 4 layers of the 2B shape against the CPU reference and under
#           compute-sanitizer (bash bench/build_stop_plans.sh 2b-q4 4b-q4 9b-q4 2b-q4-pair0 4b-q4-pair0 9b-q4-pair0
#           small2b4-q4)
#   next    llama.cpp on the whole 80B-A3B shape (Q4_0, bench/llamacpp_next.sh) and Kestrel's 80B-A3B q4 in the same
#           call (carry .peers; bash bench/build_stop_plans.sh next80-q4)
# There: run(carry=["bench/plans", ".peers"]): bash bench/device_stop40.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
profile() {  # PLAN: kestrel-run --profile, the in-graph table printed
  timeout 150 kestrel-run "bench/plans/$1.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$1.json" \
    > "$out/profile-$1.txt" 2>&1; echo "$1: exit $?"; grep -A22 "^in the graph" "$out/profile-$1.txt" | head -24
  grep "^\[gpu\]" "$out/profile-$1.txt" | head -1
}
probe() {  # MODE SECONDS: bench/norm_matvec_probe.py NMP_MODEL=MODE on bench/norm-matvec-MODE's cubins (carried); each
  # shape's rule row and its fastest splits printed
  (cd bench && NMP_MODEL=$1 timeout $2 python3 norm_matvec_probe.py time norm-matvec-$1 "$out/$1.json" > "$out/$1.txt" 2>&1)
  echo "probe: exit $?"; grep "(rule)" "$out/$1.txt"
  python3 -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
for s in dict.fromkeys(r['shape'] for r in rows):
    best = sorted((r for r in rows if r['shape'] == s), key=lambda r: r['us'])[:4]
    print(s, [(r['BLOCK_N'], r['BLOCK_K'], r['warps'], round(r['us'], 2), '%.1e' % r['rel_err']) for r in best])
" "$out/$1.json"
}
case $2 in
  route)
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=150 PAIRS="qwen3-next-80b-a3b-sm90-q4-noroute:qwen3-next-80b-a3b-sm90-q4" bash bench/device_preload_ab.sh "$out"
    profile qwen3-next-80b-a3b-sm90-q4
    STEP_TIMEOUT=200 SANITIZE="qwen3-next-4l-sm90-q4" E2E="qwen3-next-4l-sm90-q4" bash bench/device_preload_ab.sh "$out/e2e" ;;
  models)
    here=../shared/peers/llamacpp; [ -f "$here/device.sh" ] || here=.peers/llamacpp-scripts
    nice -n 19 bash "$here/device.sh" .peers/llamacpp.tar.xz /tmp/peer > /tmp/llamacpp-build.txt 2>&1 &
    build=$!
    STEP_TIMEOUT=120 SEQ="qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-bf16 qwen3.5-2b-sm90-q4 qwen3.5-4b-sm90-q4 qwen3.5-9b-sm90-q4 qwen3.5-27b-sm90-q4 qwen3-next-80b-a3b-sm90-q4" \
      bash bench/device_preload_ab.sh "$out"
    wait $build; tail -2 /tmp/llamacpp-build.txt
    PP=512 TG=128 REPS=3 timeout 200 bash "$here/device.sh" .peers/llamacpp.tar.xz "$out" qwen3.5-0.8b:bf16 qwen3.5-0.8b:q4_0 \
      qwen3.5-2b:q4_0 ;;
  profiles)
    for p in qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-bf16 qwen3.5-2b-sm90-q4 qwen3.5-27b-sm90-q4 qwen3.5-27b-sm90-bf16 \
             qwen3-next-80b-a3b-sm90-q4; do profile $p; done
    (cd "$out" && tar cf profiles.tar profile-* && rm -f profile-*)  # (a call returns 8 files at most)
    STEP_TIMEOUT=150 SEQ="qwen3.5-27b-sm90-bf16" bash bench/device_preload_ab.sh "$out" ;;
  swiglu) probe swiglu 500 ;;
  small) probe small 300 ;;
  add8)
    STEP_TIMEOUT=100 PAIRS="qwen3.5-4b-sm90-q4:qwen3.5-4b-sm90-q4-add8 qwen3.5-9b-sm90-q4:qwen3.5-9b-sm90-q4-add8" \
      bash bench/device_preload_ab.sh "$out" ;;
  pair)
    STEP_TIMEOUT=150 PAIRS="qwen3.5-2b-sm90-q4-pair0:qwen3.5-2b-sm90-q4 qwen3.5-4b-sm90-q4-pair0:qwen3.5-4b-sm90-q4 qwen3.5-9b-sm90-q4-pair0:qwen3.5-9b-sm90-q4" \
      SANITIZE="qwen3.5-small2b4-sm90-q4" E2E="qwen3.5-small2b4-sm90-q4" bash bench/device_preload_ab.sh "$out" ;;
  next)
    PP=512 TG=128 REPS=3 CLEAN=1 timeout 480 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$out" qwen3-next-80b-a3b
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4" bash bench/device_preload_ab.sh "$out" ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
