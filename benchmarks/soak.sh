#!/usr/bin/env bash
# Soak run: a trace replayed at moderate load against one server, sampling resident memory and
# KV in use every INTERVAL seconds, then idle samples after the load ends.
#   benchmarks/soak.sh OUTDIR [serve args...]      e.g.  benchmarks/soak.sh /tmp/soak --replicas 2
# Env: REQUESTS (default 300), TIME_SCALE (default 6: the sampled trace requests spread over
# ~10 minutes), INTERVAL (30), TRACE_DIR (../shared/workloads). Writes OUTDIR/samples.csv
# (time, phase, rss_mb of the server and every process it started, kv_used_bytes summed over
# replicas and tiers, running) and OUTDIR/bench/ (the client's report).
set -uo pipefail
OUT=${1:?output dir}; shift
PY=${PY:-.venv/bin/python}
PORT=${PORT:-8130}
INTERVAL=${INTERVAL:-30}
mkdir -p "$OUT"
$PY -m alignedserve.entrypoints.cli serve --port "$PORT" --no-access-log "$@" > "$OUT/server.log" 2>&1 &
PID=$!
for _ in $(seq 600); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 1; done

rss_mb() {  # the server and its descendants (Ray replicas included), in MiB
  local pids; pids=$(pstree -p "$PID" 2>/dev/null | grep -o '([0-9]\+)' | tr -d '()')
  [ -z "$pids" ] && pids=$PID
  ps -o rss= -p $(echo $pids | tr ' ' ',') 2>/dev/null | awk '{s+=$1} END {printf "%.0f", s/1024}'
}
metric_sum() {  # sum of a metric's samples over every label set
  curl -s "http://127.0.0.1:$PORT/metrics" | grep "^alignedserve:$1[{ ]" | awk '{s+=$NF} END {print s+0}'
}
sample() { echo "$(date +%s),$1,$(rss_mb),$(metric_sum kv_cache_used_bytes),$(metric_sum num_requests_running)" >> "$OUT/samples.csv"; }

echo "time,phase,rss_mb,kv_used_bytes,running" > "$OUT/samples.csv"
sample idle
( while kill -0 $PID 2>/dev/null && [ ! -f "$OUT/.done" ]; do sample load; sleep "$INTERVAL"; done ) &
SAMPLER=$!
$PY -m alignedserve.entrypoints.cli bench --url "http://127.0.0.1:$PORT" --workload azure-conv \
  --trace-dir "${TRACE_DIR:-../shared/workloads}" --num-requests "${REQUESTS:-300}" \
  --trace-sample random --length-scale 0.5 --max-input-len 3500 --max-output-len 256 \
  --time-scale "${TIME_SCALE:-6}" --output-dir "$OUT/bench" --no-progress 2>&1 | tail -3
touch "$OUT/.done"; wait $SAMPLER
for _ in 1 2 3; do sleep "$INTERVAL"; sample idle-after; done
kill -TERM $PID; wait $PID 2>/dev/null
cat "$OUT/samples.csv"
