#!/usr/bin/env bash
# Stop 43's device calls, one part a call (each under the 10-minute limit); everything under OUTDIR.
#   attn    attn_step's one program a query head at short contexts (attention.short_rows = 128; 32 rows a tile, -head16:
#           16), off in the rule until measured: the kernel alone (bench/attn_step_probe.py: the rule's grouped form
#           against short16 / 32 / 64 and 8 warps at positions 44 / 100 / 1000 / 4000; python3 bench/attn_step_probe.py
#           compile bench/attn-step-probe here), the whole step against the rule at 0.8B q4 (A B C C B A with -head16),
#           80B-A3B and 27B q4 (A B B A); the verify's row 0 against the one-token step op by op on 4 layers of
#           80B-A3B q4 with K = 3 drafts; 4 layers of the 0.8B shape against the CPU reference; compute-sanitizer on it
#           and on 4 layers of 80B-A3B with K = 3 drafts (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-head
#           0.8b-q4-head16 next80-q4 next80-q4-head 27b-q4 27b-q4-head small4-q4-head next4-q4-spec3-head; about
#           20 MB of plans with the probe's 1.9 MB: the working tree's 42 MB leaves room for no more)
#   moe     rmsnorm_moe_gate_up's EARLY (moe.gate_up_early) at 80B-A3B q4, with and without the head form (below)
#   tog     the one-tile q4 matvecs' loads together (matvec.q4_one_tile_together) at 0.8B, 2B, 80B-A3B (below)
#   ab, checks  the shortest route: every form's whole-step A/B in one call, then their correctness in another
#   gnw     (stop 44) gdn_norm's warps, 4 by a rule of thumb never timed, against 1 and 2 (one value head of 128 a
#           program: its sum of squares inside one warp instead of across four): 0.8B q4 and 80B-A3B q4 A B C C B A,
#           4 layers of the 0.8B shape with 1 warp against the CPU reference (bash bench/build_stop_plans.sh 0.8b-q4
#           0.8b-q4-gnw1 0.8b-q4-gnw2 next80-q4 next80-q4-gnw1 next80-q4-gnw2 small4-q4-gnw1: ~17 MB)
#   full80  (stop 44) the whole 80B-A3B q4 plan against the CPU reference, 8 new tokens (graph, streaming, the CPU path
#           at full depth: since stop 44 it holds q4 weights as codes, ~82 GB of the host's 128; never tried; bash
#           bench/build_stop_plans.sh next80-q4)
#   profile, next  llama.cpp's 80B-A3B figure in the same call as Kestrel's (~750 s of device time: the build and
#           the profiles in one call, the GGUF and the runs in the next, on the still-warm machine)
# There: run(carry=["bench/plans", "bench/attn-step-probe"]): bash bench/device_stop43.sh $OUT PART (profile and next:
# carry .peers and bench/plans)
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  attn)
    (cd bench && timeout 120 python3 attn_step_probe.py time attn-step-probe "$out/attn-step.json" > "$out/attn-step.txt" 2>&1)
    echo "probe: exit $?"; tail -20 "$out/attn-step.txt"
    timeout 120 python3 bench/device_row_diff.py "$out/row-diff.json" bench/plans/qwen3-next-4l-sm90-q4-spec3-head.plan \
      > "$out/row-diff.txt" 2>&1
    echo "row diff: exit $?"; grep -E "outputs compared|^  " "$out/row-diff.txt" | head -10
    STEP_TIMEOUT=100 SEQ="qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-q4-head qwen3.5-0.8b-sm90-q4-head16" \
      PAIRS="qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-sm90-q4-head qwen3.5-27b-sm90-q4:qwen3.5-27b-sm90-q4-head" \
      bash bench/device_preload_ab.sh "$out"
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=150 SANITIZE="qwen3.5-small4-sm90-q4-head qwen3-next-4l-sm90-q4-spec3-head" E2E="qwen3.5-small4-sm90-q4-head" \
      bash bench/device_preload_ab.sh "$out/e2e" ;;
  moe)  # rmsnorm_moe_gate_up's EARLY (moe.gate_up_early, off in the rule until measured: the normed input and the
    # shared expert's tiles before the PDL wait, a routed program's gate / up words and scales in one round trip after
    # it, where the tile loop takes four), alone and with the head form (-head+eg): 80B-A3B q4 A B C C B A and the
    # --profile of -head+eg; 4 layers of 80B-A3B with it against the CPU reference and under compute-sanitizer (bash
    # bench/build_stop_plans.sh next80-q4 next80-q4-eg next80-q4-head+eg next4-q4-eg)
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    p=qwen3-next-80b-a3b-sm90-q4-head+eg
    timeout 100 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
      > "$out/profile-$p.txt" 2>&1; echo "profile: exit $?"; grep -A22 "^in the graph" "$out/profile-$p.txt" | head -24
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-eg qwen3-next-80b-a3b-sm90-q4-head+eg" \
      bash bench/device_preload_ab.sh "$out"
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=300 SANITIZE="qwen3-next-4l-sm90-q4-eg" E2E="qwen3-next-4l-sm90-q4-eg" bash bench/device_preload_ab.sh "$out/e2e" ;;
  tog)  # the one-tile q4 matvecs' TOGETHER (matvec.q4_one_tile_together, off in the rule until measured: words and
    # scales of both matrices at once after the PDL wait, where the tile takes x, then the words, the scales after the
    # products, the up projection's after the gate's): 0.8B q4 A B C C B A with the head form (-head+tog), 2B q4 and
    # 80B-A3B q4 with every stop-43 form (-head+eg+tog) A B B A; 4 layers of the 0.8B and 2B shapes with it against the
    # CPU reference and under compute-sanitizer (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-tog 0.8b-q4-head+tog
    # 2b-q4 2b-q4-tog next80-q4 next80-q4-head+eg+tog small4-q4-tog small2b4-q4-tog)
    STEP_TIMEOUT=100 SEQ="qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-q4-tog qwen3.5-0.8b-sm90-q4-head+tog" \
      PAIRS="qwen3.5-2b-sm90-q4:qwen3.5-2b-sm90-q4-tog qwen3-next-80b-a3b-sm90-q4:qwen3-next-80b-a3b-sm90-q4-head+eg+tog" \
      bash bench/device_preload_ab.sh "$out"
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=150 SANITIZE="qwen3.5-small4-sm90-q4-tog qwen3.5-small2b4-sm90-q4-tog" \
      E2E="qwen3.5-small4-sm90-q4-tog qwen3.5-small2b4-sm90-q4-tog" bash bench/device_preload_ab.sh "$out/e2e" ;;
  ab)  # the three forms' whole-step A/B in one call (graph, greedy): 0.8B q4 and 80B-A3B q4 A B C D D C B A, 2B q4
    # A B B A (bash bench/build_stop_plans.sh 0.8b-q4 0.8b-q4-head 0.8b-q4-tog 0.8b-q4-head+tog next80-q4 next80-q4-head
    # next80-q4-eg next80-q4-head+eg+tog 2b-q4 2b-q4-tog: ~20 MB of plans); `checks` then runs their correctness
    mkdir -p "$out/small" "$out/next"
    STEP_TIMEOUT=100 SEQ="qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-q4-head qwen3.5-0.8b-sm90-q4-tog qwen3.5-0.8b-sm90-q4-head+tog" \
      bash bench/device_preload_ab.sh "$out/small"
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-head qwen3-next-80b-a3b-sm90-q4-eg qwen3-next-80b-a3b-sm90-q4-head+eg+tog" \
      PAIRS="qwen3.5-2b-sm90-q4:qwen3.5-2b-sm90-q4-tog" bash bench/device_preload_ab.sh "$out/next" ;;
  gnw)  # gdn_norm.num_warps 1 and 2 against the rule's 4 (stop 44; see the head of this file)
    mkdir -p "$out/small" "$out/next" "$out/e2e"
    STEP_TIMEOUT=100 SEQ="qwen3.5-0.8b-sm90-q4 qwen3.5-0.8b-sm90-q4-gnw1 qwen3.5-0.8b-sm90-q4-gnw2" \
      bash bench/device_preload_ab.sh "$out/small"
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-gnw1 qwen3-next-80b-a3b-sm90-q4-gnw2" \
      bash bench/device_preload_ab.sh "$out/next"
    STEP_TIMEOUT=150 E2E="qwen3.5-small4-sm90-q4-gnw1" bash bench/device_preload_ab.sh "$out/e2e" ;;
  full80)  # the whole 80B-A3B q4 plan against the CPU reference (stop 44; see the head of this file)
    KESTREL_E2E_NEW=8 STEP_TIMEOUT=560 E2E="qwen3-next-80b-a3b-sm90-q4" bash bench/device_preload_ab.sh "$out" ;;
  checks)  # the three forms on against the CPU reference (4 layers of the 0.8B and 2B shapes, of 80B-A3B), under
    # compute-sanitizer, and the verify's row 0 against the one-token step with the head form (bash
    # bench/build_stop_plans.sh small4-q4-head+tog small2b4-q4-tog next4-q4-head+eg+tog next4-q4-spec3-head; about
    # 500 s of the 600 a call may take: the 4-layer 80B-A3B e2e alone took ~140 s in stop 42)
    timeout 120 python3 bench/device_row_diff.py "$out/row-diff.json" bench/plans/qwen3-next-4l-sm90-q4-spec3-head.plan \
      > "$out/row-diff.txt" 2>&1
    echo "row diff: exit $?"; grep -E "outputs compared|^  " "$out/row-diff.txt" | head -10
    STEP_TIMEOUT=200 SANITIZE="qwen3.5-small4-sm90-q4-head+tog qwen3-next-4l-sm90-q4-spec3-head" \
      E2E="qwen3.5-small4-sm90-q4-head+tog qwen3.5-small2b4-sm90-q4-tog qwen3-next-4l-sm90-q4-head+eg+tog" \
      bash bench/device_preload_ab.sh "$out" ;;
  profile)  # llama.cpp built for the next part (kept in /tmp/llamacpp while the machine stays warm: run `next` right
    # after), and the 80B-A3B q4 plan's --profile at the rule and with the head form (carry .peers and bench/plans;
    # bash bench/build_stop_plans.sh next80-q4 next80-q4-head)
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    timeout 330 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$out" > "$out/llamacpp-build.txt" 2>&1; echo "llama.cpp build: exit $?"
    for p in qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-head; do
      timeout 100 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
        > "$out/profile-$p.txt" 2>&1; echo "profile $p: exit $?"; grep -A22 "^in the graph" "$out/profile-$p.txt" | head -24
    done ;;
  next)  # llama.cpp on the whole 80B-A3B shape (Q4_0, bench/llamacpp_next.sh) and Kestrel's 80B-A3B q4 in the same call
    # (carry .peers: llamacpp.tar.xz and llamacpp-scripts, a copy of ../shared/peers/llamacpp; bash
    # bench/build_stop_plans.sh next80-q4 next80-q4-head), on the warm machine of `profile`
    PP=512 TG=128 REPS=3 CLEAN=1 timeout 420 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$out" qwen3-next-80b-a3b
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-head" bash bench/device_preload_ab.sh "$out" ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
