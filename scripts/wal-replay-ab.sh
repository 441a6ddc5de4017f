#!/usr/bin/env bash
# Two kvix-server binaries replaying the same write-ahead log, alternating: a WAL of
# DURATION s of EVENT_RATE batches/s (kvix-bench load, one record each) is written once
# by the first binary and killed with -9; each round copies it and starts each binary
# on the copy; the start's "write-ahead log replayed" line gives its rate.
#
#   scripts/wal-replay-ab.sh OLD_BIN NEW_BIN [ROUNDS]
#   (kvix-bench from target/release: cargo build --release -p kvix-bench)
set -euo pipefail
cd "$(dirname "$0")/.."
OLD="$1"; NEW="$2"; ROUNDS="${3:-3}"
DURATION="${DURATION:-10}"; EVENT_RATE="${EVENT_RATE:-20000}"
BENCH="${BENCH:-target/release/kvix-bench}"
D=$(mktemp -d)
PID=""
cleanup() { [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null || true; rm -rf "$D"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start() { # binary dir tag
  PORT=$(free_port); METRICS=$(free_port)
  KVIX_LOG=info "$1" --cores 2 --listen "127.0.0.1:$PORT" --metrics "127.0.0.1:$METRICS" --unix "" \
    --snapshot "$2/index.snapshot" --snapshot-every 0 --wal >"$2/$3.out" 2>"$2/$3.err" &
  PID=$!
  for _ in $(seq 1 6000); do grep -q "metrics on" "$2/$3.out" 2>/dev/null && return; sleep 0.05; done
  echo "server did not start" >&2; cat "$2/$3.err" >&2; exit 1
}
mkdir -p "$D/log"
start "$OLD" "$D/log" load
"$BENCH" load --server "127.0.0.1:$PORT" --metrics "127.0.0.1:$METRICS" --quiet \
  --rate 100 --floor false --event-rate "$EVENT_RATE" --duration "$DURATION" | head -1
kill -9 "$PID"; wait "$PID" 2>/dev/null || true
for round in $(seq 1 "$ROUNDS"); do
  for which in OLD NEW; do
    bin="${!which}"
    R="$D/run"; rm -rf "$R"; cp -r "$D/log" "$R"
    start "$bin" "$R" run
    echo "round $round $which: $(grep -o 'write-ahead log replayed.*' "$R/run.err" | sed 's/\x1b\[[0-9;]*m//g')"
    kill -9 "$PID"; wait "$PID" 2>/dev/null || true
  done
done
