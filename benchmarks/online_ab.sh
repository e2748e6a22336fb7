#!/usr/bin/env bash
# Online serving with one server flag on and off, one server per setting, two loads each (all
# requests at once, then at most 64 in flight; four client processes, as one saturates a core),
# then the online multi-turn run with the same flag on and off; from the project root:
#   bash benchmarks/online_ab.sh benchmarks/configs/llama3.1-8b [flag] [out_dir]
# flag defaults to --disable-cascade-attention; e.g. --enable-mixed-chunk. Set WORKLOADS to run
# other online_serving.py workloads (default: shared-prefix) and MULTI_TURN=0 to skip multi-turn.
# RATE=r adds a third load: Poisson arrivals at r requests/s, so prompts arrive while others
# decode (with every request at once or at a fixed concurrency, arrivals come in waves).
# STEP_TIMES=1 runs the servers at debug level (logs in out_dir) and prints each one's step times
# by kind (benchmarks/step_times.py): which steps make the inter-token latency's tail.
set -uo pipefail
model=$1; flag=${2:---disable-cascade-attention}; out=${3:-benchmarks/results}; port=30124
name=$(basename "$model"); tag=${flag#--}
for setting in on off; do
  extra=(); [ "$setting" = on ] && extra=("$flag")
  level=warning; log=/dev/stderr
  if [ "${STEP_TIMES:-0}" = 1 ]; then level=debug; log="$out/server_${name}_${tag}_${setting}.log"; fi
  python -m minisgl.launch --model "$model" --load-format dummy --port $port --context-length 4096 \
    --log-level $level "${extra[@]}" 2>"$log" & pid=$!
  until curl -sf localhost:$port/health >/dev/null; do kill -0 $pid 2>/dev/null || exit 1; sleep 2; done
  for workload in ${WORKLOADS:-shared-prefix}; do
    python benchmarks/online_serving.py --url http://127.0.0.1:$port --client-procs 4 --workload "$workload" \
      --out "$out/online_${name}_${workload}_${tag}_${setting}.json"
    python benchmarks/online_serving.py --url http://127.0.0.1:$port --max-concurrency 64 --client-procs 4 \
      --workload "$workload" --out "$out/online_${name}_${workload}_${tag}_${setting}_c64.json"
    if [ -n "${RATE:-}" ]; then
      python benchmarks/online_serving.py --url http://127.0.0.1:$port --request-rate "$RATE" --client-procs 4 \
        --workload "$workload" --out "$out/online_${name}_${workload}_${tag}_${setting}_rate${RATE}.json"
    fi
  done
  kill -TERM $pid; wait $pid
  if [ "${STEP_TIMES:-0}" = 1 ]; then echo "step times, $tag $setting:"; python benchmarks/step_times.py "$log"; fi
  if [ "${MULTI_TURN:-1}" = 1 ]; then
    engine=$([ "$setting" = on ] && echo "${tag//-/_}=true" || echo "")
    python benchmarks/multi_turn.py --model "$model" --online --modes big --port $port \
      --engine-args "$engine" --out "$out/multi_turn_online_${name}_${tag}_${setting}.json"
  fi
done
