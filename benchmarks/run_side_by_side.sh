#!/usr/bin/env bash
# Side-by-side run: our policies and the peer engines, one server at a time, same client.
#   PEERS=/path/to/peers benchmarks/run_side_by_side.sh OUTDIR [WORKLOAD...]
# PEERS (default: $XDG_CACHE_HOME/alignedserve/peers, i.e. ~/.cache/alignedserve/peers) holds
# start_vllm.sh (port 8101) and start_llamacpp.sh (port 8102), installed as in
# ../shared/peers/README.md; missing ones are skipped. Targets: env TARGETS (default all); a
# target NAME-fp8 (aligned-fp8, vllm-fp8, ...) runs NAME with an fp8 e5m2 KV cache, and
# NAME-flat (aligned-flat, fcfs-flat) ours with token-major bf16 caches (--no-tiled-kv), and
# aligned-arrival the aligned policy admitting in arrival order (--admission fcfs), and
# NAME-4k ours with KV caches and weights on 4 KiB pages (ALIGNEDSERVE_HUGE_PAGES=0), and
# NAME-split ours with steps of many decode rows run as two halves at once (--split-decode), and
# vllm-aligned vLLM with our scheduler plug-in (docs/vllm_plugin.md; its per-step records go
# to OUTDIR/vllm-aligned-stats.jsonl), and replicasN-ROUTER ours as N engine replicas on Ray
# Serve sharing the machine's cores (serve --replicas N --router ROUTER, ROUTER one of kv,
# kv+length, ray, round_robin; docs/deployment.md).
# Workloads: varied, uniform (synthetic), conv, code (Azure 2023 traces from TRACE_DIR);
# conv@S / code@S replay a trace at time scale S (a load sweep: conv@60 conv@120 ...).
set -uo pipefail
OUT=${1:?output dir}; shift
WORKLOADS=("$@"); [ ${#WORKLOADS[@]} -eq 0 ] && WORKLOADS=(varied uniform)
TARGETS=${TARGETS:-"aligned fcfs static vllm llamacpp"}
PEERS=${PEERS:-${XDG_CACHE_HOME:-$HOME/.cache}/alignedserve/peers}
PY=${PY:-.venv/bin/python}
N=${N:-64}

TRACE_DIR=${TRACE_DIR:-../shared/workloads}
# The scheduler issue's trace workload: ~100 requests sampled at random from the trace, lengths
# halved and capped, replayed at their (compressed) arrival times; TIME_SCALE_* set the load.
TRACE_ARGS="--trace-dir $TRACE_DIR --num-requests 100 --trace-sample random --length-scale 0.5
  --max-input-len 3500 --max-output-len 256"

bench_args() {  # workload name -> bench arguments
  case $1 in
    varied) echo "--workload synthetic:varied:in=64-3072,out=256 --num-requests $N --concurrency $N" ;;
    uniform) echo "--workload synthetic:fixed:in=512,out=256 --num-requests $N --concurrency $N" ;;
    conv) echo "--workload azure-conv $TRACE_ARGS --time-scale ${TIME_SCALE_CONV:-90}" ;;
    code) echo "--workload azure-code $TRACE_ARGS --time-scale ${TIME_SCALE_CODE:-120}" ;;
    conv@*|code@*) echo "--workload azure-${1%@*} $TRACE_ARGS --time-scale ${1#*@}" ;;
    *) echo "--workload $1 --num-requests $N --concurrency $N" ;;
  esac
}

start() {  # target -> sets PID and PORT
  local engine=${1%-fp8} kv=() envs=()
  engine=${engine%-flat}
  engine=${engine%-arrival}
  engine=${engine%-4k}
  engine=${engine%-split}
  [[ $1 == vllm-aligned ]] && engine=vllm && kv=(--scheduler-cls
    alignedserve.integrations.vllm.AlignedScheduler) && envs=(PYTHONPATH="$PWD"
    ALIGNEDSERVE_VLLM_STATS="$(cd "$OUT" && pwd)/vllm-aligned-stats.jsonl")
  [[ $1 == *-fp8 ]] && kv=(--kv-cache-dtype fp8_e5m2)
  [[ $1 == *-flat ]] && kv=(--no-tiled-kv)
  [[ $1 == *-arrival ]] && kv=(--admission fcfs)
  [[ $1 == *-split ]] && kv=(--split-decode)
  [[ $1 == *-4k ]] && envs=(ALIGNEDSERVE_HUGE_PAGES=0)  # KV and weights on 4 KiB pages
  if [[ $1 == replicas* ]]; then  # replicasN-ROUTER: N replicas share the cores
    local n=${1#replicas}; n=${n%%-*}
    local threads=$(( $(nproc) / n )); [ "$threads" -lt 1 ] && threads=1
    engine=aligned; kv=(--replicas "$n" --num-threads "$threads" --router "${1#*-}")
  fi
  case $engine in
    vllm) PORT=8101; env "${envs[@]}" "$PEERS/start_vllm.sh" "${kv[@]}" > "$OUT/$1.log" 2>&1 & PID=$! ;;
    llamacpp) PORT=8102; "$PEERS/start_llamacpp.sh" --no-cache-prompt > "$OUT/$1.log" 2>&1 & PID=$! ;;
    *) PORT=8100; env "${envs[@]}" $PY -m alignedserve.entrypoints.cli serve --port 8100 --policy "$engine" \
         "${kv[@]}" --no-access-log > "$OUT/$1.log" 2>&1 & PID=$! ;;
  esac
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/v1/models" > /dev/null && return 0
    kill -0 $PID 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

mkdir -p "$OUT"
for target in $TARGETS; do
  if ! start "$target"; then echo "skip $target (did not start)"; kill $PID 2>/dev/null; continue; fi
  for w in "${WORKLOADS[@]}"; do
    echo "== $target / $w ($(date -u +%H:%M:%S), load $(cut -d' ' -f1 /proc/loadavg))"
    # shellcheck disable=SC2046  # bench_args is a word list on purpose
    $PY -m alignedserve.entrypoints.cli bench --url "http://127.0.0.1:$PORT" $(bench_args "$w") \
      --warmup 2 --output-dir "$OUT/$w/$target" --no-progress 2>&1 | grep -E "ok [0-9]+, failed"
  done
  kill -TERM $PID; wait $PID 2>/dev/null || true  # a server stopped by TERM exits 143
done
