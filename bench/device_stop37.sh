#!/usr/bin/env bash
# Prepared in stop 36 for the next device calls (each under the 10-minute limit):
#   moedown  moe_down's routed and shared experts' rows asked of the L2 before its PDL wait (moe.down_prefetch,
#            written in stop 36, untimed; stop 35's 80B-A3B profile: moe_down_add 7.95 us a layer in the graph for
#            ~5.6 MB): 80B-A3B q4, rule against `-dpf`, A B B A; 4 layers with it against the CPU reference and
#            under compute-sanitizer
#            (bash bench/build_stop_plans.sh next80-q4 next80-q4-dpf next4-q4-dpf)
#   pdl      why programmatic edges lose at 2B q4 (the load-time trial: 0.91 against 0.80 ms plain, stop 36 call 6)
#            while they win at 0.8B: each kernel's cost in the graph (kestrel-run --profile) with KESTREL_PDL=1 and 0
#            (bash bench/build_stop_plans.sh 2b-q4 0.8b-q4)
#   specpdl  the speculative iteration's graph with programmatic edges against plain ones (device_spec.py's SPEC_PDL;
#            stop 22: -1.2% at 27B q4, -2.2% at 0.8B bf16, so the runtime keeps plain edges; the iteration's kernels
#            have changed since, and issue 12's verify / step ratio as graphs is 1.22x against 1.15x kernel by kernel)
#            (bash bench/build_stop_plans.sh 27b-q4-spec3 0.8b-bf16-spec3)
#   attn     attn_step's short-context latency (stop 37: the queries normed and roped as REP rows, not 16; pos, its RoPE
#            angles and the split's K / V rows in the L2 before the PDL wait): the kernel alone at the three head
#            shapes (bench/attn_step_probe.py, its variants), then 0.8B and 27B q4 whole steps against `-attnold`,
#            A B B A; small4 q4 against the CPU reference and under compute-sanitizer; the 0.8B q4 profile
#            (python3 bench/attn_step_probe.py compile bench/attn-step-probe;
#             bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-attnold 27b-q4 27b-q4-attnold small4-q4)
#   attn2    (call 2) the same after call 1, with the loads issued together after the wait instead of pos before it:
#            0.8B q4 base (badb274's kernels) / rule / no prefetch / 16 query rows, A B C D D C B A; 27B q4 base
#            against the rule (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-attnold 0.8b-q4-attnpf0 0.8b-q4-base
#            27b-q4 27b-q4-base small4-q4)
#   attn3    (call 3) the final attn_step (no K / V prefetch) against badb274's kernels: 0.8B q4 and bf16 (A B C D D C
#            B A), 27B q4 (A B B A), 80B-A3B q4 with moe.down_prefetch too (base, rule, -dpf, and back); small4 q4 and
#            4 layers of 80B-A3B (-dpf) against the CPU reference and under compute-sanitizer; the probe
#            (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-base 0.8b-bf16 0.8b-bf16-base 27b-q4 27b-q4-base next80-q4
#             next80-q4-base next80-q4-dpf next4-q4-dpf small4-q4)
#   pdl2     (call 4) programmatic edges at 2B-9B q4 with the matvecs letting the next kernel launch after their K
#            loop from 1 / 4 MiB of weight (matvec.pdl_late_bytes; 32 MiB by rule): each bench line's load-time trial
#            times both edges (bash bench/build_stop_plans.sh 2b-q4 2b-q4-late1 2b-q4-late4 4b-q4 4b-q4-late1 9b-q4
#            9b-q4-late1)
#   late     (call 5) the same at every other size, A B (C D) D C B A or A B B A: 0.8B q4 / bf16, 2B / 9B bf16, 27B q4 /
#            bf16, 80B-A3B q4 against 1 MiB; 4 layers of 80B-A3B bf16 against the CPU reference (attn_step's queries
#            at REP 8) (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-late1 0.8b-bf16 0.8b-bf16-late1 27b-q4
#            27b-q4-late1 27b-bf16 27b-bf16-late1 next80-q4 next80-q4-late1 2b-bf16 2b-bf16-late1 9b-bf16
#            9b-bf16-late1 next4-bf16)
#   models   (call 6) every plan at this stop's rules, the step graph chosen at load among plain, programmatic and
#            programmatic with the late-trigger kernels (compiler/codegen.py), A B ... ... B A; llama.cpp 0.8B bf16 /
#            Q4_0 and 2B Q4_0 in the same call (carry .peers too)
#            (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-bf16 2b-q4 4b-q4 9b-q4 27b-q4 next80-q4)
# (moe.down_prefetch lost in call 3 and was removed after it: the -dpf plans of moedown / attn3 need commit 8b3dd54)
# There: run(carry=["bench/plans"]): bash bench/device_stop37.sh $OUT PART (attn: carry bench/attn-step-probe too)
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
case $2 in
  models)
    here=../shared/peers/llamacpp; [ -f "$here/device.sh" ] || here=.peers/llamacpp-scripts
    nice -n 19 bash "$here/device.sh" .peers/llamacpp.tar.xz /tmp/peer > /tmp/llamacpp-build.txt 2>&1 &
    build=$!
    STEP_TIMEOUT=120 SEQ="qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-bf16 qwen3.5-2b-sm90-q4 qwen3.5-4b-sm90-q4 qwen3.5-9b-sm90-q4 qwen3.5-27b-sm90-q4 qwen3-next-80b-a3b-sm90-q4" \
      bash bench/device_preload_ab.sh "$out"
    wait $build; tail -2 /tmp/llamacpp-build.txt
    PP=512 TG=128 REPS=3 timeout 240 bash "$here/device.sh" .peers/llamacpp.tar.xz "$out" qwen3.5-0.8b:bf16 qwen3.5-0.8b:q4_0 \
      qwen3.5-2b:q4_0 ;;
  late)
    mkdir -p "$out/a" "$out/b" "$out/c" "$out/d"
    STEP_TIMEOUT=120 SEQ="qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-q4-late1 qwen3.5-0.8b-sm90-bf16 qwen3.5-0.8b-sm90-bf16-late1" \
      bash bench/device_preload_ab.sh "$out/a"
    STEP_TIMEOUT=120 SEQ="qwen3.5-2b-sm90-bf16 qwen3.5-2b-sm90-bf16-late1 qwen3.5-9b-sm90-bf16 qwen3.5-9b-sm90-bf16-late1" \
      bash bench/device_preload_ab.sh "$out/b"
    STEP_TIMEOUT=150 PAIRS="qwen3.5-27b-sm90-q4:qwen3.5-27b-sm90-q4-late1 qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-sm90-q4-late1" \
      bash bench/device_preload_ab.sh "$out/c"
    STEP_TIMEOUT=200 PAIRS="qwen3.5-27b-sm90-bf16:qwen3.5-27b-sm90-bf16-late1" E2E="qwen3-next-4l-sm90-bf16" \
      bash bench/device_preload_ab.sh "$out/d" ;;
  pdl2)
    mkdir -p "$out/a" "$out/b" "$out/c"
    STEP_TIMEOUT=120 SEQ="qwen3.5-2b-sm90-q4 qwen3.5-2b-sm90-q4-late1 qwen3.5-2b-sm90-q4-late4" bash bench/device_preload_ab.sh "$out/a"
    STEP_TIMEOUT=120 SEQ="qwen3.5-4b-sm90-q4 qwen3.5-4b-sm90-q4-late1" bash bench/device_preload_ab.sh "$out/b"
    STEP_TIMEOUT=120 SEQ="qwen3.5-9b-sm90-q4 qwen3.5-9b-sm90-q4-late1" bash bench/device_preload_ab.sh "$out/c" ;;
  attn3)
    (cd bench && timeout 100 python3 attn_step_probe.py time attn-step-probe "$out/attn-step.json" > "$out/attn-step.txt" 2>&1)
    echo "probe: exit $?"; grep -A8 "^   model" "$out/attn-step.txt"
    mkdir -p "$out/a" "$out/b"
    STEP_TIMEOUT=200 SEQ="qwen3.5-0.8b-sm90-q4-base qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-bf16-base qwen3.5-0.8b-sm90-bf16" \
      PAIRS="qwen3.5-27b-sm90-q4-base:qwen3.5-27b-sm90-q4" SANITIZE="qwen3.5-small4-sm90-q4" E2E="qwen3.5-small4-sm90-q4" \
      bash bench/device_preload_ab.sh "$out/a"
    STEP_TIMEOUT=200 SEQ="qwen3-next-80b-a3b-sm90-q4-base qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-dpf" \
      SANITIZE="qwen3-next-4l-sm90-q4-dpf" E2E="qwen3-next-4l-sm90-q4-dpf" bash bench/device_preload_ab.sh "$out/b" ;;
  attn2)
    (cd bench && timeout 150 python3 attn_step_probe.py time attn-step-probe "$out/attn-step.json" > "$out/attn-step.txt" 2>&1)
    echo "probe: exit $?"; grep -A20 "^   model" "$out/attn-step.txt"
    STEP_TIMEOUT=200 SEQ="qwen3.5-0.8b-sm90-q4-base qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-q4-attnpf0 qwen3.5-0.8b-sm90-q4-attnold" \
      PAIRS="qwen3.5-27b-sm90-q4-base:qwen3.5-27b-sm90-q4" SANITIZE="qwen3.5-small4-sm90-q4" E2E="qwen3.5-small4-sm90-q4" \
      bash bench/device_preload_ab.sh "$out"
    p=qwen3.5-0.8b-sm90-q4
    timeout 100 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
      > "$out/profile-$p.txt" 2>&1; echo "$p: exit $?"; grep -A14 "^in the graph" "$out/profile-$p.txt" ;;
  attn)
    (cd bench && timeout 150 python3 attn_step_probe.py time attn-step-probe "$out/attn-step.json" > "$out/attn-step.txt" 2>&1)
    echo "probe: exit $?"; tail -4 "$out/attn-step.txt"; grep -A20 "^   model" "$out/attn-step.txt"
    STEP_TIMEOUT=200 PAIRS="qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-attnold qwen3.5-27b-sm90-q4:qwen3.5-27b-sm90-q4-attnold" \
      SANITIZE="qwen3.5-small4-sm90-q4" E2E="qwen3.5-small4-sm90-q4" bash bench/device_preload_ab.sh "$out"
    p=qwen3.5-0.8b-sm90-q4
    timeout 100 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
      > "$out/profile-$p.txt" 2>&1; echo "$p: exit $?"; grep -A14 "^in the graph" "$out/profile-$p.txt" ;;
  moedown)
    STEP_TIMEOUT=200 PAIRS="qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-sm90-q4-dpf" \
      SANITIZE="qwen3-next-4l-sm90-q4-dpf" E2E="qwen3-next-4l-sm90-q4-dpf" bash bench/device_preload_ab.sh "$out"
    p=qwen3-next-80b-a3b-sm90-q4-dpf
    timeout 120 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
      > "$out/profile-$p.txt" 2>&1; echo "$p: exit $?"; grep -A16 "^in the graph" "$out/profile-$p.txt" ;;
  specpdl)
    for p in qwen3.5-27b-sm90-q4-spec3 qwen3.5-0.8b-sm90-bf16-spec3; do
      SPEC_PDL=1 timeout 250 python3 bench/device_spec.py "$out/spec-pdl-$p.json" "bench/plans/$p.plan" > "$out/spec-pdl-$p.txt" 2>&1
      echo "$p: exit $?"; grep -E "spec==plain|verify at|as graphs" "$out/spec-pdl-$p.txt"
      python3 -c "import json, sys; r = json.load(open(sys.argv[1]))[0]; print('iteration ms plain', r['rounds'].get('iteration_plain'), 'programmatic', r['rounds'].get('iteration_pdl'), 'same tokens', r.get('pdl_equals_plain'), 'runtime kept programmatic', r.get('runtime_kept_programmatic'), r.get('spec_pdl_trial_ms'))" "$out/spec-pdl-$p.json"
    done ;;
  pdl)
    for p in qwen3.5-2b-sm90-q4 qwen3.5-0.8b-sm90-q4; do
      for e in 1 0; do
        KESTREL_PDL=$e timeout 120 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 \
          --profile "$out/profile-$p-pdl$e.json" > "$out/profile-$p-pdl$e.txt" 2>&1
        echo "$p KESTREL_PDL=$e: exit $?"; grep -A14 "^in the graph" "$out/profile-$p-pdl$e.txt"; grep "^\[gpu\]" "$out/profile-$p-pdl$e.txt" | head -1
      done
    done ;;
esac
