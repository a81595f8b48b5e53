#!/usr/bin/env bash
# The next device calls after stop 33 (issue 12's exactness, issue 13's figures on finite random weights), one part a
# call (each under the 10-minute limit; the machine is released after 30 s idle, so call the next part at once):
#   rowdiff  the verify's row 0 against the one-token step, op by op (bench/device_row_diff.py), on the 27B q4 plans
#            whose one-token products are the verify's (mma1row), and with the attention rows in step order too
#            (rowexact: attn_rows.step_order_rows=4): is the Gated DeltaNet rows kernel now the one-token step's
#            bit for bit (stop 33 changed gdn_rows_delta_snap; call 11 found it ~1 ulp apart), is the step-order
#            attention, and what differs next? Then how long greedy speculation stays on plain decoding's tokens
#            (bench/device_spec_exactness.py) for the default plan, mma1row and rowexact, and rowexact's sanitizer;
#   spec     the default 27B q4 K = 3 plan's controlled-acceptance table and verify cost (the GDN snapshot kernel's
#            extra reduction a row), compute-sanitizer on 4 layers of the 27B shape with the head;
#   models   27B q4 / 0.8B bf16 / 0.8B q4 / 80B-A3B q4 greedy and sampled ms/token on finite weights (A B B A),
#            and --profile's in-graph tables, while llama.cpp builds in the background (lowest priority); then
#            llama-bench on 0.8B bf16 and Q4_0 (issue 13's report: the peer in the same call);
#   peer27   on the still-warm machine: llama.cpp's 27B Q4_0 (its GGUF written there, ~7 min) and Kestrel's 27B q4
#            bench right after it.
#   exact    (written in stop 34, after rowdiff) the row diff and 256-token exactness (3 prompts) of the 27B q4 K = 3
#            plan whose twin kernels are compiled without FMA contraction (gdn_delta / gdn_rows_delta_snap, gdn_norm /
#            gdn_rows_norm_snap, attn_step / attn_rows_step: the rules' fp_fusion=False) on top of rowexact;
#            compute-sanitizer on its 4-layer twin; with AB=1 what no contraction costs plain decoding (27B q4 and 0.8B
#            q4 against the same plans with it, A B B A); the exact plan's controlled-acceptance table and verify
#            cost. Built with: bash bench/build_stop_plans.sh 27b-q4-spec3-exact 27b4-q4-spec3-exact 27b-q4 \
#            27b-q4-nofuse 0.8b-q4 0.8b-q4-nofuse
#   default  (stop 34, once speculative plans were built with exact_verify_rules by default) greedy exactness of the
#            default 27B q4 and bf16 K = 3 plans, the sanitizer on 4 layers of the bf16 one, and the bf16 plan's
#            controlled-acceptance table and verify cost (its verify's products now on the few-rows matvec at the
#            one-row split). Built with: bash bench/build_stop_plans.sh 27b-q4-spec3 27b-bf16-spec3 27b4-bf16-spec3
#   bf16     (stop 34, once such plans also unfold the one-token step's norms from its floating-point products:
#            matvec_rows.fold_one_row=False) the 27B bf16 K = 3 plan's row diff, greedy exactness and controlled-
#            acceptance table. Built with: bash bench/build_stop_plans.sh 27b-bf16-spec3
# Here:  bash bench/build_stop_plans.sh 27b-q4-spec3 27b-q4-spec3-mma1row 27b-q4-spec3-rowexact 27b4-q4-spec3 \
#          27b4-q4-spec3-rowexact 27b-q4 0.8b-bf16 0.8b-q4 next80-q4
#        bash ../shared/peers/llamacpp/fetch.sh .peers && mkdir -p .peers/llamacpp-scripts && \
#          cp ../shared/peers/llamacpp/* .peers/llamacpp-scripts/
# There: run(carry=["bench/plans"]): bash bench/device_stop34.sh $OUT rowdiff; ... spec;
#        run(carry=["bench/plans", ".peers"]): ... models; ... peer27 (at once, while the machine is warm)
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
P=bench/plans/qwen3.5-27b-sm90-q4-spec3
case $2 in
  rowdiff)
    timeout 150 python3 bench/device_row_diff.py "$out/row-diff.json" "$P-rowexact.plan" "$P-mma1row.plan" 2>&1 | tail -30
    timeout 200 python3 bench/device_spec_exactness.py "$out/exactness.json" "$P-rowexact.plan" "$P-mma1row.plan" \
      "$P.plan" 2>&1 | tail -10
    timeout 200 compute-sanitizer --tool memcheck --print-limit 5 --error-exitcode 1 python3 bench/device_spec_sanitize.py \
      bench/plans/qwen3.5-27b-4l-sm90-q4-spec3-rowexact.plan > "$out/sanitize-rowexact.txt" 2>&1
    echo "sanitizer (rowexact): exit $?"; tail -4 "$out/sanitize-rowexact.txt" ;;
  spec)
    timeout 300 python3 bench/device_spec.py "$out/spec-27b-q4.json" "$P.plan" > "$out/spec-27b-q4.txt" 2>&1
    echo "spec: exit $?"; grep -E "spec==plain|verify at|as graphs|^ +[01]\.[0-9]  " "$out/spec-27b-q4.txt"
    timeout 240 compute-sanitizer --tool memcheck --print-limit 5 --error-exitcode 1 python3 bench/device_spec_sanitize.py \
      bench/plans/qwen3.5-27b-4l-sm90-q4-spec3.plan > "$out/sanitize-27b4-q4-spec3.txt" 2>&1
    echo "sanitizer: exit $?"; tail -4 "$out/sanitize-27b4-q4-spec3.txt" ;;
  models)
    here=../shared/peers/llamacpp; [ -f "$here/device.sh" ] || here=.peers/llamacpp-scripts
    nice -n 19 bash "$here/device.sh" .peers/llamacpp.tar.xz /tmp/peer > /tmp/llamacpp-build.txt 2>&1 &
    build=$!
    STEP_TIMEOUT=120 SEQ="qwen3.5-27b-sm90-q4 qwen3.5-0.8b-sm90-bf16 qwen3.5-0.8b-sm90-q4 qwen3-next-80b-a3b-sm90-q4" \
      bash bench/device_preload_ab.sh "$out"
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    for p in qwen3.5-27b-sm90-q4 qwen3.5-0.8b-sm90-bf16 qwen3.5-0.8b-sm90-q4 qwen3-next-80b-a3b-sm90-q4; do
      timeout 120 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
        > "$out/profile-$p.txt" 2>&1; echo "$p: exit $?"; grep -A14 "^in the graph" "$out/profile-$p.txt"
    done
    wait $build; tail -2 /tmp/llamacpp-build.txt
    PP=512 TG=128 REPS=3 bash "$here/device.sh" .peers/llamacpp.tar.xz "$out" qwen3.5-0.8b:bf16 qwen3.5-0.8b:q4_0 ;;
  peer27)
    here=../shared/peers/llamacpp; [ -f "$here/device.sh" ] || here=.peers/llamacpp-scripts
    PP=512 TG=128 REPS=3 timeout 540 bash "$here/device.sh" .peers/llamacpp.tar.xz "$out" qwen3.5-27b:q4_0
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    kestrel-run bench/plans/qwen3.5-27b-sm90-q4.plan --prompt-ids "$ids" --max-new-tokens 128 \
      --bench "$out/bench-27b-q4-tg128.json" 2>&1 | tail -3 ;;
  exact)
    timeout 120 python3 bench/device_row_diff.py "$out/row-diff.json" "$P-exact.plan" 2>&1 | tail -14
    KESTREL_EXACT_PROMPTS=${PROMPTS:-3} timeout 200 python3 bench/device_spec_exactness.py "$out/exactness.json" \
      "$P-exact.plan" 2>&1 | tail -8
    timeout 150 compute-sanitizer --tool memcheck --print-limit 5 --error-exitcode 1 python3 bench/device_spec_sanitize.py \
      bench/plans/qwen3.5-27b-4l-sm90-q4-spec3-exact.plan > "$out/sanitize-exact.txt" 2>&1
    echo "sanitizer (exact): exit $?"; tail -2 "$out/sanitize-exact.txt"
    [ -n "${AB:-}" ] && PAIRS="qwen3.5-27b-sm90-q4:qwen3.5-27b-sm90-q4-nofuse qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-nofuse" \
      STEP_TIMEOUT=60 bash bench/device_preload_ab.sh "$out"
    timeout 150 python3 bench/device_spec.py "$out/spec-27b-q4-exact.json" "$P-exact.plan" > "$out/spec-27b-q4-exact.txt" 2>&1
    echo "spec: exit $?"; grep -E "spec==plain|verify at|as graphs|^ +[01]\.[0-9]  " "$out/spec-27b-q4-exact.txt" ;;
  default)
    KESTREL_EXACT_PROMPTS=${PROMPTS:-3} timeout 240 python3 bench/device_spec_exactness.py "$out/exactness.json" \
      "$P.plan" bench/plans/qwen3.5-27b-sm90-bf16-spec3.plan 2>&1 | tail -8
    timeout 150 compute-sanitizer --tool memcheck --print-limit 5 --error-exitcode 1 python3 bench/device_spec_sanitize.py \
      bench/plans/qwen3.5-27b-4l-sm90-bf16-spec3.plan > "$out/sanitize-27b4-bf16-spec3.txt" 2>&1
    echo "sanitizer (27b4 bf16): exit $?"; tail -2 "$out/sanitize-27b4-bf16-spec3.txt"
    timeout 200 python3 bench/device_spec.py "$out/spec-27b-bf16.json" bench/plans/qwen3.5-27b-sm90-bf16-spec3.plan \
      > "$out/spec-27b-bf16.txt" 2>&1
    echo "spec: exit $?"; grep -E "spec==plain|verify at|as graphs|^ +[01]\.[0-9]  " "$out/spec-27b-bf16.txt" ;;
  bf16)
    timeout 100 python3 bench/device_row_diff.py "$out/row-diff-bf16.json" bench/plans/qwen3.5-27b-sm90-bf16-spec3.plan \
      2>&1 | tail -6
    KESTREL_EXACT_PROMPTS=${PROMPTS:-3} timeout 200 python3 bench/device_spec_exactness.py "$out/exactness-bf16.json" \
      bench/plans/qwen3.5-27b-sm90-bf16-spec3.plan 2>&1 | tail -8
    timeout 200 python3 bench/device_spec.py "$out/spec-27b-bf16.json" bench/plans/qwen3.5-27b-sm90-bf16-spec3.plan \
      > "$out/spec-27b-bf16.txt" 2>&1
    echo "spec: exit $?"; grep -E "spec==plain|verify at|as graphs|^ +[01]\.[0-9]  " "$out/spec-27b-bf16.txt" ;;
esac
