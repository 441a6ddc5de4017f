#!/usr/bin/env bash
# What TLS costs a query: two release servers, one plain and one with --tls-cert
# (a CA and a certificate for 127.0.0.1 made here with openssl), and kvix-bench latency
# against each in alternating rounds (queries, the echo floor and the preload all go
# over TLS on the second). Prints query / floor and query p50 / p99 per chain length.
#
#   scripts/tls-cost.sh                 # 3 rounds of 20,000 queries per length
#   ROUNDS=5 QUERIES=50000 scripts/tls-cost.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-bench}"
ROUNDS="${ROUNDS:-3}"
QUERIES="${QUERIES:-20000}"
BIN="$CARGO_TARGET_DIR/release"
cargo build --release -p kvix-server -p kvix-bench
DIR=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$DIR"; }
trap cleanup EXIT
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
  -subj /CN=kvix-bench-ca -keyout "$DIR/ca.key" -out "$DIR/ca.pem" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=127.0.0.1 \
  -keyout "$DIR/server.key" -out "$DIR/server.csr" 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\n' >"$DIR/san.ext"
openssl x509 -req -in "$DIR/server.csr" -CA "$DIR/ca.pem" -CAkey "$DIR/ca.key" \
  -CAcreateserial -days 2 -extfile "$DIR/san.ext" -out "$DIR/server.pem" 2>/dev/null
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start() { # name port extra-flags...
  local name=$1 port=$2; shift 2
  "$BIN/kvix-server" --listen "127.0.0.1:$port" --metrics "" --unix "" --cores 1 "$@" \
    >"$DIR/$name.out" 2>"$DIR/$name.err" &
  PIDS+=($!)
  for _ in $(seq 1 600); do grep -q "listening on" "$DIR/$name.out" 2>/dev/null && return; sleep 0.05; done
  echo "$name did not start" >&2; cat "$DIR/$name.err" >&2; exit 1
}
PLAIN=$(free_port); TLS=$(free_port)
start plain "$PLAIN"
start tls "$TLS" --tls-cert "$DIR/server.pem" --tls-key "$DIR/server.key"
run() { # label port extra-flags...
  local label=$1 port=$2; shift 2
  "$BIN/kvix-bench" --json --quiet latency --server "127.0.0.1:$port" --queries "$QUERIES" "$@" |
    python3 -c '
import json, sys
r = json.load(sys.stdin)
for row in r["rows"]:
    q, f, x = row["query"], row["floor"], row["ratio"]
    print("%-5s %5d  query/floor p50 %.2f p99 %.2f  query p50 %.1f p99 %.1f us  floor p50 %.1f p99 %.1f us"
          % (sys.argv[1], row["blocks"], x["p50"], x["p99"], q["p50_us"], q["p99_us"], f["p50_us"], f["p99_us"]))
' "$label"
}
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r"
  run plain "$PLAIN"
  run tls "$TLS" --tls-ca "$DIR/ca.pem"
done
