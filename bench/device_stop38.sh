#!/usr/bin/env bash
# Prepared in stop 37 for the next device calls (each under the 10-minute limit):
#   pf       the q4 L2 prefetch (matvec.l2_prefetch_bytes, 4.5 MiB: only 0.8B's matrices) at 2B-9B q4 now that their
#            step graphs keep programmatic edges with the late-trigger kernels (stop 36 measured it on plain edges,
#            where nothing runs before the wait, and it lost): rule against 8 / 16 MiB, A B C C B A
#            (bash bench/build_stop_plans.sh 2b-q4 2b-q4-pf8 2b-q4-pf16 4b-q4 4b-q4-pf8 4b-q4-pf16 9b-q4 9b-q4-pf8
#             9b-q4-pf16)
#   specpdl  bench/device_stop37.sh specpdl (prepared in stop 36, not yet run)
#   spec     (call 1) specpdl, then the runtime's own choice of the iteration graph's edges (GpuStep's load-time
#            trial) checked: greedy speculative tokens against plain ones through the graphs it kept (0.8B bf16,
#            128 tokens x 3 prompts), and compute-sanitizer over tiny-mtp q4's graphs, greedy (against plain) and
#            sampled
#            (bash bench/build_stop_plans.sh 27b-q4-spec3 0.8b-bf16-spec3 tiny-mtp-q4-spec3)
#   gather   (call 3) moe_down's gathered form (every routed expert's q4 rows in one tile: the MoeRule's down_gather):
#            the kernel alone at the 80B-A3B shape against the unrolled forms (MOE_SWEEP_KINDS=down_add python
#            bench/moe_sweep.py compile bench/moe-sweep-gather), the whole 80B-A3B q4 step rule / (8, 4) / (4, 2),
#            A B C C B A; 4 layers with (8, 4) against the CPU reference, and its K = 3 plan under compute-sanitizer
#            (carry bench/moe-sweep-gather too: git-ignored since, as the other probes' cubin folders)
#            and against plain decoding (bash bench/build_stop_plans.sh next80-q4 next80-q4-g8x4 next80-q4-g4x2
#            next4-q4-g8x4 next4-q4-spec3-g8x4)
#   gather2  (call 4) the gathered form's tiles in the whole 80B-A3B q4 step: (8, 4) / (8, 8) / (16, 8), A B C C B A,
#            then the rule's plan (bash bench/build_stop_plans.sh next80-q4 next80-q4-g8x4 next80-q4-g8x8
#            next80-q4-g16x8) profiled
#   nmp80    (call 5) the q4 matvec's splits at the 80B-A3B shapes (the normed in_proj 12352 x 2048 at 8.5 us a launch in
#            the step's graph, stop 38 call 4: 35% of the bandwidth; attention's q|gate|k|v; the out_proj's 2048 x 4096
#            as the plain matvec): NMP_MODEL=80b python bench/norm_matvec_probe.py compile bench/norm-matvec-80b (carry it)
#   nshort   (call 6) the normed q4 products at hidden 2048 by the new rule (matvec.q4_norm_short_k / _wide: in_proj 16
#            rows x 2 warps, the fewer-rows ones in one 2048-input tile) against the old (-nshort0): 80B-A3B q4 and 2B q4,
#            A B B A each; 4 layers of the 2B shape and of the 80B-A3B shape against the CPU reference
#            (bash bench/build_stop_plans.sh next80-q4 next80-q4-nshort0 2b-q4 2b-q4-nshort0 small2b4-q4 next4-q4)
#   models   (call 7) every plan at this stop's rules, A B ... ... B A; 4 layers of the 80B-A3B shape against the CPU
#            reference (call 6's timed out at 150 s), small2b4 q4 under compute-sanitizer
#            (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-bf16 2b-q4 27b-q4 next80-q4 next4-q4 small2b4-q4)
#   snap     (call 8) the verify's gdn_rows_norm_snap at one row a program (gdn_rows.snap_norm_block_m = 1) against all
#            K + 1 rows in one (-snapm16, before): bench/device_spec.py on 27B q4 K = 3 (A B B A) and 0.8B bf16 (A B),
#            its verify / step ratio kernel by kernel and as graphs, spec == plain; tiny-mtp q4 under compute-sanitizer
#            (bash bench/build_stop_plans.sh 27b-q4-spec3 27b-q4-spec3-snapm16 0.8b-bf16-spec3 0.8b-bf16-spec3-snapm16
#             tiny-mtp-q4-spec3)
#   next     (call 9) Qwen3-Next speculation at this stop's rules: the 80B-A3B q4 K = 3 plan through bench/device_spec.py
#            (controlled acceptance, verify / step), 4 layers of it: greedy speculative = plain (2 prompts x 64) and
#            compute-sanitizer (bash bench/build_stop_plans.sh next80-q4-spec3 next4-q4-spec3)
#   early    (call 10) 27B q4's big matvecs before attention and the GDN step triggering at their start
#            (matvec.pdl_early_before; attn_step costs 16.4 us a layer in the step's graph, 8.4 alone): rule / both /
#            attention only, A B C C B A (bash bench/build_stop_plans.sh 27b-q4 27b-q4-early 27b-q4-earlyattn)
#   final    (call 11) the 27B q4 plan as the default build makes it now (the early triggers by rule), and 4 layers of
#            the 27B shape (its q4 in_proj late by bytes, so early before gdn_delta) under compute-sanitizer
#            (bash bench/build_stop_plans.sh 27b-q4 27b4-q4)
#   earlybf16 (prepared, not run) pdl_early_before for bf16 too (matvec.pdl_early_q4_only=False): 27B and 9B bf16,
#            rule against -early, A B B A each (bash bench/build_stop_plans.sh 27b-bf16 27b-bf16-early 9b-bf16
#            9b-bf16-early)
# There: run(carry=["bench/plans"]): bash bench/device_stop38.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  pf)
    for m in 2b 4b 9b; do
      d=$out/$m; mkdir -p "$d"
      STEP_TIMEOUT=120 SEQ="qwen3.5-$m-sm90-q4 qwen3.5-$m-sm90-q4-pf8 qwen3.5-$m-sm90-q4-pf16" bash bench/device_preload_ab.sh "$d"
    done ;;
  specpdl)
    bash bench/device_stop37.sh "$out" specpdl ;;
  earlybf16)
    STEP_TIMEOUT=200 PAIRS="qwen3.5-27b-sm90-bf16:qwen3.5-27b-sm90-bf16-early qwen3.5-9b-sm90-bf16:qwen3.5-9b-sm90-bf16-early" \
      bash bench/device_preload_ab.sh "$out" ;;
  final)
    STEP_TIMEOUT=150 SANITIZE="qwen3.5-27b-4l-sm90-q4" PAIRS="qwen3.5-27b-sm90-q4:qwen3.5-27b-sm90-q4" \
      bash bench/device_preload_ab.sh "$out" ;;
  early)
    STEP_TIMEOUT=150 SEQ="qwen3.5-27b-sm90-q4 qwen3.5-27b-sm90-q4-early qwen3.5-27b-sm90-q4-earlyattn" \
      bash bench/device_preload_ab.sh "$out" ;;
  next)
    p=qwen3-next-80b-a3b-sm90-q4-spec3
    timeout 200 python3 bench/device_spec.py "$out/spec-$p.json" "bench/plans/$p.plan" > "$out/spec-$p.txt" 2>&1
    echo "$p: exit $?"; grep -E "spec==plain|verify at|as graphs|^verify by|^M=1 step by|^ +[01]\.[0-9] " "$out/spec-$p.txt" | cut -c1-400
    p=bench/plans/qwen3-next-4l-sm90-q4-spec3.plan
    KESTREL_EXACT_NEW=64 KESTREL_EXACT_PROMPTS=2 timeout 100 python3 bench/device_spec_exactness.py "$out/spec-exact.json" $p \
      > "$out/spec-exact.txt" 2>&1; echo "spec exactness: exit $?"; tail -2 "$out/spec-exact.txt"
    KESTREL_SPEC_SAMPLING=1 timeout 100 compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py $p \
      > "$out/sanitizer-next4.txt" 2>&1; echo "sanitizer: exit $?"; tail -1 "$out/sanitizer-next4.txt" ;;
  snap)
    n=0
    for p in qwen3.5-27b-sm90-q4-spec3-snapm16 qwen3.5-27b-sm90-q4-spec3 qwen3.5-27b-sm90-q4-spec3 qwen3.5-27b-sm90-q4-spec3-snapm16 \
             qwen3.5-0.8b-sm90-bf16-spec3-snapm16 qwen3.5-0.8b-sm90-bf16-spec3; do
      n=$((n + 1))
      timeout 150 python3 bench/device_spec.py "$out/spec-$n-$p.json" "bench/plans/$p.plan" > "$out/spec-$n-$p.txt" 2>&1
      echo "$n $p: exit $?"; grep -E "spec==plain|verify at|as graphs|^verify by|^M=1 step by" "$out/spec-$n-$p.txt" | cut -c1-400
    done
    KESTREL_SPEC_SAMPLING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py \
      bench/plans/tiny-mtp-sm90-q4-spec3.plan > "$out/sanitizer-tiny-mtp.txt" 2>&1
    echo "sanitizer: exit $?"; tail -1 "$out/sanitizer-tiny-mtp.txt" ;;
  models)
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=150 SEQ="qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-bf16 qwen3.5-2b-sm90-q4 qwen3.5-27b-sm90-q4 qwen3-next-80b-a3b-sm90-q4" \
      bash bench/device_preload_ab.sh "$out"
    STEP_TIMEOUT=300 SANITIZE="qwen3.5-small2b4-sm90-q4" E2E="qwen3-next-4l-sm90-q4" bash bench/device_preload_ab.sh "$out/e2e" ;;
  nshort)
    STEP_TIMEOUT=150 PAIRS="qwen3-next-80b-a3b-sm90-q4-nshort0:qwen3-next-80b-a3b-sm90-q4 qwen3.5-2b-sm90-q4-nshort0:qwen3.5-2b-sm90-q4" \
      E2E="qwen3.5-small2b4-sm90-q4 qwen3-next-4l-sm90-q4" bash bench/device_preload_ab.sh "$out" ;;
  nmp80)
    (cd bench && NMP_MODEL=80b timeout 400 python3 norm_matvec_probe.py time norm-matvec-80b "$out/norm-matvec-80b.json" \
      > "$out/norm-matvec-80b.txt" 2>&1); echo "probe: exit $?"
    python3 -c "
import json, sys
rows = json.load(open(sys.argv[1]))['rows']
for key in sorted({(r['shape'], r['kind']) for r in rows}):
    rs = sorted((r for r in rows if (r['shape'], r['kind']) == key and r['rel_err'] < 1e-3), key=lambda r: r['us'])
    for r in rs[:4] + [r for r in rs if r['rule']]:
        print(*key, r['BLOCK_N'], r['BLOCK_K'], r['warps'], round(r['us'], 2), round(r['GBps']), 'rule' if r['rule'] else '')
" "$out/norm-matvec-80b.json" ;;
  gather2)
    STEP_TIMEOUT=150 SEQ="qwen3-next-80b-a3b-sm90-q4-g8x4 qwen3-next-80b-a3b-sm90-q4-g8x8 qwen3-next-80b-a3b-sm90-q4-g16x8" \
      bash bench/device_preload_ab.sh "$out"
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    p=qwen3-next-80b-a3b-sm90-q4
    timeout 150 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
      > "$out/profile-$p.txt" 2>&1; echo "$p: exit $?"; grep -A18 "^in the graph" "$out/profile-$p.txt"; grep "^\[gpu\]" "$out/profile-$p.txt" ;;
  gather)
    (cd bench && timeout 150 python3 moe_sweep.py time moe-sweep-gather "$out/moe-sweep-gather.json" > "$out/moe-sweep-gather.txt" 2>&1)
    echo "sweep: exit $?"; grep -A12 "^best per kernel" "$out/moe-sweep-gather.txt"
    STEP_TIMEOUT=150 SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-g8x4 qwen3-next-80b-a3b-sm90-q4-g4x2" \
      bash bench/device_preload_ab.sh "$out"
    p=bench/plans/qwen3-next-4l-sm90-q4-spec3-g8x4.plan
    KESTREL_EXACT_NEW=64 KESTREL_EXACT_PROMPTS=2 timeout 100 python3 bench/device_spec_exactness.py "$out/spec-exact.json" $p \
      > "$out/spec-exact.txt" 2>&1; echo "spec exactness: exit $?"; tail -2 "$out/spec-exact.txt"
    mkdir -p "$out/e2e"; STEP_TIMEOUT=150 SANITIZE="qwen3-next-4l-sm90-q4-spec3-g8x4" E2E="qwen3-next-4l-sm90-q4-g8x4" \
      bash bench/device_preload_ab.sh "$out/e2e" ;;
  spec)
    bash bench/device_stop37.sh "$out" specpdl
    KESTREL_EXACT_NEW=128 timeout 200 python3 bench/device_spec_exactness.py "$out/spec-exact.json" \
      bench/plans/qwen3.5-0.8b-sm90-bf16-spec3.plan > "$out/spec-exact.txt" 2>&1
    echo "exactness: exit $?"; tail -6 "$out/spec-exact.txt"
    timeout 200 compute-sanitizer --tool memcheck --print-limit 5 python3 -c "
import sys
from kestrel.artifacts.plan import load_plan
from kestrel.runtime.bench import SAMPLED
from kestrel.runtime.generate import SamplingParams, generate
from kestrel.runtime.gpu import GpuStep
step = GpuStep(load_plan(sys.argv[1]), use_graph=True)
print('iteration graph programmatic', step.spec_pdl, step.spec_pdl_trial, flush=True)
ids = [(i * 7919) % 300 + 3 for i in range(40)]
spec = generate(step, ids, 24, SamplingParams()).tokens
print('greedy', spec, flush=True)
print('sampled', generate(step, ids, 24, SAMPLED).tokens, flush=True)
k, step.spec_k = step.spec_k, 0
plain = generate(step, ids, 24, SamplingParams()).tokens
print('greedy spec == plain', spec == plain, flush=True)
" bench/plans/tiny-mtp-sm90-q4-spec3.plan > "$out/spec-sanitize.txt" 2>&1
    echo "sanitizer: exit $?"; grep -E "ERROR SUMMARY|iteration graph|greedy|sampled" "$out/spec-sanitize.txt" ;;
esac
