#!/usr/bin/env bash
# Online serving with one server flag on and off, one server per setting, two loads each (all
# requests at once, then at most 64 in flight; four client processes, as one saturates a core),
# then the online multi-turn run with the same flag on and off; from the project root:
#   bash benchmarks/online_ab.sh benchmarks/configs/llama3.1-8b [flag] [out_dir]
# flag defaults to --disable-cascade-attention; e.g. --enable-mixed-chunk. Set WORKLOADS to run
# other online_serving.py workloads (default: shared-prefix) and MULTI_TURN=0 to skip multi-turn.
# RATE=r (or "r1 r2") adds loads of Poisson arrivals at r requests/s, so prompts arrive while others
# decode (with every request at once or at a fixed concurrency, arrivals come in waves);
# LOADS="" with RATE runs that load alone (default LOADS="all c64"). JITTER=j gives multi-turn
# answers of answer_len * (1 +- j) tokens, so its turns stop arriving in waves too.
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
    for load in ${LOADS-all c64}; do
      if [ "$load" = all ]; then limit=(); suffix=""; else limit=(--max-concurrency 64); suffix=_c64; fi
      python benchmarks/online_serving.py --url http://127.0.0.1:$port "${limit[@]}" --client-procs 4 \
        --workload "$workload" --out "$out/online_${name}_${workload}_${tag}_${setting}${suffix}.json"
    done
    for rate in ${RATE:-}; do
      python benchmarks/online_serving.py --url http://127.0.0.1:$port --request-rate "$rate" --client-procs 4 \
        --workload "$workload" --out "$out/online_${name}_${workload}_${tag}_${setting}_rate${rate}.json"
    done
  done
  kill -TERM $pid; wait $pid
  if [ "${STEP_TIMES:-0}" = 1 ]; then echo "step times, $tag $setting:"; python benchmarks/step_times.py "$log"; fi
  if [ "${MULTI_TURN:-1}" = 1 ]; then
    engine=$([ "$setting" = on ] && echo "${tag//-/_}=true" || echo "")
    python benchmarks/multi_turn.py --model "$model" --online --modes big --port $port \
      --answer-jitter "${JITTER:-0}" --engine-args "$engine" \
      --out "$out/multi_turn_online_${name}_${tag}_${setting}${JITTER:+_jitter$JITTER}.json"
  fi
done
