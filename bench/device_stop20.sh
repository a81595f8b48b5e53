#!/usr/bin/env bash
# Issue 13 on the GPU, one call (stop 20): the folded norms, the GQA-grouped attention step and the
# faster top-k sampling, whole-plan. Per plan of PLANS (names under bench/plans, without .plan), in
# order, the tar in OUTDIR rewritten after every step (a call stopped at its limit still returns what ran):
#   --bench as built (the load-time PDL trial picks the graph's edges; greedy and sampled; 27B also at
#   positions 4k / 32k / 128k and a 2048-token prompt), --verify (graph vs streaming, byte for byte),
#   --profile; then compute-sanitizer on the tiny M-row plans (SANITIZE=1), the decode kernels against
#   their references and the sampling timings (KERNELS=1), and llama-bench on 0.8B bf16 / Q4_0 with
#   llama.cpp built in the background at the start (PEER=1; .peers carried).
#   PLANS="..." [BENCH_PLANS="..."] [VERIFY=0] [LONG=0] [SANITIZE=1] [KERNELS=1] [PEER=1] bash bench/device_stop20.sh OUTDIR
#   (kestrel importable; bench/plans carried; BENCH_PLANS and VERIFY=0: --bench only; LONG=0: no long-context
#   or prefill runs)
set -u
out=$1; w=$(mktemp -d); t0=$(date +%s)
ids=$(python3 -c "print(','.join(str((i * 7919) % 5000 + 3) for i in range(40)))")
save() { tar -C "$w" -cf "$out/stop20.tar" .; echo "[$(( $(date +%s) - t0 )) s] $1"; }
extra() {  # the bench's extra arguments per plan (LONG=0: none)
  [ "${LONG:-1}" = 1 ] || return 0
  case $1 in
    qwen3.5-27b-*) echo "--positions 4096,32768,131072 --prompt-lengths 2048" ;;
    qwen3.5-0.8b-*) echo "--prompt-lengths 2048" ;;
  esac
}
nvidia-smi --query-gpu=name,clocks.max.mem,clocks.max.sm,power.limit --format=csv,noheader
peer=/tmp/kestrel-peer20; mkdir -p "$peer"; here=.peers/llamacpp-scripts
if [ "${PEER:-0}" = 1 ]; then
  nice -n 19 bash "$here/device.sh" .peers/llamacpp.tar.xz "$peer" > "$w/llamacpp-build.txt" 2>&1 &
  build=$!
fi
for n in ${PLANS:-} ${BENCH_PLANS:-}; do
  p=bench/plans/$n.plan
  # shellcheck disable=SC2046
  kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 64 --bench "$w/bench-$n.json" $(extra "$n") 2>&1 | tail -4
  if [ "${VERIFY:-1}" = 1 ] && [[ " ${PLANS:-} " == *" $n "* ]]; then
    kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 32 --verify --json > "$w/verify-$n.json" 2> "$w/verify-$n.err"
    echo "$n verify: $(cat "$w/verify-$n.json") $(tail -1 "$w/verify-$n.err")"
    kestrel-run "$p" --prompt-ids "$ids" --max-new-tokens 8 --profile "$w/profile-$n.json" > "$w/profile-$n.txt" 2>&1
    tail -1 "$w/profile-$n.txt"
  fi
  save "$n"
done
if [ "${SANITIZE:-0}" = 1 ]; then
  for q in bf16 q4; do
    p=bench/plans/tiny-sm90-$q-m8.plan
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 bench/device_sanitize.py "$p" > "$w/sanitizer-tiny-$q-m8.txt" 2>&1
    echo "sanitizer tiny-$q-m8: exit $? ($(grep -c 'ERROR SUMMARY: 0 errors' "$w/sanitizer-tiny-$q-m8.txt") clean summaries)"
  done
  save sanitizer
fi
if [ "${KERNELS:-0}" = 1 ]; then
  python3 bench/device_decode_kernels.py "$w/decode-kernels.json" > "$w/decode-kernels.txt" 2>&1
  grep -v -i warn "$w/decode-kernels.txt" | tail -14
  save "decode kernels"
fi
if [ "${PEER:-0}" = 1 ]; then
  wait $build; tail -2 "$w/llamacpp-build.txt"
  PP=512 TG=128 REPS=3 bash "$here/device.sh" .peers/llamacpp.tar.xz "$peer" qwen3.5-0.8b:bf16 qwen3.5-0.8b:q4_0 \
    > "$w/llamacpp-bench.txt" 2>&1
  tail -8 "$w/llamacpp-bench.txt"; cp "$peer"/llamacpp-*.json "$w"/ 2>/dev/null
  save "llama.cpp"
fi
python3 - "$w" <<'PY'
import glob, json, os, sys
print(f"{'plan':26} {'launch':>6} {'greedy':>7} {'sampled':>7} {'stream':>7} {'roof':>6} {'of':>6} pdl  long context")
for f in sorted(glob.glob(os.path.join(sys.argv[1], "bench-*.json"))):
    b = json.load(open(f))
    ms = b["ms_per_token"]
    lc = " ".join(f"{c['position']}:{c['ms_per_token']:.2f}" for c in b.get("long_context") or [] if "position" in c)
    print(f"{os.path.basename(f)[6:-5]:26} {b['launches_per_token']:6d} {ms['graph']:7.3f} {ms['graph_sampled']:7.3f} "
          f"{ms['stream']:7.3f} {b['roofline_ms']:6.3f} {b['fraction_of_roofline']:6.1%} {b['graph_pdl']!s:5} {lc}")
PY
save done
