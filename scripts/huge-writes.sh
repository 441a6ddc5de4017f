#!/usr/bin/env bash
# Queries beside frame-limit writes (`kvix-bench huge-writes`), against kvix-server and
# against `kvix-bench echo-server` (the transport's floor: the same frames answered at
# once, no index), both in processes of their own on CPU 0 with the bench on CPU 1.
# With BASE=COMMIT, that commit's kvix-server is measured in the same rounds too (the
# order rotating each round), for the writes' rate and the queries' tails before a change.
#
#   scripts/huge-writes.sh                 # ROUNDS=5 by default
#   BASE=8cfb06b ROUNDS=5 scripts/huge-writes.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
ROUNDS="${ROUNDS:-5}"
# The base builds in a target directory of its own: cargo hashes path dependencies
# relative to the workspace root, so a worktree's build in the work tree's directory
# could take the other side's artifacts as up to date (scripts/ab.sh).
BASE_TARGET="${BASE_TARGET:-$ROOT/target-bench/base}"
WORK=$(mktemp -d)
PID=""
cleanup() {
  [ -n "$PID" ] && kill -9 "$PID" 2>/dev/null || true
  git worktree remove --force "$WORK/base" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

cargo build -q --release -p kvix-server -p kvix-bench
cp target/release/kvix-server "$WORK/head.bin"
cp target/release/kvix-bench "$WORK/bench"
BENCH="$WORK/bench"
SIDES="head echo"
if [ -n "${BASE:-}" ]; then
  git worktree add -q --detach "$WORK/base" "$BASE"
  (cd "$WORK/base" && CARGO_TARGET_DIR="$BASE_TARGET" cargo build -q --release -p kvix-server)
  cp "$BASE_TARGET/release/kvix-server" "$WORK/base.bin"
  SIDES="base head echo"
fi
echo "head: $(git rev-parse --short HEAD)$(git diff --quiet || echo '+dirty')${BASE:+, base: $BASE}" >&2

wait_addr() { # log: the address it says it listens on
  for _ in $(seq 1 600); do
    a=$(sed -n 's/.*listening on \(tcp:\/\/\)\{0,1\}\([0-9.]*:[0-9]*\).*/\2/p' "$1" 2>/dev/null | head -1)
    [ -n "$a" ] && { echo "$a"; return; }
    sleep 0.05
  done
  echo "no address in $1" >&2; cat "$1" >&2; exit 1
}
run_side() { # side, round
  local side="$1" round="$2" log="$WORK/$1-$2.log" echo=""
  if [ "$side" = echo ]; then
    taskset -c 0 "$BENCH" echo-server >"$log" 2>&1 &
    echo="--echo"
  else
    taskset -c 0 "$WORK/$side.bin" --listen 127.0.0.1:0 --unix "" --metrics "" --cores 1 \
      --pin false >"$log" 2>&1 &
  fi
  PID=$!
  addr=$(wait_addr "$log")
  taskset -c 1 "$BENCH" huge-writes --server "$addr" $echo --json >"$WORK/$side-$round.json"
  kill -TERM "$PID"; wait "$PID" 2>/dev/null || true; PID=""
}
for round in $(seq 1 "$ROUNDS"); do
  set -- $SIDES
  # Rotate the order each round, so no side always runs first on a cold machine.
  for _ in $(seq 2 "$round"); do set -- "${@:2}" "$1"; done
  for side in "$@"; do run_side "$side" "$round"; done
  echo "round $round done" >&2
done

python3 - "$WORK" "$ROUNDS" "$SIDES" <<'PY'
import json, sys
work, rounds, sides = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
print("| side | round | idle p50 / p99 | during writes p50 / p99 / p99.9 / max (µs) | past 2 ms | writes M block events/s |")
print("|---|---|---|---|---|---|")
for r in range(1, rounds + 1):
    for s in sides:
        d = json.load(open(f"{work}/{s}-{r}.json"))
        i, w = d["idle"], d["during_writes"]
        print(f"| {s} | {r} | {i['p50_us']:.0f} / {i['p99_us']:.0f} | {w['p50_us']:.0f} / {w['p99_us']:.0f} / "
              f"{w['p999_us']:.0f} / {w['max_us']:.0f} | {d['past_deadline']} of {w['count']} | "
              f"{d['block_events_per_s'] / 1e6:.2f} |")
PY
