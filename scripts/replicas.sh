#!/usr/bin/env bash
# Three replicas over one Redis Stream under kvix-bench load, twice: once as they are,
# once with the gateways' primary killed (kill -9) half-way. Prints both miss shares at
# 2 ms: hedged queries should keep the second within 0.1 percentage point of the first.
#
#   scripts/replicas.sh [RESULTS_DIR]      # default target-bench/results/replicas-<UTC>
#   DURATION=10 RATE=2000 scripts/replicas.sh
#   KILL=second scripts/replicas.sh        # kill the second replica instead of the primary
#   EVENT_RATE=100 REPEAT=3 scripts/replicas.sh   # fewer writes; three steady/killed pairs
#
# Starts its own redis-server (a free port, its own directory) and servers on loopback;
# stops all of them on exit.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-bench}"
OUT="${1:-$CARGO_TARGET_DIR/results/replicas-$(date -u +%Y%m%dT%H%M%SZ)}"
DURATION="${DURATION:-10}"
RATE="${RATE:-2000}"
EVENT_RATE="${EVENT_RATE:-1000}"
REPEAT="${REPEAT:-1}"
mkdir -p "$OUT"
BIN="$CARGO_TARGET_DIR/release"
cargo build --release -p kvix-server -p kvix-bench
command -v redis-server >/dev/null || { echo "redis-server is needed (apt-get install redis-server)" >&2; exit 1; }

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
RPORT="$(free_port)"
mkdir -p "$OUT/redis"
redis-server --port "$RPORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$OUT/redis" >"$OUT/redis.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 100); do (exec 3<>"/dev/tcp/127.0.0.1/$RPORT") 2>/dev/null && break; sleep 0.05; done

start_replica() { # name key: starts one, sets ADDR and PID
  "$BIN/kvix-server" --listen 127.0.0.1:0 --unix "" --metrics "" --cores 1 --pin false --log-new --log "redis://127.0.0.1:$RPORT/$2" \
    >"$OUT/$1.out" 2>"$OUT/$1.err" &
  PID=$!
  PIDS+=("$PID")
  ADDR=""
  for _ in $(seq 1 100); do
    ADDR="$(grep -o 'tcp://[0-9.]*:[0-9]*' "$OUT/$1.out" 2>/dev/null | head -1 | sed 's#tcp://##' || true)"
    [ -n "$ADDR" ] && break
    sleep 0.1
  done
  [ -n "$ADDR" ] || { echo "replica $1 did not start; see $OUT/$1.err" >&2; exit 1; }
}

run() { # label key kill(yes/no): three fresh replicas, the load, then they are stopped
  local first=${#PIDS[@]}
  start_replica "$1-a" "$2"; A="$ADDR"; APID="$PID"
  start_replica "$1-b" "$2"; B="$ADDR"; BPID="$PID"
  start_replica "$1-c" "$2"; C="$ADDR"
  echo "== $1: kvix-bench load --servers $A,$B,$C --duration $DURATION --rate $RATE --event-rate $EVENT_RATE" | tee "$OUT/$1.cmd"
  "$BIN/kvix-bench" load --servers "$A,$B,$C" --duration "$DURATION" --rate "$RATE" --event-rate "$EVENT_RATE" \
    --json --quiet >"$OUT/$1.json" &
  LOAD=$!
  if [ "$3" = yes ]; then
    # Past the preload (a few seconds), into the timed phase: kill the primary.
    sleep $(( DURATION / 2 + 3 ))
    if [ "${KILL:-primary}" = primary ]; then
      kill -9 "$APID"; echo "killed the primary ($A)" | tee -a "$OUT/$1.cmd"
    else
      kill -9 "$BPID"; echo "killed the hedge target ($B)" | tee -a "$OUT/$1.cmd"
    fi
  fi
  wait "$LOAD"
  for p in "${PIDS[@]:$first}"; do kill -9 "$p" 2>/dev/null || true; done
}

for i in $(seq 1 "$REPEAT"); do
  run "steady$i" "kvix-steady$i" no
  run "killed$i" "kvix-killed$i" yes
done
python3 - "$OUT" "${KILL:-primary}" "$REPEAT" <<'PY'
import json, statistics, sys
out, who, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
diffs = []
for i in range(1, n + 1):
    a = json.load(open(f"{out}/steady{i}.json"))["queries"]
    b = json.load(open(f"{out}/killed{i}.json"))["queries"]
    d = 100 * (b["miss_share"] - a["miss_share"])
    diffs.append(d)
    ca = json.load(open(f"{out}/steady{i}.json"))["clients"]
    cb = json.load(open(f"{out}/killed{i}.json"))["clients"]
    print(f"pair {i}: miss share at 2 ms: steady {100*a['miss_share']:.2f} %, {who} killed "
          f"{100*b['miss_share']:.2f} % (difference {d:+.2f} pp); failed open on a lost "
          f"connection {ca['disconnected']} / {cb['disconnected']}, timed out "
          f"{ca['timeouts']} / {cb['timeouts']}; failovers {cb['failovers']}, hedges won "
          f"{ca['hedges_won']} / {cb['hedges_won']}")
if n > 1:
    print(f"median difference {statistics.median(diffs):+.2f} pp over {n} pairs")
PY
echo "results in $OUT"
