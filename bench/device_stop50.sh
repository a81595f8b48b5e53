#!/usr/bin/env bash
# Stop 50's device calls (bench/results/stop50/README.md). A call returns at most 8 files, so each part tars
# everything into one, $OUT/stop50-call.tar, at its end (its steps run under timeouts that leave time for it).
#   queue  (call 2) the 80B-A3B forms of the cluster mixer's phase-by-phase probe (call 1's printed tail lost
#          them; here first: python bench/gdn_cluster_probe.py compile bench/plans/gdn-probe), then stop 48's
#          prepared queue (bench/device_stop48.sh first: gfold / gfoldpre, the carveout, YaRN on the GPU; its
#          plans as that script lists)
#   rule   (calls 4, 5) the moe rule's carveout as built (kernels/targets.py, moe.carveout = 100: the plan's kernel
#          table carries it, the runtime sets it) against plans built with KESTREL_RULES="moe.carveout=-1", A B B A,
#          at 80B-A3B and 35B-A3B q4; then the 80B-A3B plan's --profile. Plans: kestrelc build qwen3-next-80b-a3b
#          --target sm_90 --weights random --quant q4 --max-seq 4096 --prefill-rows 256 -o
#          bench/plans/qwen3-next-80b-a3b-sm90-q4.plan, the same with the env into ...-nocarve.plan; likewise
#          qwen3.5-35b-a3b (qwen3.5-35b-a3b-sm90-q4[-nocarve].plan)
#   pipe   (call 6) attn_step's shared memory (attention.pipe_bytes_max 128 -> 64 / 32 KiB: 158 -> 91 / 58 KiB a
#          CTA, so the kernels around it keep their SMs) at 80B-A3B q4 (A B C C B A), 0.8B and 27B q4 (64 KiB,
#          A B B A), and decode from positions 1,000 and 4,000 of each 80B-A3B form. Plans: the rule's (next80-q4,
#          0.8b-q4, 27b-q4 of bench/build_stop_plans.sh) and the same builds with
#          KESTREL_RULES="attention.pipe_bytes_max=N" into -pipeK
#   pipe2  (call 7) pipe's forms with SPLIT_ROWS kept at 128 rows (attention.split_tiles 4 at 64 KiB, 8 at 32 KiB,
#          into -pipe64s4 / -pipe32s8): 80B-A3B A B C C B A and decode from positions 1,000 / 4,000, 0.8B q4 A B B A
#          at 32 KiB
# There: run(carry=["bench/plans"]): bash bench/device_stop50.sh $OUT [queue|rule|pipe|pipe2]
set -u
out=$1
r=$out/r
mkdir -p "$r/probe"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
long_positions() {  # PLAN...: decode from positions 1,000 and 4,000
  for p in "$@"; do
    timeout 60 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 32 --rounds 3 \
      --positions 1000,4000 --bench "$r/long-$p.json" > "$r/long-$p.txt" 2>&1
    echo "$p: exit $?"; grep -E "^position" "$r/long-$p.txt"
  done
}
n=qwen3-next-80b-a3b-sm90-q4
case ${2:-queue} in
  queue)
    timeout 90 python3 bench/gdn_cluster_probe.py run bench/plans/gdn-probe "$r/probe/gdn-probe.json" \
      > "$r/probe/probe.txt" 2>&1
    echo "probe: exit $?"; grep -v '^{' "$r/probe/probe.txt" | grep -A13 '^80b' | head -100
    timeout 470 bash bench/device_stop48.sh "$r" first
    echo "queue: exit $?" ;;
  rule)
    STEP_TIMEOUT=120 PAIRS="$n-nocarve:$n qwen3.5-35b-a3b-sm90-q4-nocarve:qwen3.5-35b-a3b-sm90-q4" \
      timeout 400 bash bench/device_preload_ab.sh "$r"
    timeout 100 kestrel-run "bench/plans/$n.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$r/profile-$n.json" \
      > "$r/profile-$n.txt" 2>&1; echo "profile: exit $?"; grep -A22 "^in the graph" "$r/profile-$n.txt" | head -24
    grep "^\[gpu\]" "$r/profile-$n.txt" ;;
  pipe)
    STEP_TIMEOUT=100 SEQ="$n $n-pipe64 $n-pipe32" \
      PAIRS="qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-pipe64 qwen3.5-27b-sm90-q4:qwen3.5-27b-sm90-q4-pipe64" \
      timeout 330 bash bench/device_preload_ab.sh "$r"
    long_positions $n $n-pipe64 $n-pipe32 ;;
  pipe2)
    STEP_TIMEOUT=100 SEQ="$n $n-pipe64s4 $n-pipe32s8" PAIRS="qwen3.5-0.8b-sm90-q4:qwen3.5-0.8b-sm90-q4-pipe32s8" \
      timeout 200 bash bench/device_preload_ab.sh "$r"
    long_positions $n $n-pipe64s4 $n-pipe32s8 ;;
  *) echo "unknown part $2"; exit 2 ;;
esac
find "$r" -name '*.tar' -exec sh -c 'd=$(dirname "$1"); tar -C "$d" -xf "$1" && rm "$1"' _ {} \;
tar -C "$out" -cf "$out/stop50-call.tar" r && rm -rf "$r"
