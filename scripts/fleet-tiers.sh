#!/usr/bin/env bash
# Routing with tiers, end to end: kvix-bench fleet with engines whose GPU cache spills
# into a CPU tier (vLLM's offloading connector's events), three legs on one workload per
# seed: the oracle (every engine's tiers read at routing time, weighed by the time
# model), events (kvix, the pick weighing a CPU block 1 - 80/800 = 0.9 of a GPU one) and
# events-joint (kvix, a CPU block counted as a GPU one: v4's joint depth). Prints the
# follow-ups' TTFT (mean, p90) per leg and seed, and each leg's mean over the seeds
# against the oracle's.
#
#   scripts/fleet-tiers.sh                  # seeds 1 2 3
#   SEEDS="1 2 3 4 5" scripts/fleet-tiers.sh
#   FLEET_ARGS="--engines 80 --session-rate 80" scripts/fleet-tiers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target-bench}"
SEEDS="${SEEDS:-1 2 3}"
# A GPU cache of 384 blocks holds the 128-block system prefix and about one session;
# the CPU tier ten times as much. Four-turn sessions come back after their GPU copy
# is gone, while the CPU still holds it.
FLEET_ARGS="${FLEET_ARGS:---engines 40 --gateways 8 --session-rate 40 --seconds 20 --turns 4 --capacity-blocks 384 --cpu-capacity-blocks 4096 --cpu-load-us-per-block 80 --prefill-us-per-token 50}"
cargo build --release -p kvix-server -p kvix-bench
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
for seed in $SEEDS; do
  # shellcheck disable=SC2086
  "$CARGO_TARGET_DIR/release/kvix-bench" --json --quiet fleet --legs oracle,events,events-joint \
    --seed "$seed" $FLEET_ARGS >"$OUT/seed-$seed.json"
done
python3 - "$OUT" $SEEDS <<'EOF'
import json, sys
out, seeds = sys.argv[1], sys.argv[2:]
rows = {}
print("seed  leg           follow-up hit  CPU share  TTFT mean ms  TTFT p90 ms  prefill ms  TTFT vs oracle  requests")
for s in seeds:
    r = json.load(open(f"{out}/seed-{s}.json"))
    for l in r["legs"]:
        rows.setdefault(l["leg"], []).append(l)
        print("%4s  %-12s  %13.3f  %9.3f  %12.1f  %11.1f  %10.1f  %14.3f  %8d" % (
            s, l["leg"], l["followup_hit"], l["followup_cpu_share"], l["followup_ttft_mean_ms"],
            l["followup_ttft_p90_ms"], l["followup_prefill_mean_ms"], l["ttft_vs_oracle"] or 0,
            l["requests"]))
mean = lambda v: sum(v) / len(v)
oracle = mean([l["followup_ttft_mean_ms"] for l in rows["oracle"]])
print("over the seeds:")
for leg, ls in rows.items():
    m = mean([l["followup_ttft_mean_ms"] for l in ls])
    p90 = mean([l["followup_ttft_p90_ms"] for l in ls])
    pre = mean([l["followup_prefill_mean_ms"] for l in ls])
    print("  %-12s  TTFT mean %.1f ms (%.3f of the oracle's), p90 %.1f ms, prefill %.1f ms" % (leg, m, m / oracle, p90, pre))
EOF
