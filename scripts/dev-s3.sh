#!/usr/bin/env bash
# For `make dev` on a machine without MinIO: when JOBPLANE_S3_URL is unset,
# make sure an S3-protocol server answers on loopback, starting moto's server
# mode (a dev dependency) in the background if it is not already running.
# Idempotent. Its objects live in memory: they do not survive its restart.
# Prints the endpoint to use as JOBPLANE_S3_URL.
set -euo pipefail

if [[ -n "${JOBPLANE_S3_URL:-}" ]]; then
  echo "$JOBPLANE_S3_URL"
  exit 0
fi

VENV=${VENV:-.venv}
HOST=127.0.0.1
PORT=${JOBPLANE_DEV_S3_PORT:-9100}
LOG_DIR=${JOBPLANE_DATA_DIR:-.jobplane}

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

if ! port_open "$HOST" "$PORT"; then
  mkdir -p "$LOG_DIR"
  echo "services: starting a local S3 server (moto) on $HOST:$PORT" >&2
  setsid nohup "$VENV/bin/moto_server" -H "$HOST" -p "$PORT" >"$LOG_DIR/s3.log" 2>&1 </dev/null &
  for _ in $(seq 1 60); do
    port_open "$HOST" "$PORT" && break
    sleep 0.5
  done
  port_open "$HOST" "$PORT" || { echo "services: the local S3 server did not come up; see $LOG_DIR/s3.log" >&2; exit 1; }
fi
echo "http://$HOST:$PORT"
