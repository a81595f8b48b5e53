#!/usr/bin/env bash
# Stop 42's device calls, one part a call (each under the 10-minute limit); everything under OUTDIR.
#   l2      moe_topk_l2's L2 hints (moe.topk_l2 = (128, level): the top-k run by 128 programs that ask the L2 for the
#           experts' gate / up (1), and their down (2), and the next layer's first matrix (3)) and the q4 matvecs'
#           first tile before the PDL wait (matvec.q4_preload_bytes 16 MiB), against the rule, at 80B-A3B q4, A B C D E
#           E D C B A; 4 layers of 80B-A3B q4 at level 3 against the CPU reference, and under compute-sanitizer with
#           K = 3 MTP drafts too (bash bench/build_stop_plans.sh next80-q4 next80-q4-l21 next80-q4-l22 next80-q4-l23
#           next80-q4-q4pre16 next4-q4-l23 next4-q4-spec3-l23)
# There: run(carry=["bench/plans", ...]): bash bench/device_stop42.sh $OUT PART
set -u
out=$1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
case $2 in
  l2)
    STEP_TIMEOUT=100 SEQ="qwen3-next-80b-a3b-sm90-q4 qwen3-next-80b-a3b-sm90-q4-l21 qwen3-next-80b-a3b-sm90-q4-l22 qwen3-next-80b-a3b-sm90-q4-l23 qwen3-next-80b-a3b-sm90-q4-q4pre16" \
      SANITIZE="qwen3-next-4l-sm90-q4-spec3-l23" E2E="qwen3-next-4l-sm90-q4-l23" bash bench/device_preload_ab.sh "$out" ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
