#!/usr/bin/env bash
# One command for every kvix-bench figure: builds kvix-server and kvix-bench (release),
# starts a server on a free loopback port, runs each subcommand with modest defaults,
# writes JSON (and the tables) into a results folder, and stops what it started. The
# side-by-side run against Dynamo's indexer is its own command (docs/benchmarks.md).
#
#   scripts/bench.sh [RESULTS_DIR]          # default target-bench/results/<UTC timestamp> (gitignored)
#   QUICK=1 scripts/bench.sh                # smaller counts (a smoke run, ~1 min)
#   NO_REDIS=1 scripts/bench.sh             # skip the Redis comparison
#
# Everything talks to 127.0.0.1 only. Builds use CARGO_TARGET_DIR (default target-bench).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target-bench}"
OUT="${1:-$CARGO_TARGET_DIR/results/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
BIN="$CARGO_TARGET_DIR/release"

cargo build --release -p kvix-server -p kvix-bench

SERVER_PIDS=()
REDIS_STARTED=""
cleanup() {
  for pid in "${SERVER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  if [ -n "$REDIS_STARTED" ]; then scripts/redis.sh stop >/dev/null || true; fi
}
trap cleanup EXIT

start_server() { # name, extra args...: starts a server with metrics, sets ADDR and METRICS
  local name="$1"; shift
  "$BIN/kvix-server" --listen 127.0.0.1:0 --unix "" --metrics 127.0.0.1:0 "$@" \
    >"$OUT/$name.out" 2>"$OUT/$name.err" &
  local pid=$!
  SERVER_PIDS+=("$pid")
  ADDR="" METRICS=""
  for _ in $(seq 1 100); do
    ADDR="$(grep -o 'tcp://[0-9.]*:[0-9]*' "$OUT/$name.out" 2>/dev/null | head -1 | sed 's#tcp://##' || true)"
    METRICS="$(grep -o 'http://[0-9.]*:[0-9]*' "$OUT/$name.out" 2>/dev/null | head -1 | sed 's#http://##' || true)"
    [ -n "$ADDR" ] && [ -n "$METRICS" ] && break
    kill -0 "$pid" 2>/dev/null || { echo "kvix-server exited; see $OUT/$name.err" >&2; exit 1; }
    sleep 0.1
  done
  [ -n "$ADDR" ] && [ -n "$METRICS" ] || { echo "kvix-server did not print its addresses within 10 s" >&2; exit 1; }
}
stop_server() { # stops the last server started
  local pid="${SERVER_PIDS[-1]}"
  kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true
  unset 'SERVER_PIDS[-1]'
}

start_server server
echo "kvix-server at $ADDR; results in $OUT"

if [ -n "${QUICK:-}" ]; then
  SIM=(--workers 64 --sessions 3000 --session-rate 150)
  LAT=(--queries 2000 --warmup 200)
  LOAD=(--duration 3 --rate 1000)
  RED=(--queries 500 --warmup 50)
  SOAK=(--workers 24 --duration 15 --sample 3)
  FLEET=(--engines 32 --session-rate 40 --seconds 10)
else
  SIM=()
  LAT=(--queries 10000 --warmup 1000)
  LOAD=(--duration 10 --rate 2000)
  RED=(--queries 2000 --warmup 200)
  SOAK=(--duration 60)
  # The campaign's shape at this VM's scale: 120 engines, ~400 requests/s.
  FLEET=(--session-rate 200 --seconds 30)
fi

run() { # name, args...: the command to $OUT/name.cmd, its JSON to $OUT/name.json
  local name="$1"; shift
  echo "== kvix-bench $*" | tee "$OUT/$name.cmd"
  timeout 900 "$BIN/kvix-bench" "$@" --json >"$OUT/$name.json"
  python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$OUT/$name.json"
}

run sim sim "${SIM[@]}"
run trace-in-process trace --in-process
run trace-in-process-16tok trace --in-process --sub-blocks 32
run trace-server trace --server "$ADDR"
run latency latency --server "$ADDR" "${LAT[@]}"
run latency-spin latency --server "$ADDR" "${LAT[@]}" --spin-us 50
run load load --server "$ADDR" "${LOAD[@]}"
if [ -z "${NO_REDIS:-}" ]; then
  if ! scripts/redis.sh status >/dev/null 2>&1; then scripts/redis.sh start; REDIS_STARTED=1; fi
  run redis redis --server "$ADDR" "${RED[@]}"
fi
# The server's own counters after all of the above (kvix_query_hops_total stays 0).
python3 -c 'import sys,urllib.request; sys.stdout.write(urllib.request.urlopen("http://"+sys.argv[1]+"/metrics").read().decode())' \
  "$METRICS" >"$OUT/server-metrics.txt"
grep '^kvix_query_hops_total' "$OUT/server-metrics.txt"
# Memory under placement churn, each on a fresh server: one copy of the index, then two.
stop_server
for cores in 1 2; do
  start_server "soak-server-$cores" --cores "$cores"
  run "soak-cores$cores" soak --server "$ADDR" --metrics "$METRICS" "${SOAK[@]}"
  stop_server
done
# The fleet end to end: each leg starts its own servers (and Redis for replicas).
FL=(--server "$BIN/kvix-server" "${FLEET[@]}")
run fleet fleet "${FL[@]}"
run fleet-gateway-restart fleet "${FL[@]}" --legs events,local --chaos gateway-restart
run fleet-engine-restart fleet "${FL[@]}" --legs oracle,events --chaos engine-restart
run fleet-replica-restart fleet "${FL[@]}" --legs placements --replicas 2 --chaos replica-restart
run fleet-redis-pause fleet "${FL[@]}" --legs placements --replicas 2 --chaos redis-pause
# Engines that connect, to replicas behind a proxy (as behind a Service).
run fleet-events-replicas fleet "${FL[@]}" --legs events --replicas 3
run fleet-events-replica-restart fleet "${FL[@]}" --legs events --replicas 3 --chaos replica-restart
run fleet-events-redis-flush fleet "${FL[@]}" --legs events --replicas 3 --chaos redis-flush
run fleet-events-redis-pause fleet "${FL[@]}" --legs events --replicas 2 --chaos redis-pause
echo "done: $OUT"
ls -1 "$OUT"
