#!/usr/bin/env bash
# Builds kvix-server's container image (deploy/Dockerfile) from the repository root:
#   scripts/build-image.sh [TAG]     (default kvix-server:latest)
# The image's build stage runs the release build CI runs (.ci/run), so what CI tests is
# what the image holds.
set -euo pipefail
cd "$(dirname "$0")/.."
tag="${1:-kvix-server:latest}"
exec docker build -f deploy/Dockerfile -t "$tag" .
