#!/usr/bin/env bash
# One device call for a change that touches kernels: tiny end to end (GPU vs CPU, graph vs streaming,
# token loop) and compute-sanitizer, attention at real shapes and three positions, every matvec of
# the 27B and 0.8B programs, a long-context run of the 0.8B bf16 plan, then --verify / --bench for
# every plan (bench/device_models.sh). Everything lands in OUTDIR/round.tar (the device tool brings
# back at most 8 files).
#   bash bench/device_round.sh OUTDIR
set -u
out=$1; w=$(mktemp -d)
bash bench/device_all.sh "$w"
for shape in qwen3.5-27b qwen3.5-0.8b; do for pos in 80 1000 4000; do
  ONLY_SHAPE=$shape ONLY_OP=attn_step POS=$pos python3 bench/device_kernels.py bench/cubins "$w/attn-$shape-pos$pos.json" | tail -3
done; done
for shape in qwen3.5-27b qwen3.5-0.8b; do
  ONLY_SHAPE=$shape ONLY_OP=matmul,matmul_swiglu python3 bench/device_kernels.py bench/cubins "$w/matvec-$shape.json" | tail -14
done
p=bench/plans/qwen3.5-0.8b-sm90-bf16.plan
if [ -f "$p" ]; then
  echo "== long context (1500 + 32): $(basename "$p" .plan)"
  python3 -c "import sys; from kestrel.runtime.cli import main; sys.argv = ['kestrel-run'] + sys.argv[1:]; main()" \
    "$p" --prompt-ids "$(seq -s, 1 1500)" --max-new-tokens 32 --bench "$w/long-qwen3.5-0.8b-sm90-bf16.json" --rounds 3 2>/dev/null | head -1
fi
bash bench/device_models.sh "$w" 2>&1 | grep -v "^round"
tar -C "$w" -cf "$out/round.tar" .
