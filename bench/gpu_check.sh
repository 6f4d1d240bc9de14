#!/usr/bin/env bash
# One GPU check, under 10 minutes on one GPU (the four stage limits below add up to 580 s): the kernel
# tests natively on CUDA (no interpreter), then the kernel benchmark, then the tensor-parallel benchmark,
# then the decode benchmark. Everything lands in OUTDIR:
#   env.txt                 GPU, driver, torch / triton versions
#   kernel_tests.log/.xml   pytest tests/kernels (log + JUnit XML)
#   kernels_bench.txt       the benchmark table (fractions of the copy bandwidth / bf16 peak measured in-run)
#   kernels_bench.json/.csv the same rows, machine-readable
#   tensor_parallel.txt     bench/tensor_parallel.py: TP=1 vs TP=2 tok/s (TP=2 skipped with one GPU)
#   decode.txt              bench/decode.py: decode tok/s and ITL at batch 1/8/64, eager vs CUDA graphs
#                           (model.compile on), against the bandwidth roofline measured in the same run
#   summary.txt             exit codes and wall seconds of the four stages
# Usage: bench/gpu_check.sh OUTDIR     (PYTHON=... to pick the interpreter; TESTS_S / BENCH_S / TP_S /
#                                       DECODE_S limits)
set -uo pipefail

OUT=${1:?usage: bench/gpu_check.sh OUTDIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}
# The decode stage gets the most: it compiles the model three times (batch 1, 8 and 64) and captures a
# CUDA graph of each, cold on a fresh machine. The kernel benchmark fits its rows to whatever it gets.
TESTS_S=${TESTS_S:-150}
BENCH_S=${BENCH_S:-90}
TP_S=${TP_S:-50}
DECODE_S=${DECODE_S:-290}

# Native kernels: the interpreter must be off (tests/conftest.py only turns it on without a GPU).
unset TRITON_INTERPRET

{
    date -u
    nvidia-smi || echo "nvidia-smi not found"
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__); \
print('cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-')"
} >"$OUT/env.txt" 2>&1

# Import tokenfleet from this checkout without installing anything: a symlink farm mirrors the package-dir
# mapping of pyproject.toml (tokenfleet.kernels -> kernels/, ...) when no editable install points here.
if ! "$PY" -c "import tokenfleet.kernels, sys; sys.exit(0 if tokenfleet.kernels.__path__[0].startswith('$REPO') else 1)" 2>/dev/null; then
    PKG=$(mktemp -d)
    mkdir -p "$PKG/tokenfleet"
    cp "$REPO/tokenfleet/__init__.py" "$PKG/tokenfleet/"
    for sub in kernels runtime operator; do ln -s "$REPO/$sub" "$PKG/tokenfleet/$sub"; done
    export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
    echo "tokenfleet imported through $PKG" >>"$OUT/env.txt"
fi

echo "== kernel tests (limit ${TESTS_S}s)"
START=$SECONDS
(
    cd tests &&
        timeout "$TESTS_S" "$PY" -m pytest --rootdir=.. -c ../pyproject.toml ../tests/kernels \
            -q -rfE --durations=15 -p no:cacheprovider --junitxml="$OUT/kernel_tests.xml"
) >"$OUT/kernel_tests.log" 2>&1
TESTS_RC=$?
TESTS_T=$((SECONDS - START))
tail -n 25 "$OUT/kernel_tests.log"

echo "== kernel benchmark (limit ${BENCH_S}s)"
START=$SECONDS
# The benchmark stops adding rows 40 s before its limit so it always gets to write its files.
timeout "$BENCH_S" "$PY" bench/kernels.py --out "$OUT" --budget $((BENCH_S - 40)) >"$OUT/kernels_bench.txt" 2>&1
BENCH_RC=$?
BENCH_T=$((SECONDS - START))
cat "$OUT/kernels_bench.txt"

echo "== tensor parallel (limit ${TP_S}s)"
START=$SECONDS
# TP=1 vs TP=2 on NCCL, one GPU per rank; a size above the visible GPU count is reported as skipped.
timeout "$TP_S" "$PY" bench/tensor_parallel.py --tp 1 2 >"$OUT/tensor_parallel.txt" 2>&1
TP_RC=$?
TP_T=$((SECONDS - START))
cat "$OUT/tensor_parallel.txt"

echo "== decode: eager vs CUDA graphs (limit ${DECODE_S}s)"
START=$SECONDS
# Compiles and captures one graph per measured batch size (1, 8, 64) at start-up; the time is printed.
timeout "$DECODE_S" "$PY" bench/decode.py --device cuda --batches 1 8 64 --tokens 128 >"$OUT/decode.txt" 2>&1
DECODE_RC=$?
DECODE_T=$((SECONDS - START))
cat "$OUT/decode.txt"

printf 'kernel_tests_rc=%s\nkernels_bench_rc=%s\ntensor_parallel_rc=%s\ndecode_rc=%s\n' \
    "$TESTS_RC" "$BENCH_RC" "$TP_RC" "$DECODE_RC" | tee "$OUT/summary.txt"
# The seconds each stage took, for sizing its limit on the next run.
printf 'kernel_tests_s=%s\nkernels_bench_s=%s\ntensor_parallel_s=%s\ndecode_s=%s\n' \
    "$TESTS_T" "$BENCH_T" "$TP_T" "$DECODE_T" | tee -a "$OUT/summary.txt"
[ "$TESTS_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$TP_RC" -eq 0 ] && [ "$DECODE_RC" -eq 0 ]
