#!/usr/bin/env bash
# What a query costs from Python over the Rust client, same process, same connection,
# same server (client/python/bench/overhead.py): builds the package in release
# (`pip install ./client/python` into target-bench/python-site), starts a release
# kvix-server on a free port, runs the comparison, stops the server. maturin comes from
# the tests' Python environment (scripts/testenv.py makes it on first use).
#
#   scripts/python-overhead.sh [overhead.py flags, e.g. --rounds 40 --spin-us 300]
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-bench}"
SITE="$CARGO_TARGET_DIR/python-site"
PY="$(python3 scripts/testenv.py ensure)"
cargo build --release -p kvix-server
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation \
  --upgrade --target "$SITE" ./client/python
"$CARGO_TARGET_DIR/release/kvix-server" --listen 127.0.0.1:0 --unix "" --metrics "" \
  --cores 1 --pin false >"$CARGO_TARGET_DIR/python-overhead-server.out" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
ADDR=""
for _ in $(seq 1 100); do
  ADDR="$(sed -n 's/.*listening on tcp:\/\/\([^ ]*\).*/\1/p' "$CARGO_TARGET_DIR/python-overhead-server.out" | head -1)"
  [ -n "$ADDR" ] && break
  sleep 0.05
done
[ -n "$ADDR" ] || { echo "kvix-server did not start" >&2; exit 1; }
PYTHONPATH="$SITE" "$PY" client/python/bench/overhead.py --server "$ADDR" "$@"
