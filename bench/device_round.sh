#!/usr/bin/env bash
# One device call for a change that touches kernels: tiny end to end (GPU vs CPU, graph vs streaming,
# token loop) and compute-sanitizer, attention at real shapes and long positions, a long-context
# before/after run (plans named before-*.plan, if any), then --verify / --bench for every plan.
# Everything lands in OUTDIR/round.tar (the device tool brings back at most 8 files).
#   bash bench/device_round.sh OUTDIR
set -u
out=$1; w=$(mktemp -d)
bash bench/device_all.sh "$w" 'nothing' 2>&1 | grep -v "^round"
for shape in qwen3.5-27b qwen3.5-0.8b; do for pos in 80 1000 4000; do
  ONLY_SHAPE=$shape ONLY_OP=attn_step POS=$pos python3 bench/device_kernels.py bench/cubins "$w/attn-$shape-pos$pos.json" | tail -3
done; done
for shape in qwen3.5-27b qwen3.5-0.8b; do
  ONLY_SHAPE=$shape ONLY_OP=matmul,matmul_swiglu python3 bench/device_kernels.py bench/cubins "$w/matvec-$shape.json" | tail -14
done
run() { python3 -c "import sys; from kestrel.runtime.cli import main; sys.argv = ['kestrel-run'] + sys.argv[1:]; main()" "$@"; }
long=$(seq -s, 1 1500)
for p in bench/plans/before-*.plan bench/plans/qwen3.5-0.8b-sm90-bf16.plan; do
  [ -f "$p" ] || continue
  n=$(basename "$p" .plan); echo "== long context (1500 + 32): $n"
  run "$p" --prompt-ids $long --max-new-tokens 32 --bench "$w/long-$n.json" --rounds 3 2>/dev/null | head -1
done
for p in bench/plans/qwen3.5-*.plan bench/plans/tiny-*.plan; do
  n=$(basename "$p" .plan); echo "== $n"
  run "$p" --prompt-ids 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16 --max-new-tokens 64 --verify --json \
    | sed "s/^/{\"plan\": \"$n\", \"verify\": /; s/\$/}/" >> "$w/verify.jsonl"; tail -1 "$w/verify.jsonl"
  run "$p" --prompt-ids 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16 --max-new-tokens 64 --bench "$w/bench-$n.json" --rounds 3 2>/dev/null | head -1
done
tar -C "$w" -cf "$out/round.tar" .
