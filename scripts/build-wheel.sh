#!/usr/bin/env bash
# Builds the kvix-client wheel as it is distributed: release, stripped, the stable ABI
# (CPython 3.11+), linked against glibc 2.28 with zig (manylinux_2_28: RHEL 8 / Ubuntu
# 20.04 and later), into DIR (default target/wheels); prints the wheel's path.
# maturin and ziglang come from the tests' Python environment (scripts/testenv.py makes
# it on first use, ~200 MB of wheels once), or from $PYTHON when set.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-target/wheels}"
python="${PYTHON:-$(python3 scripts/testenv.py ensure)}"
mkdir -p "$out"
# maturin finds zig as `python -m ziglang` on PATH: that environment's python first.
PATH="$(dirname "$python"):$PATH" CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/wheel}" \
  "$python" -m maturin build --release --zig --compatibility manylinux_2_28 \
  -i "$python" -m client/python/Cargo.toml -o "$out" >&2
ls -t "$out"/kvix_client-*-cp311-abi3-manylinux_2_28_x86_64.whl | head -1
