#!/usr/bin/env bash
# How fast a restart replays the write-ahead log: a server with --wal takes event
# batches from kvix-bench load (one record each), is killed with -9, and starts again;
# its "write-ahead log replayed" line gives records, seconds and records per second.
# Then a clean stop (SIGTERM) and a start, which should find nothing to replay.
#
#   scripts/wal-replay.sh                     # 20 s of 20,000 batches/s
#   DURATION=30 EVENT_RATE=40000 scripts/wal-replay.sh
#   CORES=1 scripts/wal-replay.sh             # one executor (default: one per CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-bench}"
DURATION="${DURATION:-20}"
EVENT_RATE="${EVENT_RATE:-20000}"
CORES="${CORES:-0}"
BIN="$CARGO_TARGET_DIR/release"
cargo build --release -p kvix-server -p kvix-bench
DIR=$(mktemp -d)
PID=""
cleanup() { [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null || true; rm -rf "$DIR"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
PORT=$(free_port); METRICS=$(free_port)
start() {
  KVIX_LOG=info "$BIN/kvix-server" --listen "127.0.0.1:$PORT" --metrics "127.0.0.1:$METRICS" \
    --unix "" --cores "$CORES" --snapshot "$DIR/index.snapshot" --snapshot-every 0 --wal >"$DIR/$1.out" 2>"$DIR/$1.err" &
  PID=$!
  for _ in $(seq 1 6000); do grep -q "metrics on" "$DIR/$1.out" 2>/dev/null && return; sleep 0.05; done
  echo "server did not start" >&2; cat "$DIR/$1.err" >&2; ss -tanp | grep ":$PORT " | head -5 >&2; exit 1
}
start first
"$BIN/kvix-bench" load --server "127.0.0.1:$PORT" --metrics "127.0.0.1:$METRICS" --quiet \
  --rate 100 --floor false --event-rate "$EVENT_RATE" --duration "$DURATION" | head -3
kill -9 "$PID"; wait "$PID" 2>/dev/null || true
ls -l "$DIR"/*.wal.* | awk '{s+=$5} END {print "log bytes:", s}'
start after-kill
echo "after kill -9: $(grep -o 'write-ahead log replayed.*' "$DIR/after-kill.err" | sed 's/\x1b\[[0-9;]*m//g')"
kill -TERM "$PID"; wait "$PID" || true
start after-stop
replayed=$(grep -o 'write-ahead log replayed.*' "$DIR/after-stop.err" | sed 's/\x1b\[[0-9;]*m//g' || true)
echo "after a clean stop: ${replayed:-nothing replayed}"
