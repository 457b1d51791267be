#!/usr/bin/env bash
# One GPU check, run from the repository root on a machine with a CUDA GPU.
# Stages, in the order they run by default (most telling first):
#   quant_goal         issue 26's goal: tools/bench_quant.py --engine-gpu --gpu-layout, a random Llama-8B-shape
#                      Q4_0 GGUF written on the spot, packed (blocks, and re-laid: model.gpu_quant_layout) vs
#                      bf16-dequantized decode, batch 1 and 16 (a 4.5 GB file, three engine loads)
#   quant_engine       packed GGUF engines on CUDA against dequantized ones (tests/model_gguf/test_gguf_packed_gpu.py,
#                      and with the GPU layout: test_gguf_gpu_layout.py -m gpu)
#   quant_kernels      the matmuls alone on Llama-8B's shapes, the blocks' kernels and the GPU layout's
#                      (tools/bench_quant.py --gpu-kernels)
#   quant_tiles        the packed kernels' tile sweep (tools/sweep_quant_tiles.py; its configs are
#                      compiled beside the test stages when those run side by side)
#   pipelined          pipelined steps on CUDA, and that no launch syncs with the device (test_pipelined_steps.py)
#   oracle_graphs      the HF oracle with the engine on CUDA, graphs on for every family (sliding-window ones
#                      too), serial and pipelined steps, the other switches at their defaults (fused
#                      kernels and split-K decode on)
#   gpu_tests          the compiled-kernel tests (pytest -m gpu tests/kernels)
#   oracle_split       the oracle with split-K decode attention forced to 4 splits of 16 positions, graphs on
#   oracle_unfused     the oracle with fused kernels and split-K decode off (each switch's false), graphs on
#   oracle_eager       the oracle with graphs off
#   tier_oracle        the CPU-tier oracle on CUDA streams (tests/connector/test_oracle_tiers.py -k cuda)
#   oracle_modes       the oracle's other modes with graphs on (async scheduling, speculative decoding)
#   oracle_bf16        the oracle in bfloat16 (checkpoint, HF and engine; the switches' defaults): tokens
#                      equal up to the first near tie (test_oracle.py's LOW_PRECISION_TIE)
#   bench              tools/bench_gpu.py --quick (end to end)
#   bench_base         its decode sections with fused kernels and split-K decode off (the CUDA
#                      defaults before an H200 run checked them): bench's baseline in the same call
#   kernels            the kernel benchmarks (bench_kernels, bench_attention, bench_fused_kernels)
#   attention_tune     tools/bench_attention.py --tune: decode tiles, warps, stages and split counts
#                      against SDPA (decode attention is 1.1-1.3x SDPA from batch 8 on)
#   host_profile       py-spy (its wheel in .whl/) over bench_gpu's 64-request batch section, every
#                      thread, collapsed stacks in $OUT/host_profile.txt (tools/profile_summary.py: per
#                      thread, the functions holding the busy samples): where the host's time per
#                      decode step goes on the GPU machine (the GPU idles for it)
# Groups: quant = quant_goal,quant_engine,quant_kernels,quant_tiles; tests = gpu_tests,pipelined,tier_oracle;
# oracle = oracle_graphs,oracle_split,oracle_unfused,oracle_eager,oracle_modes,oracle_bf16.
#
#   bash tools/gpu_check.sh [stage,stage,...]     (default: all, in the order above)
#
# The test stages (quant_engine, pipelined, gpu_tests, tier_oracle, oracle_*) run first, side by side
# (PARALLEL=1, the default; 0: one at a time, in the order given), each under PAR_S seconds (default
# 240): they compile more than they run, and the GPU holds them all. quant_goal's GGUF is written
# meanwhile. Then the timed stages run one at a time, in the order given, each under its own time
# limit, all within BUDGET_S seconds (default 560: one 600 s device call). A stage starts only with
# >= 30 s of the budget left and its limit is cut to what is left (bench passes it on as
# --time-budget-s; BENCH_SECTIONS picks its sections); the script ends by printing the stages it did
# not reach, as the command for the next call. A session's device time (15 min, machine start
# included) fits about one such call and part of a second: run `bash tools/gpu_check.sh` once, then
# the printed rest.
# Each stage writes its log (and JSON) under $OUT (default ./gpu_out): tests one line each (pytest -v),
# the benches a JSON line per finished part on stderr, so a stage cut short keeps what it measured.
# Missing Python packages can be put in .whl/ as wheels (README, "On a GPU"); a preflight import
# names any module still missing before the first stage.
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
: >"$OUT/summary.txt"  # this run's stages only
ALL="quant_goal quant_engine quant_kernels quant_tiles pipelined oracle_graphs gpu_tests oracle_split oracle_unfused oracle_eager"
ALL="$ALL tier_oracle oracle_modes oracle_bf16 bench bench_base kernels attention_tune host_profile"
STAGES=()
for s in ${1:-$ALL}; do  # names separated by commas or spaces; groups expanded
  for s in ${s//,/ }; do
    case $s in
      quant) STAGES+=(quant_goal quant_engine quant_kernels quant_tiles) ;;
      tests) STAGES+=(gpu_tests pipelined tier_oracle) ;;
      oracle) STAGES+=(oracle_graphs oracle_split oracle_unfused oracle_eager oracle_modes oracle_bf16) ;;
      *) [[ " $ALL " == *" $s "* ]] || { echo "unknown stage: $s (see the header of tools/gpu_check.sh)"; exit 2; }
         STAGES+=("$s") ;;
    esac
  done
done
PY="${PYTHON:-python3}"
DEADLINE=$((SECONDS + ${BUDGET_S:-560}))
if compgen -G ".whl/*.whl" >/dev/null; then
  if ! $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    echo "pip could not install .whl/: unpacking the wheels instead"
    for w in .whl/*.whl; do $PY -m zipfile -e "$w" /tmp/site || exit 1; done
  fi
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
$PY - <<'EOF' || exit 1
import importlib.util, sys
need = "torch triton transformers xxhash msgspec structlog zmq cbor2 redis gguf uvloop pytest pytest_asyncio safetensors tokenizers".split()
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python modules: {', '.join(missing)} (put their wheels in .whl/)")
import torch, triton, pytest
print("torch", torch.__version__, "triton", triton.__version__, "pytest", pytest.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
EOF

limit() {  # limit SECONDS: min(SECONDS, budget left), at least 0
  local left=$((DEADLINE - SECONDS - 5))
  (( left < 0 )) && left=0
  (( left < $1 )) && echo "$left" || echo "$1"
}
stage() {  # stage NAME SECONDS COMMAND...: run under min(SECONDS, budget left), log to $OUT/NAME.log
  local name=$1 limit; limit=$(limit "${SIDE_LIMIT:-$2}"); shift 2
  if (( limit < 5 )); then  # timeout 0 would mean no limit at all
    printf '=== %s skipped: the budget is spent\n' "$name" | tee -a "$OUT/summary.txt"
    return
  fi
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local last=""  # the test stages' pytest summary line, in the same record (stages run side by side)
  [[ $name == *oracle* || $name == *tests* || $name == *steps* || $name == quant_engine ]] &&
    last=$'\n'$(tail -n 1 "$OUT/$name.log" | cut -c1-300)
  printf '=== %s rc=%s %ss%s\n' "$name" "$rc" "$((SECONDS - t0))" "$last" >>"$OUT/summary.txt"
  echo "=== $name rc=$rc $((SECONDS - t0))s"
  tail -n "${TAIL:-6}" "$OUT/$name.log" | cut -c1-400
}
brief() {  # brief FILE.json: each top-level entry on one line, cut at BRIEF chars (the whole file is in $OUT)
  $PY - "$1" "${BRIEF:-700}" <<'EOF'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"{sys.argv[1]}: no JSON ({e})")
for key, value in report.items():
    print(key, json.dumps(value, separators=(",", ":"))[:int(sys.argv[2])])
EOF
}
PYTEST="$PY -m pytest -v --tb=short -rfEs -p no:cacheprovider -p pytest_asyncio"
ORACLE="tests/enginecore/test_oracle.py"
run() {  # run STAGE
  case $1 in
    quant_goal) [[ -n ${WRITER:-} ]] && wait "$WRITER"  # the GGUF written beside the tests
      TAIL=3 stage bench_quant_gpu "${QUANT_S:-500}" sh -c \
        "$PY tools/bench_quant.py --engine-gpu --gpu-layout --engine-repeats 1 --gpu-file '$GGUF' > '$OUT/bench_quant_gpu.json'"
      BRIEF=1500 brief "$OUT/bench_quant_gpu.json" ;;
    quant_tiles) TAIL=2 stage quant_tiles "${TILES_S:-120}" sh -c "$PY tools/sweep_quant_tiles.py > '$OUT/quant_tiles.json'"
      BRIEF=1200 brief "$OUT/quant_tiles.json" ;;
    quant_engine) stage quant_engine 240 $PYTEST -m gpu tests/model_gguf/test_gguf_packed_gpu.py \
      tests/model_gguf/test_gguf_gpu_layout.py ;;
    quant_kernels) TAIL=3 stage bench_quant_kernels "${QUANT_K_S:-260}" sh -c \
        "$PY tools/bench_quant.py --gpu-kernels > '$OUT/bench_quant_kernels.json'"
      brief "$OUT/bench_quant_kernels.json" ;;
    pipelined) KVSTRATA_TEST_DEVICE=cuda stage pipelined_steps 90 $PYTEST tests/enginecore/test_pipelined_steps.py ;;
    gpu_tests) local xd=""  # 4 workers where pytest-xdist is installed (the GPU image has it): ~190 s alone
      $PY -c "import xdist" 2>/dev/null && xd="-n 4"
      stage gpu_tests 150 $PYTEST $xd -m gpu tests/kernels ;;
    tier_oracle) stage cuda_tier_oracle 90 $PYTEST tests/connector/test_oracle_tiers.py -k cuda ;;
    oracle_graphs) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=1 stage oracle_graphs "${ORACLE_S:-150}" $PYTEST $ORACLE \
        -k "${ORACLE_K:-serial or pipelined}" ;;
    oracle_modes) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=1 stage oracle_modes "${ORACLE_S:-150}" $PYTEST $ORACLE -k "async or spec" ;;
    oracle_bf16) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_DTYPE=bfloat16 stage oracle_bf16 "${ORACLE_S:-100}" $PYTEST $ORACLE \
        -k "${ORACLE_K:-serial or pipelined}" ;;
    oracle_eager) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=0 stage oracle_eager "${ORACLE_S:-100}" \
        $PYTEST $ORACLE -k "${ORACLE_K:-serial or async or pipelined}" ;;
    oracle_unfused) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=1 KVSTRATA_TEST_FUSED_KERNELS=0 \
        KVSTRATA_TEST_SPLIT_DECODE=0 stage oracle_unfused "${ORACLE_S:-100}" \
        $PYTEST $ORACLE -k "${ORACLE_K:-serial or async or pipelined}" ;;
    oracle_split) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=1 KVSTRATA_TEST_SPLIT_DECODE=1 stage oracle_split "${ORACLE_S:-100}" \
        $PYTEST $ORACLE -k "${ORACLE_K:-serial or async or pipelined}" ;;
    bench) local b; b=$(limit "${BENCH_S:-240}")
      TAIL=3 stage bench_gpu "$b" sh -c "$PY tools/bench_gpu.py --quick --time-budget-s $((b - 20)) \
        ${BENCH_SECTIONS:+--sections $BENCH_SECTIONS} > '$OUT/bench_gpu.json'"
      brief "$OUT/bench_gpu.json" ;;
    bench_base) local b; b=$(limit "${BENCH_BASE_S:-90}")
      TAIL=3 stage bench_base "$b" sh -c "$PY tools/bench_gpu.py --quick --time-budget-s $((b - 20)) \
        --fused-kernels off --split-decode off \
        --sections decode_single_stream,batch_64x512_128,profile_decode_step > '$OUT/bench_base.json'"
      brief "$OUT/bench_base.json" ;;
    attention_tune) TAIL=2 stage attention_tune "${TUNE_S:-150}" sh -c \
        "$PY tools/bench_attention.py --quick --tune > '$OUT/attention_tune.json'"
      BRIEF=2500 brief "$OUT/attention_tune.json" ;;
    host_profile) local spy; spy=$(command -v py-spy || ls /tmp/site/bin/py-spy 2>/dev/null)
      [[ -z $spy ]] && { echo "=== host_profile: no py-spy (put its wheel in .whl/)"; return; }
      TAIL=2 stage host_profile "${PROFILE_S:-90}" "$spy" record -r 500 --threads --format raw \
        -o "$OUT/host_profile.txt" -- $PY tools/bench_gpu.py --quick --sections batch_64x512_128
      [[ -s $OUT/host_profile.txt ]] && $PY tools/profile_summary.py "$OUT/host_profile.txt" --top 15 \
        --match kvstrata >"$OUT/host_profile.json" && BRIEF=1500 brief "$OUT/host_profile.json" ;;
    kernels) for b in bench_kernels bench_attention bench_fused_kernels; do
        TAIL=2 stage "$b" 90 sh -c "$PY tools/$b.py --quick > '$OUT/$b.json'"
        brief "$OUT/$b.json"
      done ;;
  esac
}
GGUF=/tmp/kvstrata-gpu-check-8b-Q4_0.gguf  # quant_goal's random checkpoint (kept for a second call)
TESTS=" quant_engine pipelined gpu_tests tier_oracle oracle_graphs oracle_split oracle_unfused oracle_eager oracle_modes oracle_bf16 "
if [[ ${PARALLEL:-1} != 0 ]]; then
  side=() timed=()
  for s in "${STAGES[@]}"; do [[ $TESTS == *" $s "* ]] && side+=("$s") || timed+=("$s"); done
  if [[ " ${timed[*]:-} " == *" quant_goal "* ]]; then
    $PY tools/bench_quant.py --engine-gpu --write-only --gpu-file "$GGUF" >"$OUT/gguf_write.log" 2>&1 &
    WRITER=$!
    trap 'kill "$WRITER" 2>/dev/null' EXIT  # quant_goal not reached: the writer goes with the script
  fi
  if [[ " ${timed[*]:-} " == *" quant_tiles "* ]]; then  # the sweep's kernels compiled meanwhile (disk cache)
    $PY tools/sweep_quant_tiles.py --compile-only --jobs 8 >"$OUT/quant_tiles_compile.log" 2>&1 &
    COMPILER=$!
  fi
  pids=()
  for s in "${side[@]}"; do  # side by side; each prints its summary when all are done
    ( export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}; SIDE_LIMIT=${PAR_S:-240} run "$s" >"$OUT/$s.summary" 2>&1 ) &
    pids+=($!)
  done
  (( ${#pids[@]} )) && wait "${pids[@]}"
  [[ -n ${COMPILER:-} ]] && { wait "$COMPILER"; echo "=== quant_tiles compile rc=$?"; tail -n 3 "$OUT/quant_tiles_compile.log"; }
  for s in "${side[@]}"; do cat "$OUT/$s.summary"; done
  STAGES=("${timed[@]}")
fi
rest=()
for s in "${STAGES[@]}"; do
  if (( ${#rest[@]} )) || (( DEADLINE - SECONDS < 30 )); then
    rest+=("$s")
    continue
  fi
  run "$s"
done
echo "=== stages"; cat "$OUT/summary.txt"
if (( ${#rest[@]} )); then
  joined=$(IFS=,; echo "${rest[*]}")
  echo "=== not reached within BUDGET_S: next call: bash tools/gpu_check.sh $joined"
fi
