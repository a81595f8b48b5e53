#!/usr/bin/env bash
# Stop 32's device call, prepared in a session without device time (issue 13 part 3): does a q4_stream launch whose
# registers leave room for the next launch's CTA (MINB 2), or whose K is split over a row group's warps (KS: the
# down projection's x in registers), make the 27B q4 step faster? In one call, everything under OUTDIR:
#   1. bench/q4stream_probe.py time-layer: the 27B GDN layer's four products chained in step order, each by
#      Triton or q4_stream (every split checked against the emulation first);
#   2. compute-sanitizer and the GPU against the CPU reference on a 0.8B q4 plan with every q4_stream form forced
#      on with K splits and MINB 2 (all of the new code paths), then the 27B q4 variants A B ... B A;
#   3. 4 layers of the 27B shape (the pair as committed) against the CPU reference (q4_matvec_ref now 3x faster).
#   4. bench/q4chain_probe.py: the MLP block (out projection, gate / up, down) as one persistent launch with grid
#      barriers against three launches; --profile's new table, each kernel's cost inside the graph, for the 27B q4,
#      0.8B and 80B-A3B q4 plans.
# Here:  bash bench/build_stop_plans.sh 27b-q4 27b-q4-pairminb2 27b-q4-pairks 27b-q4-pairks-minb2 27b-q4-down \
#          27b-q4-down-out 27b-q4-all-minb2 0.8b-q4-streamks 27b4-q4 0.8b-bf16 0.8b-q4 next80-q4
#        python bench/q4stream_probe.py compile-layer bench/q4stream-layer
#        python bench/q4chain_probe.py compile bench/q4chain-cubins
# There: run(carry=["bench/plans", "bench/q4stream-layer", "bench/q4chain-cubins"]), one part a call (each under the
#        10-minute limit):
#        bash bench/device_stop32.sh $OUT layer;  ... $OUT seq;  ... $OUT profile;  ... $OUT e2e
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
P=qwen3.5-27b-sm90-q4
case $2 in
  layer)  # ~5 min: the probe, then the sanitizer over every new code path
    (cd bench && timeout 330 python3 q4stream_probe.py time-layer q4stream-layer "$out/layer.json" > "$out/layer.log" 2>&1)
    echo "layer probe: exit $?"; grep -v "^in_proj \|^out_proj \|^gate_up \|^down " "$out/layer.log" | head -40
    STEP_TIMEOUT=240 SANITIZE="qwen3.5-0.8b-sm90-q4-streamks" bash bench/device_preload_ab.sh "$out" ;;
  seq)  # 7 plans A B ... B A (SEQ: another list, e.g. the layer probe's picks)
    STEP_TIMEOUT=120 SEQ=${SEQ:-"$P $P-pairminb2 $P-pairks $P-pairks-minb2 $P-down $P-down-out $P-all-minb2"} \
      bash bench/device_preload_ab.sh "$out" ;;
  profile)  # the MLP block as one launch (bench/q4chain_probe.py); every kernel's cost inside the graph, per plan
    (cd bench && timeout 200 python3 q4chain_probe.py time q4chain-cubins "$out/chain.json" > "$out/chain.log" 2>&1)
    echo "chain probe: exit $?"; tail -12 "$out/chain.log"
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    for p in ${PROFILE:-$P qwen3.5-0.8b-sm90-bf16 qwen3.5-0.8b-sm90-q4 qwen3-next-80b-a3b-sm90-q4}; do
      timeout 240 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
        > "$out/profile-$p.txt" 2>&1; echo "$p: exit $?"; grep -A14 "^in the graph" "$out/profile-$p.txt"
    done ;;
  e2e)  # the forced 0.8B plan and 4 layers of the 27B shape against the CPU reference
    STEP_TIMEOUT=420 E2E="qwen3.5-0.8b-sm90-q4-streamks qwen3.5-27b-4l-sm90-q4" bash bench/device_preload_ab.sh "$out" ;;
esac
