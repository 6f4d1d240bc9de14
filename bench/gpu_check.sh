#!/usr/bin/env bash
# One GPU check, under 10 minutes on one GPU (the four default stage limits below add up to 580 s): the
# kernel tests natively on CUDA (no interpreter), then the kernel benchmark, then the tensor-parallel
# benchmark, then the decode benchmark. STAGES picks which run (comma-separated, in this order whatever the
# order given): tests, kernels, tp, decode (the default set), host (bench/host_overhead.py on CUDA), sleep
# (bench/sleep_mode.py on CUDA) and lora (bench/lora.py --tiny on CUDA), the last three not in the default
# set, so that one stage can get a whole call's time. Everything lands in OUTDIR:
#   env.txt                 GPU, driver, torch / triton versions
#   kernel_tests.log/.xml   pytest tests/kernels (log + JUnit XML)
#   kernels_bench.txt       the benchmark table (fractions of the copy bandwidth / bf16 peak measured in-run)
#   kernels_bench.json/.csv the same rows, machine-readable
#   tensor_parallel.txt     bench/tensor_parallel.py: TP=1 vs TP=2 tok/s (TP=2 skipped with one GPU)
#   decode.txt              bench/decode.py: decode tok/s and ITL at batch 1/8/64, eager vs CUDA graphs
#                           (model.compile on), against the bandwidth roofline measured in the same run
#   host_overhead.txt       bench/host_overhead.py --device cuda: offline engine vs HF generate vs a served
#                           pod on a tiny model, 1/16/64/256 streams (host cost per step)
#   sleep_mode.txt          bench/sleep_mode.py --device cuda: torch.cuda.memory_allocated awake / asleep /
#                           woken at levels 1 and 2, sleep and wake seconds, tokens identical after wake
#                           (exit 1 when they are not)
#   lora.txt                bench/lora.py --device cuda --tiny --tiny-layers 32: a random Llama with an 8B
#                           model's layer count and a nearly free forward, base vs 1/4/8 adapters (tok/s,
#                           step ms) and the LoRA hooks (Triton SGMV/BGMV) of one decode step alone: what
#                           adapters cost the host path
#   summary.txt             exit codes and wall seconds of the stages run
# Usage: [STAGES=tests,kernels,tp,decode,host,sleep,lora] bench/gpu_check.sh OUTDIR
#        (PYTHON=... to pick the interpreter; TESTS_S / BENCH_S / TP_S / DECODE_S / HOST_S / SLEEP_S / LORA_S
#        limits; HOST_TOKENIZER=DIR: the built-in tokenizer saved, where the model wheel is not installed)
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
HOST_S=${HOST_S:-420}
# Builds the engine once (compiling decode, as at start-up), and after each wake compiles it again.
SLEEP_S=${SLEEP_S:-300}
# Two rounds of five engines (base, LoRA idle, 1/4/8 adapters), eager, plus the hooks alone.
LORA_S=${LORA_S:-300}
STAGES=${STAGES:-tests,kernels,tp,decode}
for stage in ${STAGES//,/ }; do
    case "$stage" in
    tests | kernels | tp | decode | host | sleep | lora) ;;
    *)
        echo "unknown stage '$stage' in STAGES (tests, kernels, tp, decode, host, sleep, lora)" >&2
        exit 2
        ;;
    esac
done
want() { [[ ",$STAGES," == *",$1,"* ]]; }
SUMMARY_RC=""
SUMMARY_T=""
OK=1
# record NAME RC SECONDS: one stage's exit code and wall seconds for summary.txt.
record() {
    SUMMARY_RC+="$1_rc=$2"$'\n'
    SUMMARY_T+="$1_s=$3"$'\n'
    [ "$2" -eq 0 ] || OK=0
}

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
    for sub in kernels runtime operator sim; do ln -s "$REPO/$sub" "$PKG/tokenfleet/$sub"; done
    export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
    echo "tokenfleet imported through $PKG" >>"$OUT/env.txt"
fi

if want tests; then
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
    record kernel_tests "$TESTS_RC" "$TESTS_T"
fi

if want kernels; then
    echo "== kernel benchmark (limit ${BENCH_S}s)"
    START=$SECONDS
    # The benchmark stops adding rows 40 s before its limit so it always gets to write its files.
    timeout "$BENCH_S" "$PY" bench/kernels.py --out "$OUT" --budget $((BENCH_S - 40)) >"$OUT/kernels_bench.txt" 2>&1
    BENCH_RC=$?
    BENCH_T=$((SECONDS - START))
    cat "$OUT/kernels_bench.txt"
    record kernels_bench "$BENCH_RC" "$BENCH_T"
fi

if want tp; then
    echo "== tensor parallel (limit ${TP_S}s)"
    START=$SECONDS
    # TP=1 vs TP=2 on NCCL, one GPU per rank; a size above the visible GPU count is reported as skipped.
    timeout "$TP_S" "$PY" bench/tensor_parallel.py --tp 1 2 >"$OUT/tensor_parallel.txt" 2>&1
    TP_RC=$?
    TP_T=$((SECONDS - START))
    cat "$OUT/tensor_parallel.txt"
    record tensor_parallel "$TP_RC" "$TP_T"
fi

if want decode; then
    echo "== decode: eager vs CUDA graphs (limit ${DECODE_S}s)"
    START=$SECONDS
    # Compiles and captures one graph per measured batch size (1, 8, 64) at start-up; the time is printed.
    timeout "$DECODE_S" "$PY" bench/decode.py --device cuda --batches 1 8 64 --tokens 128 >"$OUT/decode.txt" 2>&1
    DECODE_RC=$?
    DECODE_T=$((SECONDS - START))
    cat "$OUT/decode.txt"
    record decode "$DECODE_RC" "$DECODE_T"
fi

if want host; then
    echo "== host overhead (limit ${HOST_S}s)"
    START=$SECONDS
    # A tiny model: what is measured is the work around the forward pass (engine, HTTP server, HF generate).
    timeout "$HOST_S" "$PY" bench/host_overhead.py --device cuda --streams 1 16 64 256 --tokens 64 --rounds 3 \
        ${HOST_TOKENIZER:+--tokenizer-dir "$HOST_TOKENIZER"} >"$OUT/host_overhead.txt" 2>&1
    HOST_RC=$?
    HOST_T=$((SECONDS - START))
    cat "$OUT/host_overhead.txt"
    record host_overhead "$HOST_RC" "$HOST_T"
fi

if want sleep; then
    echo "== sleep mode (limit ${SLEEP_S}s)"
    START=$SECONDS
    # Levels 1 (weights to pinned host memory) and 2 (weights discarded, reloaded from the model source).
    timeout "$SLEEP_S" "$PY" bench/sleep_mode.py --device cuda --levels 1 2 --tokens 64 >"$OUT/sleep_mode.txt" 2>&1
    SLEEP_RC=$?
    SLEEP_T=$((SECONDS - START))
    cat "$OUT/sleep_mode.txt"
    record sleep_mode "$SLEEP_RC" "$SLEEP_T"
fi

if want lora; then
    echo "== LoRA host path (limit ${LORA_S}s)"
    START=$SECONDS
    timeout "$LORA_S" "$PY" bench/lora.py --device cuda --tiny --tiny-layers 32 --num-prompts 16 --max-tokens 64 \
        --rounds 2 --adapters 1 4 8 ${HOST_TOKENIZER:+--tokenizer-dir "$HOST_TOKENIZER"} >"$OUT/lora.txt" 2>&1
    LORA_RC=$?
    LORA_T=$((SECONDS - START))
    cat "$OUT/lora.txt"
    record lora "$LORA_RC" "$LORA_T"
fi

printf '%s' "$SUMMARY_RC" | tee "$OUT/summary.txt"
# The seconds each stage took, for sizing its limit on the next run.
printf '%s' "$SUMMARY_T" | tee -a "$OUT/summary.txt"
[ "$OK" -eq 1 ]
