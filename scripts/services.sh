#!/usr/bin/env bash
# Make sure Postgres and RabbitMQ answer on loopback, starting them if this
# machine has them installed but stopped. Idempotent: a no-op when both run.
set -euo pipefail

PGHOST=${PGHOST:-127.0.0.1}
PGPORT=${PGPORT:-5432}
AMQP_PORT=${AMQP_PORT:-5672}

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

wait_port() {
  local host=$1 port=$2 name=$3
  for _ in $(seq 1 60); do
    port_open "$host" "$port" && return 0
    sleep 1
  done
  echo "services: $name did not come up on $host:$port" >&2
  return 1
}

compose_up() {
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    docker compose up -d "$1"
    return 0
  fi
  return 1
}

if ! port_open "$PGHOST" "$PGPORT"; then
  echo "services: starting PostgreSQL" >&2
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
  elif ! compose_up postgres; then
    echo "services: PostgreSQL is not running on $PGHOST:$PGPORT and cannot be started here" >&2
    exit 1
  fi
  wait_port "$PGHOST" "$PGPORT" PostgreSQL
fi

if ! port_open 127.0.0.1 "$AMQP_PORT"; then
  echo "services: starting RabbitMQ" >&2
  if command -v rabbitmq-server >/dev/null 2>&1; then
    rabbitmq-server -detached || true
  elif ! compose_up rabbitmq; then
    echo "services: RabbitMQ is not running on 127.0.0.1:$AMQP_PORT and cannot be started here" >&2
    exit 1
  fi
  wait_port 127.0.0.1 "$AMQP_PORT" RabbitMQ
fi

# Quorum-queue dead-lettering with the at-least-once strategy needs these.
if command -v rabbitmqctl >/dev/null 2>&1; then
  rabbitmqctl -q await_startup >/dev/null 2>&1 || true
  rabbitmqctl -q enable_feature_flag all >/dev/null 2>&1 || true
fi

# The dashboard's browser tests drive Debian's headless Chromium through
# Playwright (its own browser download cannot be used here). Installed once;
# the package lists are refreshed only if the install fails without them.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  echo "services: installing chromium (the dashboard's browser tests)" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q chromium >/dev/null; then
    apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null
  fi
fi
