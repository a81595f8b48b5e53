#!/usr/bin/env bash
# Stop 45's device call: Qwen3.5 MoE (model_type qwen3_5_moe; new in stop 45, never run on a GPU) at the 35B-A3B
# shape, everything under OUTDIR (ab.tar from device_preload_ab.sh, profile and prefill files beside it):
#   q35check, q35time (q35moe's two halves, a call each)
#   q35moe  4 layers of the shape (and its MTP layer) against the CPU reference in q4 and bf16 (graph == streaming,
#           dump bytes, the CPU path's tokens and logits), compute-sanitizer on the q4 plan and its K = 3
#           speculative plan; the whole 35B-A3B decode at q4 and bf16 (kestrel-run --bench, greedy, 3 rounds each,
#           q4 bf16 bf16 q4), the q4 plan's --profile (its honest roofline: the bytes one token reads, the 8 routed
#           experts' only) and its prefill at 512 and 2,048 prompt tokens
#           (bash bench/build_stop_plans.sh 35b-q4 35b-bf16 moe35x4-q4 moe35x4-bf16 moe35x4-q4-spec3: ~11 MB)
#   full35  the whole 35B-A3B q4 plan against the CPU reference, 8 new tokens (graph, streaming, the CPU path at full
#           depth, its q4 weights as codes: ~37 GB of the host's 128; bash bench/build_stop_plans.sh 35b-q4)
#   peer35  llama.cpp on the whole 35B-A3B shape (Q4_0 GGUF by bench/mkgguf_next.py, ~19.7 GB; the build ~4 min on a
#           fresh machine) and Kestrel's 35B-A3B q4 in the same call (carry .peers: llamacpp.tar.xz and
#           llamacpp-scripts; bash bench/build_stop_plans.sh 35b-q4)
# There: run(carry=["bench/plans"]): bash bench/device_stop45.sh $OUT q35check, then q35time (or full35; peer35 also
# carries .peers)
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  q35check)  # the first half of q35moe (a call's 600 s hold one half): GPU against CPU, compute-sanitizer
    mkdir -p "$out/e2e"
    STEP_TIMEOUT=200 SANITIZE="qwen3.5-moe35-4l-sm90-q4 qwen3.5-moe35-4l-sm90-q4-spec3" \
      E2E="qwen3.5-moe35-4l-sm90-q4 qwen3.5-moe35-4l-sm90-bf16" bash bench/device_preload_ab.sh "$out/e2e" ;;
  q35time)  # the second half: the whole 35B-A3B's decode, profile and prefill
    ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
    mkdir -p "$out/decode"
    STEP_TIMEOUT=120 PAIRS="qwen3.5-35b-a3b-sm90-q4:qwen3.5-35b-a3b-sm90-bf16" bash bench/device_preload_ab.sh "$out/decode"
    p=qwen3.5-35b-a3b-sm90-q4
    timeout 100 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$out/profile-$p.json" \
      > "$out/profile-$p.txt" 2>&1; echo "profile: exit $?"; grep -A22 "^in the graph" "$out/profile-$p.txt" | head -24
    timeout 150 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 \
      --prompt-lengths 512,2048 --bench "$out/prefill-$p.json" > "$out/prefill-$p.txt" 2>&1
    echo "prefill: exit $?"; tail -8 "$out/prefill-$p.txt" ;;
  full35)
    KESTREL_E2E_NEW=8 STEP_TIMEOUT=560 E2E="qwen3.5-35b-a3b-sm90-q4" bash bench/device_preload_ab.sh "$out" ;;
  peer35)
    PP=512 TG=128 REPS=3 CLEAN=1 timeout 480 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$out" qwen3.5-35b-a3b
    STEP_TIMEOUT=100 SEQ="qwen3.5-35b-a3b-sm90-q4" bash bench/device_preload_ab.sh "$out" ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
