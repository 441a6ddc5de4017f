#!/usr/bin/env bash
# Two builds of kvix-server side by side in one run, on this machine's noise: the query
# latency over the echo floor (`kvix-bench latency`), open-loop load with events flowing
# (`kvix-bench load`), and the write path's rate (the write-ahead log's replay after a
# kill -9, scripts/wal-replay.sh's measure). Rounds alternate base and head so both see
# the same moments of the machine. kvix-bench is built once, from head.
#
#   scripts/ab.sh BASE_COMMIT [HEAD_COMMIT]   # HEAD_COMMIT default: the work tree
#   ROUNDS=3 QUERIES=5000 scripts/ab.sh d194821
#   ONLY=wal scripts/ab.sh d194821            # the write path's rate alone
#   ONLY=load EVENT_ENGINE=1 EVENT_BLOCKS=200000 EVENT_RATE=1 scripts/ab.sh 1fe11aa
#                                             # queries while huge batches are written
#   BENCH_PER_SIDE=1 scripts/ab.sh d194821    # each side measured by its own commit's
#                                             # kvix-bench (the protocol changed between)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
BASE="${1:?usage: scripts/ab.sh BASE_COMMIT [HEAD_COMMIT]}"
HEAD_REF="${2:-}"
ROUNDS="${ROUNDS:-2}"
QUERIES="${QUERIES:-5000}"
LOAD_S="${LOAD_S:-10}"
WAL_S="${WAL_S:-10}"
ONLY="${ONLY:-}"
EVENT_BLOCKS="${EVENT_BLOCKS:-16}"
EVENT_RATE="${EVENT_RATE:-1000}"
EVENT_ENGINE="${EVENT_ENGINE:-}"   # non-empty: stores carry engine hashes
# One target directory per side: cargo hashes path dependencies relative to the
# workspace root, so a worktree's build and the work tree's share artifact names, and
# sources older than the other side's artifacts are taken as built (head ran base's code).
TARGETS="${TARGETS:-$ROOT/target-bench}"
WORK=$(mktemp -d)
PID=""
cleanup() {
  [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null || true
  for t in base head; do git worktree remove --force "$WORK/$t" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

build() { # name, commit ("" = the work tree): builds kvix-server into $WORK/name.bin
  local name="$1" commit="$2" dir="$ROOT"
  if [ -n "$commit" ]; then
    git worktree add -q --detach "$WORK/$name" "$commit"
    dir="$WORK/$name"
  fi
  (cd "$dir" && CARGO_TARGET_DIR="$TARGETS/$name" cargo build -q --release -p kvix-server)
  cp "$TARGETS/$name/release/kvix-server" "$WORK/$name.bin"
  if [ -n "${BENCH_PER_SIDE:-}" ]; then
    (cd "$dir" && CARGO_TARGET_DIR="$TARGETS/$name" cargo build -q --release -p kvix-bench)
    cp "$TARGETS/$name/release/kvix-bench" "$WORK/$name.bench"
  fi
  echo "$name: $(cd "$dir" && git rev-parse --short HEAD)$([ -z "$commit" ] && ! git diff --quiet && echo '+dirty')"
}
build base "$BASE"
build head "$HEAD_REF"
CARGO_TARGET_DIR="$TARGETS/head" cargo build -q --release -p kvix-bench
BENCH="$TARGETS/head/release/kvix-bench"
bench_of() { # build: the kvix-bench that measures it
  if [ -n "${BENCH_PER_SIDE:-}" ]; then echo "$WORK/$1.bench"; else echo "$BENCH"; fi
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
start() { # binary, log name, extra args...
  local bin="$1" name="$2"; shift 2
  PORT=$(free_port); METRICS=$(free_port)
  KVIX_LOG=info "$bin" --listen "127.0.0.1:$PORT" --metrics "127.0.0.1:$METRICS" --unix "" "$@" \
    >"$WORK/$name.out" 2>"$WORK/$name.err" &
  PID=$!
  for _ in $(seq 1 6000); do grep -q "metrics on" "$WORK/$name.out" 2>/dev/null && return; sleep 0.05; done
  echo "$name did not start" >&2; cat "$WORK/$name.err" >&2; exit 1
}
stop() { kill -TERM "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; PID=""; }

for round in $(seq 1 "$ROUNDS"); do
  for build in base head; do
    BENCH=$(bench_of "$build")
    if [ "$ONLY" != wal ]; then
      start "$WORK/$build.bin" "$build-$round"
      if [ "$ONLY" != load ]; then
        "$BENCH" latency --server "127.0.0.1:$PORT" --queries "$QUERIES" --warmup 500 --json \
          >"$WORK/$build-$round-latency.json"
      fi
      "$BENCH" load --server "127.0.0.1:$PORT" --metrics "127.0.0.1:$METRICS" --duration "$LOAD_S" \
        --rate 2000 --event-blocks "$EVENT_BLOCKS" --event-rate "$EVENT_RATE" \
        ${EVENT_ENGINE:+--event-engine --event-pool 4} --json \
        >"$WORK/$build-$round-load.json"
      stop
    fi
    if [ "$ONLY" = load ]; then
      echo "round $round $build done" >&2
      continue
    fi
    snap="$WORK/$build-$round.snapshot"
    start "$WORK/$build.bin" "$build-$round-wal" --snapshot "$snap" --snapshot-every 0 --wal
    "$BENCH" load --server "127.0.0.1:$PORT" --metrics "127.0.0.1:$METRICS" --quiet --rate 100 \
      --floor false --event-rate 20000 --duration "$WAL_S" >/dev/null
    kill -9 "$PID"; wait "$PID" 2>/dev/null || true
    start "$WORK/$build.bin" "$build-$round-replay" --snapshot "$snap" --snapshot-every 0 --wal
    stop
    rm -f "$snap"*
    echo "round $round $build done" >&2
  done
done

python3 - "$WORK" "$ROUNDS" <<'PY'
import json, re, sys
work, rounds = sys.argv[1], int(sys.argv[2])
import os
def lat(b, r):
    if not os.path.exists(f"{work}/{b}-{r}-latency.json"):
        return []
    rows = json.load(open(f"{work}/{b}-{r}-latency.json"))["rows"]
    return [(row["blocks"], row["ratio"]["p50"], row["ratio"]["p99"]) for row in rows]
def load(b, r):
    if not os.path.exists(f"{work}/{b}-{r}-load.json"):
        return float("nan"), float("nan"), ""
    rep = json.load(open(f"{work}/{b}-{r}-load.json"))
    q, f = rep["queries"], rep.get("floor")
    tails = f"{q['latency']['p99_us']:.0f} / {q['latency']['p999_us']:.0f} / {q['latency']['max_us']:.0f}"
    if f:
        tails += f" (floor {f['latency']['p99_us']:.0f} / {f['latency']['p999_us']:.0f} / {f['latency']['max_us']:.0f})"
    return q["miss_share"] * 100, f["miss_share"] * 100 if f else float("nan"), tails
def replay(b, r):
    if not os.path.exists(f"{work}/{b}-{r}-replay.err"):
        return (0, 0)
    text = re.sub(r"\x1b\[[0-9;]*m", "", open(f"{work}/{b}-{r}-replay.err").read())
    m = re.search(r"write-ahead log replayed.*?records=(\d+).*?per_second=(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)
print("| build | round | query/floor p50 (125, 1250 blocks) | p99 | load misses queries / floor (%) | load query p99 / p99.9 / max µs | WAL replay records/s |")
print("|---|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    for b in ("base", "head"):
        l = lat(b, r)
        q, f, tails = load(b, r)
        n, rate = replay(b, r)
        p50 = " / ".join(f"{x[1]:.2f}" for x in l)
        p99 = " / ".join(f"{x[2]:.2f}" for x in l)
        print(f"| {b} | {r} | {p50} | {p99} | {q:.2f} / {f:.2f} | {tails} | {rate:,} ({n:,} records) |")
PY
