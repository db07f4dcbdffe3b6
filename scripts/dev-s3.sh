#!/usr/bin/env bash
# For `make dev` on a machine without MinIO: scripts/dev-s3.sh COMMAND [ARG...]
# runs COMMAND with JOBPLANE_S3_URL set. When it is unset and no S3-protocol
# server answers on loopback, a local one (moto's server mode, a dev
# dependency) is started for COMMAND and stopped when COMMAND ends, however it
# ends (Ctrl-C included): nothing is left running. Its objects live in memory.
set -euo pipefail

if [[ -n "${JOBPLANE_S3_URL:-}" ]]; then
  exec "$@"
fi

VENV=${VENV:-.venv}
HOST=127.0.0.1
PORT=${JOBPLANE_DEV_S3_PORT:-9100}
LOG_DIR=${JOBPLANE_DATA_DIR:-.jobplane}

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

export JOBPLANE_S3_URL="http://$HOST:$PORT"
if port_open "$HOST" "$PORT"; then
  exec "$@"  # one answers already (MinIO, or another command's): not ours to stop
fi

mkdir -p "$LOG_DIR"
echo "services: starting a local S3 server (moto) on $HOST:$PORT; it stops with the command" >&2
"$VENV/bin/moto_server" -H "$HOST" -p "$PORT" >"$LOG_DIR/s3.log" 2>&1 </dev/null &
s3=$!
# Whatever ends this script ends the server: the command's exit, an error here,
# or a signal (the shell waits for the command in the foreground, then runs this).
trap 'kill "$s3" 2>/dev/null || true; wait "$s3" 2>/dev/null || true' EXIT
for _ in $(seq 1 60); do
  port_open "$HOST" "$PORT" && break
  kill -0 "$s3" 2>/dev/null || break
  sleep 0.5
done
port_open "$HOST" "$PORT" || { echo "services: the local S3 server did not come up; see $LOG_DIR/s3.log" >&2; exit 1; }
# Not exec: this shell stays to stop the server after the command. A Ctrl-C
# reaches the command itself (it is in the terminal's foreground group).
"$@"
