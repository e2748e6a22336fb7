#!/usr/bin/env bash
# Online serving with cascade attention on and off, one server per setting, two loads each
# (all requests at once, then at most 64 in flight; four client processes, as one saturates a
# core), from the project root:
#   bash benchmarks/online_ab.sh benchmarks/configs/llama3.1-8b [out_dir]
set -uo pipefail
model=$1; out=${2:-benchmarks/results}; port=30124
for setting in on off; do
  extra=(); [ "$setting" = off ] && extra=(--disable-cascade-attention)
  python -m minisgl.launch --model "$model" --load-format dummy --port $port --context-length 4096 \
    --log-level warning "${extra[@]}" & pid=$!
  until curl -sf localhost:$port/health >/dev/null; do kill -0 $pid 2>/dev/null || exit 1; sleep 2; done
  name=$(basename "$model")
  python benchmarks/online_serving.py --url http://127.0.0.1:$port --client-procs 4 \
    --out "$out/online_${name}_cascade_${setting}.json"
  python benchmarks/online_serving.py --url http://127.0.0.1:$port --max-concurrency 64 --client-procs 4 \
    --out "$out/online_${name}_cascade_${setting}_c64.json"
  kill -TERM $pid; wait $pid
done
