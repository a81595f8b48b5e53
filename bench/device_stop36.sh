#!/usr/bin/env bash
# Stop 36's device calls (bench/results/stop36/README.md gives each call's figures), one part per call:
#   diff     which ops of the 80B-A3B shape's speculative verify compute row 0 differently from the one-token step
#            (stop 35: the 80B-A3B q4 K = 3 plan is not exact): bench/device_row_diff.py on the 4-layer q4 and bf16
#            K = 3 plans (bash bench/build_stop_plans.sh next4-q4-spec3 next4-bf16-spec3)
#   norm     the normed q4 matvec's many-rows split (matvec.q4_wide_norm_block_n / _warps): the whole 27B q4 step, the
#            rule's 16 x 1 then against `27b-q4-norm32` (32 x 2, the default since), A B B A (kestrel-run --bench)
#            (bash bench/build_stop_plans.sh 27b-q4 27b-q4-norm32)
#   spec80   the same diff after this stop's unfold of the MoE chains at one row (passes/fold_row_norms.py), then
#            bench/device_spec_exactness.py and device_spec.py on the 80B-A3B q4 and 0.8B bf16 K = 3 plans
#            (bash bench/build_stop_plans.sh next4-q4-spec3 next4-bf16-spec3 next80-q4-spec3 0.8b-bf16-spec3)
#   prefetch the q4 matvecs' L2 prefetch before the PDL wait (matvec.l2_prefetch_bytes): 27B q4 at 0 / 24 / 64 MiB
#            (A B C C B A), 0.8B q4 at 0 / 24 MiB, compute-sanitizer on 4 layers of 27B at 64 MiB
#            (bash bench/build_stop_plans.sh 27b-q4 27b-q4-pf24 27b-q4-pf64 0.8b-q4 0.8b-q4-pf24 27b4-q4-pf64)
#   prefetch2 the same at 0 / 8 / 16 MiB on 2B / 4B q4, 0 / 8 / 24 on 9B q4, 0 / 24 on 0.8B bf16, 0 / 16 on 80B-A3B q4
#            (bash bench/build_stop_plans.sh 0.8b-bf16 0.8b-bf16-pf24 2b-q4 2b-q4-pf8 2b-q4-pf16 4b-q4 4b-q4-pf8
#             4b-q4-pf16 9b-q4 9b-q4-pf8 9b-q4-pf24 next80-q4-decode next80-q4-decode-pf16)
#            (calls 4-5 ran with the field's default at 0, so the unsuffixed plans were the "none" column, and with
#            bf16 matrices prefetching too; since, the default is 4.5 MiB and bf16 never prefetches: use pf0 plans)
#   prefetch3 the rule (4.5 MiB, q4) against none on 0.8B / 2B / 80B-A3B q4; 0.8B q4 against the CPU reference
#            (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-pf0 2b-q4 2b-q4-pf0 next80-q4-decode next80-q4-decode-pf0)
#   check    small4 q4 (4 layers of 0.8B, every q4 matrix prefetching) against the CPU reference and under
#            compute-sanitizer; 27B q4 and 0.8B q4 profiles (bash bench/build_stop_plans.sh small4-q4 27b-q4 0.8b-q4)
#   models   27B q4, 0.8B bf16 / q4, 80B-A3B q4 at this stop's rules, and llama.cpp at 0.8B in the same call
#            (bash bench/build_stop_plans.sh 27b-q4 0.8b-bf16 0.8b-q4 next80-q4; run(carry=["bench/plans", ".peers"]))
# There: run(carry=["bench/plans"]): bash bench/device_stop36.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  norm)
    STEP_TIMEOUT=150 PAIRS="qwen3.5-27b-sm90-q4:qwen3.5-27b-sm90-q4-norm32" bash bench/device_preload_ab.sh "$out" ;;
  prefetch)  # matvec.l2_prefetch_bytes: none against 24 MiB and 64 MiB; sanitizer on 4 layers at 64 MiB
    STEP_TIMEOUT=150 SEQ="qwen3.5-27b-sm90-q4 qwen3.5-27b-sm90-q4-pf24 qwen3.5-27b-sm90-q4-pf64" \
      PAIRS="qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-pf24" SANITIZE="qwen3.5-27b-4l-sm90-q4-pf64" \
      bash bench/device_preload_ab.sh "$out" ;;
  prefetch2)  # the L2 prefetch at 0 / 8 / 16 (24) MiB on 2B / 4B / 9B q4 (A B C C B A), 0.8B bf16 and 80B-A3B q4 pairs
    STEP_TIMEOUT=150 PAIRS="qwen3.5-0.8b-sm90-bf16:qwen3.5-0.8b-sm90-bf16-pf24 qwen3-next-80b-a3b-sm90-q4-decode:qwen3-next-80b-a3b-sm90-q4-decode-pf16" \
      bash bench/device_preload_ab.sh "$out"; mv "$out/ab.tar" "$out/ab-pairs.tar"
    for m in 2b 4b 9b; do
      t=16; [ $m = 9b ] && t=24
      STEP_TIMEOUT=150 SEQ="qwen3.5-$m-sm90-q4 qwen3.5-$m-sm90-q4-pf8 qwen3.5-$m-sm90-q4-pf$t" bash bench/device_preload_ab.sh "$out"
      mv "$out/ab.tar" "$out/ab-$m.tar"
    done ;;
  prefetch3)  # the rule's 4.5 MiB (q4 only) against none, and the 0.8B q4 plan against the CPU reference
    STEP_TIMEOUT=150 PAIRS="qwen3.5-0.8b-sm90-q4-pf0:qwen3.5-0.8b-sm90-q4 qwen3.5-2b-sm90-q4-pf0:qwen3.5-2b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-decode-pf0:qwen3-next-80b-a3b-sm90-q4-decode" \
      E2E="qwen3.5-0.8b-sm90-q4" bash bench/device_preload_ab.sh "$out" ;;
  check)  # the L2 prefetch's plan shape (small4: every q4 matrix prefetching) against the CPU reference and under
    # compute-sanitizer; the 27B q4 and 0.8B q4 profiles at this stop's rules
    STEP_TIMEOUT=300 SANITIZE="qwen3.5-small4-sm90-q4" E2E="qwen3.5-small4-sm90-q4" bash bench/device_preload_ab.sh "$out"
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    for p in qwen3.5-27b-sm90-q4 qwen3.5-0.8b-sm90-q4; do
      timeout 120 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
        > "$out/profile-$p.txt" 2>&1; echo "$p: exit $?"; grep -A14 "^in the graph" "$out/profile-$p.txt"; grep "^\[gpu\]" "$out/profile-$p.txt"
    done ;;
  models)  # this stop's rules: each plan's ms/token (A B C D D C B A), llama.cpp at 0.8B in the same call
    here=../shared/peers/llamacpp; [ -f "$here/device.sh" ] || here=.peers/llamacpp-scripts
    nice -n 19 bash "$here/device.sh" .peers/llamacpp.tar.xz /tmp/peer > /tmp/llamacpp-build.txt 2>&1 &
    build=$!
    STEP_TIMEOUT=120 SEQ="qwen3.5-27b-sm90-q4 qwen3.5-0.8b-sm90-bf16 qwen3.5-0.8b-sm90-q4 qwen3-next-80b-a3b-sm90-q4" \
      bash bench/device_preload_ab.sh "$out"
    wait $build; tail -2 /tmp/llamacpp-build.txt
    PP=512 TG=128 REPS=3 timeout 300 bash "$here/device.sh" .peers/llamacpp.tar.xz "$out" qwen3.5-0.8b:bf16 qwen3.5-0.8b:q4_0 ;;
  spec80)  # after the MoE chains' unfold (passes/fold_row_norms.py): row diff, 80B-A3B q4 K = 3 exactness and speed
    python3 bench/device_row_diff.py "$out/row-diff-next4.json" bench/plans/qwen3-next-4l-sm90-q4-spec3.plan \
      bench/plans/qwen3-next-4l-sm90-bf16-spec3.plan 2>&1 | tail -30
    timeout 240 python3 bench/device_spec_exactness.py "$out/exactness.json" \
      bench/plans/qwen3-next-80b-a3b-sm90-q4-spec3.plan bench/plans/qwen3.5-0.8b-sm90-bf16-spec3.plan 2>&1 | tail -8
    for p in qwen3-next-80b-a3b-sm90-q4-spec3 qwen3.5-0.8b-sm90-bf16-spec3; do
      timeout 150 python3 bench/device_spec.py "$out/spec-$p.json" "bench/plans/$p.plan" > "$out/spec-$p.txt" 2>&1
      echo "$p: exit $?"; grep -E "spec==plain|verify at|as graphs|^ +[01]\.[0-9]  " "$out/spec-$p.txt"
    done ;;
  diff)
    python3 bench/device_row_diff.py "$out/row-diff-next4.json" bench/plans/qwen3-next-4l-sm90-q4-spec3.plan \
      bench/plans/qwen3-next-4l-sm90-bf16-spec3.plan 2>&1 | tail -40 ;;
esac
