#!/usr/bin/env bash
# kvix's HTTP API against Dynamo's standalone KV indexer: a release kvix-server with
# --http (--cores 1) and bench/peer's dynamo-indexer (Dynamo's own router in process),
# both fed the same 16 engines by kvix-bench over ZMQ, queried with the same keep-alive
# client, alternating, beside an HTTP echo of the same sizes on kvix's listener.
# Prints per chain length: kvix, Dynamo and the floor (p50 / p99 µs), Dynamo / kvix and
# kvix / floor at p50.
#
#   scripts/http-latency.sh                    # 3 rounds of 5,000 queries per length
#   ROUNDS=5 QUERIES=20000 scripts/http-latency.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-bench}"
ROUNDS="${ROUNDS:-3}"
QUERIES="${QUERIES:-5000}"
BIN="$CARGO_TARGET_DIR/release"
cargo build --release -p kvix-server -p kvix-bench
cargo build --release --manifest-path bench/peer/Cargo.toml --bin dynamo-indexer \
  --target-dir "$CARGO_TARGET_DIR/peer"
DIR=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$DIR"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() { # file pattern
  for _ in $(seq 1 600); do grep -q "$2" "$1" 2>/dev/null && return; sleep 0.05; done
  echo "no '$2' in $1" >&2; exit 1
}
KVIX=$(free_port); HTTP=$(free_port); DYN=$(free_port)
"$BIN/kvix-server" --listen "127.0.0.1:$KVIX" --http "127.0.0.1:$HTTP" --metrics "" --unix "" \
  --cores 1 >"$DIR/kvix.out" 2>"$DIR/kvix.err" &
PIDS+=($!)
"$CARGO_TARGET_DIR/peer/release/dynamo-indexer" "127.0.0.1:$DYN" >"$DIR/dynamo.out" 2>"$DIR/dynamo.err" &
PIDS+=($!)
wait_for "$DIR/kvix.out" "HTTP API on"
wait_for "$DIR/dynamo.out" "dynamo-indexer on"
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r"
  "$BIN/kvix-bench" --json --quiet latency --http "127.0.0.1:$HTTP" --dynamo "127.0.0.1:$DYN" \
    --queries "$QUERIES" --warmup 500 --seed "$r" |
    python3 -c '
import json, sys
r = json.load(sys.stdin)
for row in r["rows"]:
    k, d, f = row["kvix"], row["dynamo"], row["floor"]
    print("%5d blocks  kvix p50 %.1f p99 %.1f  Dynamo p50 %.1f p99 %.1f  floor p50 %.1f p99 %.1f us  Dynamo/kvix p50 %.2f  kvix/floor p50 %.2f"
          % (row["blocks"], k["p50_us"], k["p99_us"], d["p50_us"], d["p99_us"], f["p50_us"], f["p99_us"],
             row["dynamo_over_kvix"]["p50"], row["kvix_over_floor"]["p50"]))
'
done
