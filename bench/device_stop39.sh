#!/usr/bin/env bash
# Stop 39's device calls (each under the 10-minute limit); plans from bench/build_stop_plans.sh as each part says.
#   commit  (call 2) the verify's Gated DeltaNet without per-row snapshots of the recurrent state: each row's update
#           kept and gdn_commit advancing the state by the kept rows, against the snapshots and gdn_rollback (-base:
#           commit b431fa0's compiler, git worktree add /tmp/base b431fa0): bench/device_spec.py on 27B q4 K = 3
#           (A B B A) and 0.8B bf16 K = 3 (A B): verify / step kernel by kernel and as graphs, the iteration,
#           spec == plain; tiny-mtp q4 K = 3 under compute-sanitizer
#           (bash bench/build_stop_plans.sh 27b-q4-spec3 27b-q4-spec3-base 0.8b-bf16-spec3 0.8b-bf16-spec3-base
#            tiny-mtp-q4-spec3)
#   commit2 (call 3) the same with gdn_commit streaming (flat blocks of the state, the speculative rule's; call 2's
#           ran it on gdn_delta's tiles, 0.47 ms a 27B iteration against the rollback's 0.09): 27B q4 K = 3 (A B B A),
#           27B bf16 K = 3 with q4 drafts (A B), 0.8B bf16 K = 3; tiny-mtp q4 K = 3 under compute-sanitizer
#           (bash bench/build_stop_plans.sh 27b-q4-spec3 27b-q4-spec3-base 27b-bf16-spec3 27b-bf16-spec3-base
#            0.8b-bf16-spec3 tiny-mtp-q4-spec3)
#   pair    (call 4) the floating-point products of speculative plans as explicit FMA pairs with contraction on
#           (matvec_rows.pair_fma, in exact_verify_rules) against stop 36's no contraction (matvec_rows.fp_fusion=False:
#           the 27B bf16 verify's few-rows products 1.22x slower, call 3), with gdn_commit: 27B bf16 K = 3 (A B B A
#           against -base, commit b431fa0's compiler), 27B q4 and 0.8B bf16 K = 3; the verify's row 0 against the
#           one-token step op by op (bench/device_row_diff.py) on 4 layers of the 80B-A3B shape (q4, bf16: the router
#           where contraction made them differ, stop 36) and of 27B bf16; tiny-mtp q4 under compute-sanitizer
#           (bash bench/build_stop_plans.sh 27b-bf16-spec3 27b-bf16-spec3-base 27b-q4-spec3 0.8b-bf16-spec3
#            next4-q4-spec3 next4-bf16-spec3 27b4-bf16-spec3 tiny-mtp-q4-spec3)
#   more    (call 5) the early triggers for bf16 at 2B and 4B (plans that changed with call 1's default, A B B A
#           against -q4early); greedy speculative == plain over 3 prompts x 256 tokens (bench/device_spec_exactness.py)
#           on 27B bf16 and 0.8B bf16 K = 3; 80B-A3B q4 K = 3 against -base (A B: gdn_commit, pair_fma at the
#           router), bench/device_spec.py
#           (bash bench/build_stop_plans.sh 2b-bf16 2b-bf16-q4early 4b-bf16 4b-bf16-q4early 27b-bf16-spec3
#            0.8b-bf16-spec3 next80-q4-spec3 next80-q4-spec3-base)
#   csweep  (call 6) gdn_commit's shape (48 launches 0.38-0.46 ms kernel by kernel at 27B, call 3): BLOCK x warps x
#           pipeline stages 2048x4x0 (the rule) / 2048x4x1 / 8192x8x0 / 8192x8x1, 27B q4 K = 3, A B C D A
#           (bash bench/build_stop_plans.sh 27b-q4-spec3 27b-q4-spec3-c2048x4x1 27b-q4-spec3-c8192x8x0 27b-q4-spec3-c8192x8x1)
#   cprobe  (call 7) bench/commit_probe.py: gdn_commit alone at the 27B shape (48 layers in a CUDA graph) against a
#           copy, an in-place scale and a per-program-row form (no plans)
# There: run(carry=["bench/plans"]): bash bench/device_stop39.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
spec() {  # N PLAN: bench/device_spec.py on one plan, its summary lines printed
  timeout 170 python3 bench/device_spec.py "$out/spec-$1-$2.json" "bench/plans/$2.plan" > "$out/spec-$1-$2.txt" 2>&1
  echo "$1 $2: exit $?"; grep -E "spec==plain|verify at|as graphs|^ *verify by|^ *M=1 step by" "$out/spec-$1-$2.txt" \
    | cut -c1-600 | head -8
}
sanitize() {  # tiny-mtp q4 K = 3 under compute-sanitizer (streamed, sampled speculation), then the reports in one tar
  KESTREL_SPEC_SAMPLING=1 timeout 150 compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py \
    bench/plans/tiny-mtp-sm90-q4-spec3.plan > "$out/sanitizer-tiny-mtp.txt" 2>&1
  echo "sanitizer: exit $?"; tail -1 "$out/sanitizer-tiny-mtp.txt"
  (cd "$out" && tar cf spec.tar spec-*.json spec-*.txt && rm -f spec-*.json spec-*.txt)
}
case $2 in
  commit)
    n=0
    for p in qwen3.5-27b-sm90-q4-spec3-base qwen3.5-27b-sm90-q4-spec3 qwen3.5-27b-sm90-q4-spec3 qwen3.5-27b-sm90-q4-spec3-base \
             qwen3.5-0.8b-sm90-bf16-spec3-base qwen3.5-0.8b-sm90-bf16-spec3; do
      n=$((n + 1)); spec $n $p
    done
    sanitize ;;
  commit2)
    n=0
    for p in qwen3.5-27b-sm90-q4-spec3 qwen3.5-27b-sm90-q4-spec3-base qwen3.5-27b-sm90-q4-spec3-base qwen3.5-27b-sm90-q4-spec3 \
             qwen3.5-27b-sm90-bf16-spec3-base qwen3.5-27b-sm90-bf16-spec3 qwen3.5-0.8b-sm90-bf16-spec3; do
      n=$((n + 1)); spec $n $p
    done
    sanitize ;;
  pair)
    timeout 200 python3 bench/device_row_diff.py "$out/row-diff.json" bench/plans/qwen3-next-4l-sm90-q4-spec3.plan \
      bench/plans/qwen3-next-4l-sm90-bf16-spec3.plan bench/plans/qwen3.5-27b-4l-sm90-bf16-spec3.plan > "$out/row-diff.txt" 2>&1
    echo "row diff: exit $?"; grep -E "outputs compared|^  " "$out/row-diff.txt" | head -20
    n=0
    for p in qwen3.5-27b-sm90-bf16-spec3 qwen3.5-27b-sm90-bf16-spec3-base qwen3.5-27b-sm90-bf16-spec3-base qwen3.5-27b-sm90-bf16-spec3 \
             qwen3.5-27b-sm90-q4-spec3 qwen3.5-0.8b-sm90-bf16-spec3; do
      n=$((n + 1)); spec $n $p
    done
    sanitize ;;
  more)
    STEP_TIMEOUT=150 PAIRS="qwen3.5-2b-sm90-bf16-q4early:qwen3.5-2b-sm90-bf16 qwen3.5-4b-sm90-bf16-q4early:qwen3.5-4b-sm90-bf16" \
      bash bench/device_preload_ab.sh "$out"
    timeout 200 python3 bench/device_spec_exactness.py "$out/spec-exact.json" bench/plans/qwen3.5-27b-sm90-bf16-spec3.plan \
      bench/plans/qwen3.5-0.8b-sm90-bf16-spec3.plan > "$out/spec-exact.txt" 2>&1
    echo "exactness: exit $?"; tail -4 "$out/spec-exact.txt"
    n=0
    for p in qwen3-next-80b-a3b-sm90-q4-spec3-base qwen3-next-80b-a3b-sm90-q4-spec3; do
      n=$((n + 1)); spec $n $p
    done
    (cd "$out" && tar cf spec.tar spec-[0-9]*.json spec-[0-9]*.txt && rm -f spec-[0-9]*.json spec-[0-9]*.txt) ;;
  cprobe)
    timeout 300 python3 bench/commit_probe.py "$out/commit-probe.json" 2>&1 | tail -20 ;;
  csweep)
    n=0
    for p in qwen3.5-27b-sm90-q4-spec3 qwen3.5-27b-sm90-q4-spec3-c2048x4x1 qwen3.5-27b-sm90-q4-spec3-c8192x8x0 \
             qwen3.5-27b-sm90-q4-spec3-c8192x8x1 qwen3.5-27b-sm90-q4-spec3; do
      n=$((n + 1)); spec $n $p
    done
    (cd "$out" && tar cf spec.tar spec-[0-9]*.json spec-[0-9]*.txt && rm -f spec-[0-9]*.json spec-[0-9]*.txt) ;;
esac
