#!/usr/bin/env bash
# What an acknowledged write costs with replicas (--log) against the plain server, in one
# run on this machine's noise: `kvix-bench writes` (one-block event batches, reply wanted,
# each paired with an Echo of the same sizes) against a plain server, then against
# replica A of a two-replica log with the lag until each write is visible on replica B.
# Both runs also append each write's bytes to the same Redis (XADD, interleaved): the
# round trip a write with --log cannot do without, so "plain + XADD" is the least an
# acknowledged write with --log can cost here. Rounds alternate plain and replicated.
# Each round also measures replica A alone (no replica B on this machine's cores, as
# when replicas run on machines of their own). With BASE=COMMIT, each round also measures the replicated write of that commit's
# server (built in a worktree, as scripts/ab.sh does), on the same Redis.
# Needs redis-server.
#
#   ROUNDS=3 WRITES=5000 scripts/write-cost.sh
#   BASE=8cfb06b ROUNDS=5 scripts/write-cost.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
ROUNDS="${ROUNDS:-3}"
WRITES="${WRITES:-5000}"
BASE="${BASE:-}"
# Its own target directory: scripts/ab.sh builds other commits in target-bench/base and
# target-bench/head.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target-bench/work}"
cargo build -q --release -p kvix-server -p kvix-bench
SERVER="$CARGO_TARGET_DIR/release/kvix-server"
BENCH="$CARGO_TARGET_DIR/release/kvix-bench"
command -v redis-server >/dev/null || { echo "redis-server is missing: apt-get install redis-server" >&2; exit 1; }
WORK=$(mktemp -d)
PIDS=()
REDIS=""
cleanup() {
  for p in "${PIDS[@]}" $REDIS; do kill -9 "$p" 2>/dev/null || true; done
  [ -n "$BASE" ] && git worktree remove --force "$WORK/base" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
BASE_SERVER=""
if [ -n "$BASE" ]; then
  git worktree add -q --detach "$WORK/base" "$BASE"
  (cd "$WORK/base" && CARGO_TARGET_DIR="$ROOT/target-bench/base" cargo build -q --release -p kvix-server)
  BASE_SERVER="$ROOT/target-bench/base/release/kvix-server"
  echo "base: $(cd "$WORK/base" && git rev-parse --short HEAD), head: $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')" >&2
fi

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start() { # name, args...: starts kvix-server ($RUN, default this tree's), sets PORT
  local name="$1"; shift
  PORT=$(free_port)
  "${RUN:-$SERVER}" --listen "127.0.0.1:$PORT" --metrics "" --unix "" --cores 1 --pin false "$@" \
    >"$WORK/$name.out" 2>"$WORK/$name.err" &
  PIDS+=($!)
  for _ in $(seq 1 6000); do grep -q "listening on" "$WORK/$name.out" 2>/dev/null && return; sleep 0.05; done
  echo "$name did not start" >&2; cat "$WORK/$name.err" >&2; exit 1
}
replicated() { # name, server, key[, b]: writes through replica A (and lag to B), -> $WORK/name-$round.json
  local name="$1" server="$2" key="$3" with_b="${4:-}"
  RUN="$server" start a --log-new --log "redis://127.0.0.1:$RPORT/$key"
  local a=$PORT replica=()
  if [ -n "$with_b" ]; then
    RUN="$server" start b --log "redis://127.0.0.1:$RPORT/$key"
    replica=(--replica "127.0.0.1:$PORT")
  fi
  "$BENCH" --quiet --json writes --server "127.0.0.1:$a" "${replica[@]}" \
    --redis "127.0.0.1:$RPORT" --writes "$WRITES" >"$WORK/$name-$round.json"
  stop_all
}
stop_all() { for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done; PIDS=(); }

for round in $(seq 1 "$ROUNDS"); do
  RPORT=$(free_port)
  # A directory per round: a Redis started on the last round's AOF loads it first.
  mkdir -p "$WORK/redis-$round"
  redis-server --port "$RPORT" --save "" --appendonly yes --dir "$WORK/redis-$round" \
    --daemonize no >"$WORK/redis.out" 2>&1 &
  REDIS=$!
  for _ in $(seq 1 200); do [ "$(redis-cli -p "$RPORT" ping 2>/dev/null)" = PONG ] && break; sleep 0.05; done
  start plain
  "$BENCH" --quiet --json writes --server "127.0.0.1:$PORT" --redis "127.0.0.1:$RPORT" \
    --writes "$WRITES" >"$WORK/plain-$round.json"
  stop_all
  # BASE goes first in even rounds, last in odd ones: neither always meets the Redis
  # the other runs have filled.
  [ -z "$BASE" ] || [ $((round % 2)) = 1 ] || replicated base "$BASE_SERVER" "kvix-base-$round" b
  replicated log "$SERVER" "kvix-$round" b
  replicated alone "$SERVER" "kvix-alone-$round"
  [ -z "$BASE" ] || [ $((round % 2)) = 0 ] || replicated base "$BASE_SERVER" "kvix-base-$round" b
  kill -TERM "$REDIS"; wait "$REDIS" 2>/dev/null || true
  echo "round $round done" >&2
done

python3 - "$WORK" "$ROUNDS" "$BASE" <<'PY'
import json, os, sys
work, rounds, base = sys.argv[1], int(sys.argv[2]), sys.argv[3]
extra = f" `--log` at {base}, p50 µs / ÷ plain |" if base else ""
print("| round | plain write p50 / p99 µs (echo floor p50) | XADD p50 µs | plain + XADD, p50 / plain | --log write p50 / p99 µs | --log / plain p50 | p99 | lag to replica B p50 / p99 µs | A alone, p50 µs / ÷ plain |" + extra)
print("|---|---|---|---|---|---|---|---|---|" + ("---|" if base else ""))
for r in range(1, rounds + 1):
    p = json.load(open(f"{work}/plain-{r}.json"))
    l = json.load(open(f"{work}/log-{r}.json"))
    pw, lw = p["write"], l["write"]
    xadd, lag = p["append"]["p50_us"], l["lag"]
    row = (f"| {r} | {pw['p50_us']:.0f} / {pw['p99_us']:.0f} ({p['floor']['p50_us']:.0f}) | {xadd:.0f} | "
           f"{(pw['p50_us'] + xadd) / pw['p50_us']:.2f} | "
           f"{lw['p50_us']:.0f} / {lw['p99_us']:.0f} | "
           f"{lw['p50_us'] / pw['p50_us']:.2f} | {lw['p99_us'] / pw['p99_us']:.2f} | "
           f"{lag['p50_us']:.0f} / {lag['p99_us']:.0f} |")
    aw = json.load(open(f"{work}/alone-{r}.json"))["write"]
    row += f" {aw['p50_us']:.0f} / {aw['p50_us'] / pw['p50_us']:.2f} |"
    if base:
        bw = json.load(open(f"{work}/base-{r}.json"))["write"]
        row += f" {bw['p50_us']:.0f} / {bw['p50_us'] / pw['p50_us']:.2f} |"
    print(row)
PY
