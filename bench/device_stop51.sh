#!/usr/bin/env bash
# Stop 51's device calls (bench/results/stop51/README.md): the H200 figures of the MoE plans at the rule (moe.carveout
# = 100 since stop 50) with llama.cpp in the same call. Everything of a part is tarred into $OUT/stop51-<part>.tar
# (a call returns at most 8 files). Plans (bench/plans, carried):
#   kestrelc build qwen3-next-80b-a3b --target sm_90 --weights random --quant q4 --max-seq 4096 --prefill-rows 256 \
#     -o bench/plans/qwen3-next-80b-a3b-sm90-q4.plan      (likewise qwen3.5-35b-a3b -> qwen3.5-35b-a3b-sm90-q4.plan)
#   profile  llama.cpp built for `next` (kept in /tmp/llamacpp while the machine stays warm), then each plan's
#            --profile (8 new tokens after a 40-token prompt) and --bench (64 new tokens, 3 rounds)
#   next     llama.cpp on the whole 80B-A3B shape (Q4_0 GGUF by bench/mkgguf_next.py, llama-bench tg128 / pp512,
#            3 reps) and Kestrel's 80B-A3B q4 (A A: bench/device_preload_ab.sh) in the same call, on `profile`'s
#            warm machine
#   next35   the same at the 35B-A3B shape (qwen35moe GGUF)
#   pf       (call 5, a fresh machine) llama.cpp built, its 80B-A3B and 35B-A3B Q4_0 tg128 / pp512, then Kestrel's prefill
#            of both plans at 512 and 2,048 prompt tokens (--prompt-lengths) with their decode, in the same call
#   carve    moe.carveout (stop 50's rule, measured on an H100) on the H200: each plan against the same build with
#            KESTREL_RULES="moe.carveout=-1" (into -nocarve.plan), A B B A twice
# There: run(carry=[".peers", "bench/plans"]): bash bench/device_stop51.sh $OUT PART
# (.peers: llamacpp.tar.xz from ../shared/peers/llamacpp/fetch.sh and llamacpp-scripts, a copy of that folder)
set -u
out=$1; part=${2:-profile}
r=$out/r; mkdir -p "$r"
pack() { tar -C "$r" -cf "$out/stop51-$part.tar" .; }
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv,noheader | tee "$r/gpu.txt"
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
n80=qwen3-next-80b-a3b-sm90-q4; n35=qwen3.5-35b-a3b-sm90-q4
case $part in
  profile)
    timeout 330 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$r" > "$r/llamacpp-build.txt" 2>&1
    echo "llama.cpp build: exit $?"; pack
    for p in $n80 $n35; do
      timeout 100 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 8 --profile "$r/profile-$p.json" \
        > "$r/profile-$p.txt" 2>&1; echo "profile $p: exit $?"
      grep "^\[gpu\]" "$r/profile-$p.txt"; grep -A22 "^in the graph" "$r/profile-$p.txt" | head -24
      timeout 100 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 \
        --bench "$r/bench-$p.json" > "$r/bench-$p.txt" 2>&1
      python3 bench/bench_line.py "$r/bench-$p.json" "$p" 2>/dev/null || tail -3 "$r/bench-$p.txt"
      pack
    done ;;
  next|next35)
    if [ "$part" = next ]; then m=qwen3-next-80b-a3b; p=$n80; else m=qwen3.5-35b-a3b; p=$n35; fi
    PP=512 TG=128 REPS=3 CLEAN=1 timeout 430 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$r" $m
    echo "llama.cpp: exit $?"; pack
    STEP_TIMEOUT=60 SEQ="$p" timeout 130 bash bench/device_preload_ab.sh "$r"
    pack ;;
  pf)
    timeout 330 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$r" > "$r/llamacpp-build.txt" 2>&1
    echo "llama.cpp build: exit $?"
    PP=512 TG=128 REPS=3 CLEAN=1 timeout 150 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$r" qwen3-next-80b-a3b
    PP=512 TG=128 REPS=3 CLEAN=1 timeout 100 bash bench/llamacpp_next.sh .peers/llamacpp.tar.xz "$r" qwen3.5-35b-a3b
    pack
    for p in $n80 $n35; do
      timeout 120 kestrel-run "bench/plans/$p.plan" --prompt-ids "$ids" --max-new-tokens 64 --rounds 3 \
        --prompt-lengths 512,2048 --bench "$r/prefill-$p.json" > "$r/prefill-$p.txt" 2>&1
      echo "prefill $p: exit $?"; tail -8 "$r/prefill-$p.txt"; pack
    done ;;
  carve)
    STEP_TIMEOUT=90 PAIRS="$n80-nocarve:$n80 $n35-nocarve:$n35 $n80-nocarve:$n80 $n35-nocarve:$n35" \
      timeout 500 bash bench/device_preload_ab.sh "$r" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
pack
