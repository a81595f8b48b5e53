#!/usr/bin/env bash
# On the device: llama.cpp on a random-weight Qwen3-Next or Qwen3.5 MoE Q4_0 GGUF, side by side with Kestrel.
#   bash bench/llamacpp_next.sh TARBALL OUTDIR MODEL[:LAYERS] ...
#     MODEL: a qwen3_next preset (qwen3-next-80b-a3b, tiny-next) or qwen3_5_moe_text preset (qwen3.5-35b-a3b,
#     tiny-moe; needs kestrel importable), or a config.json path; :LAYERS keeps the first LAYERS layers
#     (qwen3-next-80b-a3b:12 -> 9 GDN + 3 attention layers)
#   env: TG=128 PP=512 REPS=3 (llama-bench -n/-p/-r); GRAPHS_OFF=1 also runs with CUDA graphs off
# Builds llama-bench for sm_90 with ../shared/peers/llamacpp/device.sh (or its carried copy in
# .peers/llamacpp-scripts; called with no model it only
# builds, ~4 min, kept in /tmp/llamacpp while the machine stays warm), writes the GGUF with
# bench/mkgguf_next.py into /tmp/llamacpp (kept likewise; Q4_0 written directly, no requantize), runs
# `llama-bench -p PP -n TG -ngl 99 -fa 0 -r REPS -o json` into OUTDIR/llamacpp-<name>-q4_0[-nographs].json
# and prints one line per test. <name>: the preset or config file's name, -<LAYERS>l when cut.
# Sizes (Q4_0, output Q6_K): qwen3-next-80b-a3b 0.93 GB a layer + 0.43 GB (embedding, output): 12 layers
# 11.6 GB, 48 (the full 80B) 45.2 GB; qwen3.5-35b-a3b 0.475 GB a layer + 0.70 GB: 4 layers 2.61 GB, 40
# (the full 35B-A3B) 19.7 GB; the disk is 64 GB, so remove other GGUFs in /tmp/llamacpp first (CLEAN=1 does).
set -u
tarball=$1; out=$2; shift 2
here=$(cd "$(dirname "$0")" && pwd); root=$(dirname "$here")
peer=${LLAMACPP_PEER_DIR:-}
for d in "$root/../shared/peers/llamacpp" "$root/.peers/llamacpp-scripts"; do  # the second: a carried copy
  [ -z "$peer" ] && [ -f "$d/device.sh" ] && peer=$d
done
[ -n "$peer" ] || { echo "device.sh not found (../shared/peers/llamacpp, .peers/llamacpp-scripts)"; exit 2; }
W=/tmp/llamacpp; L=$W/llama.cpp/build/bin
mkdir -p "$W" "$out"
bash "$peer/device.sh" "$tarball" "$out" || exit $?   # no model given: builds only (once per warm machine)
[ -x "$L/llama-bench" ] || { echo "llama-bench not built"; exit 3; }
export LD_LIBRARY_PATH=$L:${LD_LIBRARY_PATH:-}
for spec in "$@"; do
  m=${spec%%:*}; layers=${spec#*:}; [ "$layers" = "$spec" ] && layers=
  n=$(basename "$m" .json)${layers:+-${layers}l}; g=$W/$n-q4_0.gguf
  if [ ! -f "$g" ]; then
    [ -n "${CLEAN:-}" ] && find "$W" -maxdepth 1 -name '*.gguf*' ! -name "$n-q4_0.gguf" -print -delete
    python3 "$here/mkgguf_next.py" "$W/llama.cpp" "$m" "$g" ${layers:+--layers "$layers"} > "$W/mkgguf.log" 2>&1
    grep -E "^wrote|Error|needs" "$W/mkgguf.log"
    [ -f "$g" ] || { tail -5 "$W/mkgguf.log"; continue; }
  fi
  for mode in graphs nographs; do
    [ "$mode" = nographs ] && [ -z "${GRAPHS_OFF:-}" ] && continue
    j=$out/llamacpp-$n-q4_0$([ "$mode" = nographs ] && echo -nographs).json
    env $([ "$mode" = nographs ] && echo GGML_CUDA_DISABLE_GRAPHS=1) "$L/llama-bench" -m "$g" -p "${PP:-512}" -n "${TG:-128}" \
      -ngl 99 -fa 0 -r "${REPS:-3}" -o json > "$j" 2> "$W/bench.err" || { tail -5 "$W/bench.err"; continue; }
    python3 - "$j" "$n" q4_0 "$mode" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    kind = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
    print(f"llama.cpp {sys.argv[2]} {sys.argv[3]} {sys.argv[4]} {kind}: {r['avg_ts']:.1f} tok/s "
          f"({1000 / r['avg_ts']:.3f} ms/token, sd {r['stddev_ts']:.1f} tok/s), model {r['model_size'] / 1e9:.2f} GB")
PY
  done
done
