#!/usr/bin/env bash
# Starts or stops a throwaway local redis-server on 127.0.0.1:6379 for `kvix-bench redis`.
#   scripts/redis.sh start   # installs redis-server with apt-get if missing, starts it in the background
#   scripts/redis.sh stop    # stops the one this script started
#   scripts/redis.sh status
# No persistence (no RDB/AOF), loopback only; state lives in ${KVIX_REDIS_DIR:-/tmp/kvix-bench-redis}.
set -euo pipefail
PORT="${KVIX_REDIS_PORT:-6379}"
DIR="${KVIX_REDIS_DIR:-/tmp/kvix-bench-redis}"
PIDFILE="$DIR/redis.pid"

ping() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT" && printf 'PING\r\n' >&3 && timeout 1 head -c 7 <&3 | grep -q PONG) 2>/dev/null; }

case "${1:-}" in
start)
  if ping; then echo "redis already answering on 127.0.0.1:$PORT"; exit 0; fi
  if ! command -v redis-server >/dev/null 2>&1; then
    echo "redis-server missing: installing (apt-get)" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server >/dev/null
  fi
  mkdir -p "$DIR"
  redis-server --bind 127.0.0.1 --port "$PORT" --protected-mode yes --save "" --appendonly no \
    --dir "$DIR" --daemonize yes --pidfile "$PIDFILE" --logfile "$DIR/redis.log"
  for _ in $(seq 1 50); do
    if ping; then echo "redis started on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"))"; exit 0; fi
    sleep 0.1
  done
  echo "redis did not answer within 5 s; see $DIR/redis.log" >&2
  exit 1
  ;;
stop)
  if [ -f "$PIDFILE" ]; then
    pid="$(cat "$PIDFILE")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$PIDFILE"
    echo "redis stopped"
  else
    echo "no redis started by this script (no $PIDFILE)"
  fi
  ;;
status)
  if ping; then echo "redis answering on 127.0.0.1:$PORT"; else echo "redis not answering on 127.0.0.1:$PORT"; exit 1; fi
  ;;
*)
  echo "usage: $0 start|stop|status" >&2
  exit 2
  ;;
esac
