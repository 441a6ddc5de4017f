#!/usr/bin/env bash
# Builds the kvix-client wheel as it is distributed: release, stripped, the stable ABI
# (CPython 3.11+), linked against glibc 2.28 with zig (manylinux_2_28: RHEL 8 / Ubuntu
# 20.04 and later), into DIR (default target/wheels). Needs python3 with maturin and
# ziglang (pip install "maturin>=1.7,<2" "ziglang<0.14"); prints the wheel's path.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-target/wheels}"
mkdir -p "$out"
CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target/wheel}" python3 -m maturin build --release \
  --zig --compatibility manylinux_2_28 -m client/python/Cargo.toml -o "$out" >&2
ls -t "$out"/kvix_client-*-cp311-abi3-manylinux_2_28_x86_64.whl | head -1
