#!/usr/bin/env bash
# One GPU check, run from the repository root on a machine with a CUDA GPU.
# Stages, in the order they run by default (most telling first):
#   quant_goal         issue 26's goal: tools/bench_quant.py --engine-gpu, a random Llama-8B-shape Q4_0
#                      GGUF written on the spot, packed vs bf16-dequantized decode, batch 1 and 16 (a 4.5 GB
#                      file, two engine loads, ~50 kernel compiles)
#   quant_engine       packed GGUF engines on CUDA against dequantized ones (tests/model_gguf/test_gguf_packed_gpu.py)
#   quant_kernels      the matmuls alone on Llama-8B's shapes (tools/bench_quant.py --gpu-kernels)
#   pipelined          pipelined steps on CUDA, and that no launch syncs with the device (test_pipelined_steps.py)
#   oracle_graphs      the HF oracle with the engine on CUDA, graphs on for every family (sliding-window ones
#                      too, off by default until this passes), serial and pipelined steps
#   gpu_tests          the compiled-kernel tests (pytest -m gpu tests/kernels)
#   oracle_split       the oracle with split-K decode attention on (forced to 4 splits of 16 positions), graphs on
#   oracle_fused       the oracle with the fused Triton kernels on, graphs on
#   oracle_eager       the oracle with graphs off
#   tier_oracle        the CPU-tier oracle on CUDA streams (tests/connector/test_oracle_tiers.py -k cuda)
#   oracle_modes       the oracle's other modes with graphs on (async scheduling, speculative decoding)
#   oracle_bf16        the oracle in bfloat16 (checkpoint, HF and engine; the switches' defaults): tokens
#                      equal up to the first near tie (test_oracle.py's LOW_PRECISION_TIE)
#   bench              tools/bench_gpu.py --quick (end to end)
#   kernels            the kernel benchmarks (bench_kernels, bench_attention, bench_fused_kernels)
# Groups: quant = quant_goal,quant_engine,quant_kernels; tests = gpu_tests,pipelined,tier_oracle;
# oracle = oracle_graphs,oracle_split,oracle_fused,oracle_eager,oracle_modes,oracle_bf16.
#
#   bash tools/gpu_check.sh [stage,stage,...]     (default: all, in the order above)
#
# Stages run in the order given, each under its own time limit, all within BUDGET_S seconds
# (default 560: one 600 s device call). A stage starts only with >= 30 s of the budget left and its
# limit is cut to what is left; the script ends by printing the stages it did not reach, as the
# command for the next call. A session's device time (15 min, machine start included) fits about one
# such call and part of a second: run `bash tools/gpu_check.sh` once, then the printed rest.
# Each stage writes its log (and JSON) under $OUT (default ./gpu_out): tests one line each (pytest -v),
# the benches a JSON line per finished part on stderr, so a stage cut short keeps what it measured.
# Missing Python packages can be put in .whl/ as wheels (README, "On a GPU"); a preflight import
# names any module still missing before the first stage.
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
ALL="quant_goal quant_engine quant_kernels pipelined oracle_graphs gpu_tests oracle_split oracle_fused oracle_eager"
ALL="$ALL tier_oracle oracle_modes oracle_bf16 bench kernels"
STAGES=()
for s in ${1:-$ALL}; do  # names separated by commas or spaces; groups expanded
  for s in ${s//,/ }; do
    case $s in
      quant) STAGES+=(quant_goal quant_engine quant_kernels) ;;
      tests) STAGES+=(gpu_tests pipelined tier_oracle) ;;
      oracle) STAGES+=(oracle_graphs oracle_split oracle_fused oracle_eager oracle_modes oracle_bf16) ;;
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
import importlib, sys
need = "torch triton transformers xxhash msgspec structlog zmq cbor2 redis gguf uvloop pytest pytest_asyncio safetensors tokenizers".split()
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python modules: {', '.join(missing)} (put their wheels in .whl/)")
import torch, triton
print(torch.__version__, triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
EOF

stage() {  # stage NAME SECONDS COMMAND...: run under min(SECONDS, budget left), log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS - 5))
  (( left < limit )) && limit=$left
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"
  tail -n "${TAIL:-6}" "$OUT/$name.log"
}
PYTEST="$PY -m pytest -v --tb=short -rfEs -p no:cacheprovider -p pytest_asyncio"
ORACLE="tests/enginecore/test_oracle.py"
run() {  # run STAGE
  case $1 in
    quant_goal) TAIL=3 stage bench_quant_gpu "${QUANT_S:-420}" sh -c \
        "$PY tools/bench_quant.py --engine-gpu --engine-repeats 1 > '$OUT/bench_quant_gpu.json'"
      cat "$OUT/bench_quant_gpu.json" ;;
    quant_engine) stage quant_engine 150 $PYTEST tests/model_gguf/test_gguf_packed_gpu.py ;;
    quant_kernels) TAIL=3 stage bench_quant_kernels "${QUANT_K_S:-200}" sh -c \
        "$PY tools/bench_quant.py --gpu-kernels > '$OUT/bench_quant_kernels.json'"
      cat "$OUT/bench_quant_kernels.json" ;;
    pipelined) KVSTRATA_TEST_DEVICE=cuda stage pipelined_steps 90 $PYTEST tests/enginecore/test_pipelined_steps.py ;;
    gpu_tests) stage gpu_tests 150 $PYTEST -m gpu tests/kernels ;;
    tier_oracle) stage cuda_tier_oracle 90 $PYTEST tests/connector/test_oracle_tiers.py -k cuda ;;
    oracle_graphs) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=1 stage oracle_graphs "${ORACLE_S:-150}" $PYTEST $ORACLE \
        -k "${ORACLE_K:-serial or pipelined}" ;;
    oracle_modes) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=1 stage oracle_modes "${ORACLE_S:-150}" $PYTEST $ORACLE -k "async or spec" ;;
    oracle_bf16) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_DTYPE=bfloat16 stage oracle_bf16 "${ORACLE_S:-100}" $PYTEST $ORACLE \
        -k "${ORACLE_K:-serial or pipelined}" ;;
    oracle_eager) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=0 stage oracle_eager "${ORACLE_S:-100}" \
        $PYTEST $ORACLE -k "${ORACLE_K:-serial or async or pipelined}" ;;
    oracle_fused) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=1 KVSTRATA_TEST_FUSED_KERNELS=1 stage oracle_fused "${ORACLE_S:-100}" \
        $PYTEST $ORACLE -k "${ORACLE_K:-serial or async or pipelined}" ;;
    oracle_split) KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=1 KVSTRATA_TEST_SPLIT_DECODE=1 stage oracle_split "${ORACLE_S:-100}" \
        $PYTEST $ORACLE -k "${ORACLE_K:-serial or async or pipelined}" ;;
    bench) TAIL=3 stage bench_gpu "${BENCH_S:-240}" sh -c "$PY tools/bench_gpu.py --quick > '$OUT/bench_gpu.json'"
      cat "$OUT/bench_gpu.json" ;;
    kernels) for b in bench_kernels bench_attention bench_fused_kernels; do
        TAIL=2 stage "$b" 90 sh -c "$PY tools/$b.py --quick > '$OUT/$b.json'"
        cat "$OUT/$b.json"; echo
      done ;;
  esac
}
rest=()
for s in "${STAGES[@]}"; do
  if (( ${#rest[@]} )) || (( DEADLINE - SECONDS < 30 )); then
    rest+=("$s")
    continue
  fi
  run "$s"
done
if (( ${#rest[@]} )); then
  joined=$(IFS=,; echo "${rest[*]}")
  echo "=== not reached within BUDGET_S: next call: bash tools/gpu_check.sh $joined"
fi
