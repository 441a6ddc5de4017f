#!/usr/bin/env bash
# What a query costs from the Go client against the Rust client's blocking call, same
# server, same prompts, interleaved rounds (client/go/cmd/overhead): builds a release
# kvix-server and the Rust side (client/examples/blocking_rounds.rs), starts the server
# on core 1 and both clients on core 0 (GOMAXPROCS=1 unless set), runs, stops the server.
#
#   scripts/go-overhead.sh [overhead flags, e.g. --rounds 40 --per-round 200 --blocks 125]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-bench}"
export GOMAXPROCS="${GOMAXPROCS:-1}"
cargo build --release -p kvix-server
cargo build --release -p kvix-client --example blocking_rounds
OUT="$CARGO_TARGET_DIR/go-overhead-server.out"
taskset -c 1 "$CARGO_TARGET_DIR/release/kvix-server" --listen 127.0.0.1:0 --unix "" \
  --metrics "" --cores 1 --pin false >"$OUT" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
ADDR=""
for _ in $(seq 1 100); do
  ADDR="$(sed -n 's/.*listening on tcp:\/\/\([^ ]*\).*/\1/p' "$OUT" | head -1)"
  [ -n "$ADDR" ] && break
  sleep 0.05
done
[ -n "$ADDR" ] || { echo "kvix-server did not start: $(cat "$OUT")" >&2; exit 1; }
(cd client/go && go build -o "$CARGO_TARGET_DIR/go-overhead" ./cmd/overhead)
taskset -c 0 "$CARGO_TARGET_DIR/go-overhead" --server "$ADDR" \
  --rust "$CARGO_TARGET_DIR/release/examples/blocking_rounds" "$@"
