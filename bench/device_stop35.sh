#!/usr/bin/env bash
# Prepared in stop 34 for the next device calls, a part a call (each under the 10-minute limit; call the next part
# at once, while the machine is warm):
#   spec     what exact_verify_rules (stop 34: every speculative GPU plan) do to the plans stop 34 did not measure:
#            0.8B bf16 and q4 K = 3 (greedy exactness over 3 prompts x 256 tokens; the 0.8B bf16 verify left the
#            bf16 tensor-core kernel for the few-rows matvec: its controlled-acceptance table and verify cost against
#            stop 28's), and the 80B-A3B q4 K = 3 table (stop 24's figures are stale; its verify's MoE rows are not
#            the one-token step's fused kernels, so exactness is reported, not claimed);
#   next80   issue 15: the 80B-A3B q4 step with the one-row q4 products at K = 2048 on q4_stream (the GDN in_proj
#            normed, the out projections with the add: `next80-q4-stream`) against the committed rule, A B B A; first
#            4 layers of the shape in each form against the CPU reference (q4_stream has not run at K = 2048), and
#            the 27B q4 `--profile` table stop 34 could not bring back.
# Here:  bash bench/build_stop_plans.sh 0.8b-bf16-spec3 0.8b-q4-spec3 next80-q4-spec3 next80-q4 next80-q4-stream \
#          next4-q4 next4-q4-stream 27b-q4
# There: run(carry=["bench/plans"]): bash bench/device_stop35.sh $OUT spec; ... next80
# Stop 35 added the attention parts (results/stop35/README.md): attn, ab, oldnew, sanitize, each described at its case;
# they read bench/attn-step-probe (python bench/attn_step_probe.py compile bench/attn-step-probe), bench/attn-step-old
# (the same compiled from a checkout of 334f51f) and bench/ab/{old,new} (plans built before / after), carried.
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  spec)
    timeout 200 python3 bench/device_spec_exactness.py "$out/exactness.json" bench/plans/qwen3.5-0.8b-sm90-bf16-spec3.plan \
      bench/plans/qwen3.5-0.8b-sm90-q4-spec3.plan bench/plans/qwen3-next-80b-a3b-sm90-q4-spec3.plan 2>&1 | tail -9
    for p in qwen3.5-0.8b-sm90-bf16-spec3 qwen3-next-80b-a3b-sm90-q4-spec3; do
      timeout 150 python3 bench/device_spec.py "$out/spec-$p.json" "bench/plans/$p.plan" > "$out/spec-$p.txt" 2>&1
      echo "$p: exit $?"; grep -E "spec==plain|verify at|as graphs|^ +[01]\.[0-9]  " "$out/spec-$p.txt"
    done ;;
  next80)
    STEP_TIMEOUT=150 PAIRS="qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-sm90-q4-stream" \
      E2E="qwen3-next-4l-sm90-q4 qwen3-next-4l-sm90-q4-stream" bash bench/device_preload_ab.sh "$out"
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    for p in qwen3.5-27b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-stream; do
      timeout 120 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
        > "$out/profile-$p.txt" 2>&1; echo "$p: exit $?"; grep -A14 "^in the graph" "$out/profile-$p.txt"
    done ;;
  oldnew)  # attn_step at max_seq 4096 before the chunked combine (bench/attn-step-old, compiled from 334f51f)
    # and at this tree (bench/attn-step-probe), positions 1000-4000
    cd bench
    for f in attn-step-old attn-step-probe; do
      KESTREL_ATTN_S=4096 KESTREL_ATTN_POS="44 1000 2000 3000 4000" timeout 200 python3 attn_step_probe.py time $f \
        "$out/$f.json" > "$out/$f.txt" 2>&1; echo "$f: exit $?"; sed -n '/model variant/,$p' "$out/$f.txt"
    done ;;
  sanitize)  # compute-sanitizer memcheck on attn_step at max_seq 4096, both combine paths (1000: 8 active splits,
    # MERGE_SMALL; 3000: 24, MERGE_CH), the 0.8B and 80B-A3B shapes
    cd bench
    for m in 0.8b 80b-a3b; do
      KESTREL_SWEEP_QUICK=1 KESTREL_ATTN_S=4096 KESTREL_ATTN_POS="1000 3000" KESTREL_ATTN_ONLY=$m:rule timeout 200 \
        compute-sanitizer --tool memcheck --error-exitcode 1 python3 attn_step_probe.py time attn-step-probe /tmp/q.json \
        > "$out/sanitizer-attn-$m.txt" 2>&1
      echo "$m: exit $?"; grep -E "ERROR SUMMARY|err " "$out/sanitizer-attn-$m.txt"
    done ;;
  ab)  # the combine in chunks: the probe at the committed rule, then plans built before (bench/ab/old) and after
    # (bench/ab/new) it, decode at positions 1000 and 3000 (carry bench/ab and bench/attn-step-probe)
    (cd bench && KESTREL_ATTN_POS="44 300 1000 2500 4000 8000" timeout 200 python3 attn_step_probe.py time \
      attn-step-probe "$out/attn-step.json" > "$out/attn-step.txt" 2>&1; echo "probe: exit $?"; tail -7 "$out/attn-step.txt")
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    ab() {  # plan, then the versions in order
      p=$1; shift
      for v in "$@"; do
        timeout 150 kestrel-run "bench/ab/$v/$p.plan" --prompt-ids "$ids" --max-new-tokens 32 --rounds 3 \
          --positions 1000,3000 --bench "$w/bench-$p-$v.json" > "$w/bench-$p-$v.txt" 2>&1
        echo "$p $v: exit $? $(grep -E "^position|ms/token" "$w/bench-$p-$v.txt" | tr '\n' ' ' | cut -c1-400)"
        tar -C "$w" -cf "$out/ab.tar" .
      done
    }
    w=$(mktemp -d)
    ab qwen3.5-0.8b-sm90-bf16 old new
    ab qwen3-next-80b-a3b-sm90-q4 old new
    ab qwen3.5-27b-sm90-q4 old new ;;
  attn)  # the one-token attention kernel: variants timed chained, then ncu's source counters on the 0.8B rule at 44
    cd bench
    timeout 240 python3 attn_step_probe.py time attn-step-probe "$out/attn-step.json" > "$out/attn-step.txt" 2>&1
    echo "probe: exit $?"
    KESTREL_SWEEP_QUICK=1 KESTREL_ATTN_POS=44 KESTREL_ATTN_ONLY=0.8b:rule timeout 200 ncu --clock-control none \
      --kernel-name regex:attn_step --launch-skip 1 --launch-count 1 --section SourceCounters --section WarpStateStats \
      --section SpeedOfLight --section LaunchStats --import-source no -o /tmp/attn python3 attn_step_probe.py time \
      attn-step-probe /tmp/quick.json > /tmp/ncu.log 2>&1
    echo "ncu: exit $?"; tail -3 /tmp/ncu.log
    ncu -i /tmp/attn.ncu-rep --page source --csv --print-source sass > /tmp/source.csv 2> /tmp/source.err
    echo "source page: exit $?"; head -c 300 /tmp/source.err
    gzip -c /tmp/source.csv > "$out/attn-source.csv.gz"
    ncu -i /tmp/attn.ncu-rep --page details > "$out/attn-ncu-details.txt" 2>&1
    python3 attn_step_probe.py ncu-summary /tmp/source.csv > "$out/attn-ncu-source.txt" 2>&1
    echo "summary: exit $?"; head -60 "$out/attn-ncu-source.txt"; grep -E "Duration|Warp Cycles Per Issued|Issued Ipc" \
      "$out/attn-ncu-details.txt"
    tail -24 "$out/attn-step.txt" ;;
esac
