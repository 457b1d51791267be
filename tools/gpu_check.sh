#!/usr/bin/env bash
# One GPU check, run from the repository root on a machine with a CUDA GPU:
#   1. the compiled-kernel and CUDA tests (pytest -m gpu, and the CUDA-stream tier oracle)
#   2. the HF oracle with the engine on CUDA: CUDA graphs on, graphs off, fused kernels on,
#      split-K decode attention on; each also with pipelined steps (mode "pipelined")
#   3. quantized weights on CUDA (issue 26): packed GGUF engines against dequantized ones
#      (tests/model_gguf/test_gguf_packed_gpu.py), the matmuls alone on Llama-8B's gate/down
#      shapes (tools/bench_quant.py --gpu-kernels: the decode GEMV vs _triton_quant's kernel
#      vs bf16 torch.mm, 1-16 tokens), and the decode goal on a random 8B-shape
#      Q4_0 GGUF (tools/bench_quant.py --engine-gpu: packed vs bf16-dequantized, batch 1 and 16)
#   4. tools/bench_gpu.py (end to end) and the kernel benchmarks
# Each stage has its own time limit and writes its log (and JSON) under $OUT
# (default ./gpu_out), so a stage that fails or runs long does not hide the
# others. Missing Python packages can be put in .whl/ as wheels (see
# docs/ARCHITECTURE.md, "Running on a GPU").
#
#   bash tools/gpu_check.sh [stages]    stages: tests,quant,oracle,bench,kernels (default all);
#                                       oracle_graphs, oracle_eager, oracle_fused, oracle_split: one oracle run;
#                                       quant_kernels (quant's tests and --gpu-kernels), quant_goal (its 8B bench)
# The limits add up to more than one 10-minute device call: run it in parts, e.g.
# "quant_goal" (issue 26's goal, the 8B-shape GGUF bench alone, 420 s: a 4.5 GB file written,
# two engine loads, ~50 kernel compiles), then "quant_kernels,tests" (limits 630 s in all; the
# stages usually take a fraction of theirs), then "oracle_graphs,oracle_split,bench", then "kernels".
set -uo pipefail
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
STAGES="${1:-tests,quant,oracle,bench,kernels}"
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
has() { [[ ",$STAGES," == *",$1,"* ]]; }
stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc $((SECONDS - t0))s"
  tail -n "${TAIL:-6}" "$OUT/$name.log"
}
$PY -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"

if has tests; then
  stage gpu_tests 150 $PY -m pytest -q -p no:cacheprovider -p pytest_asyncio -m gpu tests/kernels
  KVSTRATA_TEST_DEVICE=cuda stage pipelined_steps 90 $PY -m pytest -q -p no:cacheprovider -p pytest_asyncio \
    tests/enginecore/test_pipelined_steps.py
  stage cuda_tier_oracle 90 $PY -m pytest -q -p no:cacheprovider -p pytest_asyncio tests/connector/test_oracle_tiers.py -k cuda
fi
if has quant || has quant_kernels; then
  stage quant_engine 150 $PY -m pytest -q -p no:cacheprovider -p pytest_asyncio tests/model_gguf/test_gguf_packed_gpu.py
  TAIL=3 stage bench_quant_kernels 150 sh -c "$PY tools/bench_quant.py --gpu-kernels > '$OUT/bench_quant_kernels.json'"
  cat "$OUT/bench_quant_kernels.json"
fi
if has quant || has quant_goal; then
  TAIL=3 stage bench_quant_gpu "${QUANT_S:-420}" sh -c \
    "$PY tools/bench_quant.py --engine-gpu --engine-repeats 1 > '$OUT/bench_quant_gpu.json'"
  cat "$OUT/bench_quant_gpu.json"
fi
ORACLE="tests/enginecore/test_oracle.py"
if has oracle || has oracle_graphs; then
  KVSTRATA_TEST_DEVICE=cuda stage oracle_graphs "${ORACLE_S:-150}" $PY -m pytest -q -p no:cacheprovider -p pytest_asyncio $ORACLE \
    -k "${ORACLE_K:-serial or async or spec or pipelined}"
fi
if has oracle || has oracle_eager; then
  KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_CUDA_GRAPHS=0 stage oracle_eager "${ORACLE_S:-100}" \
    $PY -m pytest -q -p no:cacheprovider -p pytest_asyncio $ORACLE -k "${ORACLE_K:-serial or async or pipelined}"
fi
if has oracle || has oracle_fused; then
  KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_FUSED_KERNELS=1 stage oracle_fused "${ORACLE_S:-100}" \
    $PY -m pytest -q -p no:cacheprovider -p pytest_asyncio $ORACLE -k "${ORACLE_K:-serial or async or pipelined}"
fi
if has oracle || has oracle_split; then
  KVSTRATA_TEST_DEVICE=cuda KVSTRATA_TEST_SPLIT_DECODE=1 stage oracle_split "${ORACLE_S:-100}" \
    $PY -m pytest -q -p no:cacheprovider -p pytest_asyncio $ORACLE -k "${ORACLE_K:-serial or async or pipelined}"
fi
if has bench; then
  TAIL=3 stage bench_gpu "${BENCH_S:-240}" sh -c "$PY tools/bench_gpu.py --quick > '$OUT/bench_gpu.json'"
  cat "$OUT/bench_gpu.json"
fi
if has kernels; then
  for b in bench_kernels bench_attention bench_fused_kernels; do
    if [ -f "tools/$b.py" ]; then
      TAIL=2 stage "$b" 90 sh -c "$PY tools/$b.py --quick > '$OUT/$b.json'"
      cat "$OUT/$b.json"; echo
    fi
  done
fi
