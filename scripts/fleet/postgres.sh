#!/usr/bin/env bash
# A Postgres pair with automatic failover, on loopback, for the fleet tests
# (docs/fleet.md, ADR-0048): a one-member etcd, two Patroni nodes of
# PostgreSQL 15 (streaming replication, synchronous mode on) and PgBouncer in
# transaction pooling in front of whichever node leads.
#
#   scripts/fleet/postgres.sh [start]   start what is not running (a no-op when all runs)
#   scripts/fleet/postgres.sh stop      stop everything started here
#   scripts/fleet/postgres.sh status    the cluster as Patroni sees it
#
# Everything lives under $FLEET_DIR (build/fleet/postgres); the machine's own
# Postgres (5432) is never touched. Ports (loopback only):
#   etcd 23790 (clients) / 23800 (peers); Patroni REST 18008 (pg1), 18009 (pg2);
#   Postgres 54321 (pg1), 54322 (pg2); PgBouncer 64320.
# Superuser postgres, password "postgres" (scram-sha-256 over TCP; the
# nodes' Unix sockets, under run/, trust).
set -euo pipefail
export PATH=$PATH:/usr/sbin

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FLEET_DIR=${FLEET_DIR:-$ROOT/build/fleet/postgres}
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
ETCD_PORT=${FLEET_ETCD_PORT:-23790}
ETCD_PEER_PORT=${FLEET_ETCD_PEER_PORT:-23800}
BOUNCER_PORT=${FLEET_PGBOUNCER_PORT:-64320}
RUN_AS=${FLEET_RUN_AS:-postgres}
NODES=(pg1 pg2)
declare -A PG_PORT=([pg1]=54321 [pg2]=54322)
declare -A REST_PORT=([pg1]=18008 [pg2]=18009)

say() { echo "fleet-postgres: $*" >&2; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {
  local what=$1 tries=$2
  shift 2
  for _ in $(seq 1 "$tries"); do
    "$@" && return 0
    sleep 1
  done
  say "$what did not come up (logs: $FLEET_DIR/*.log)"
  return 1
}

# Postgres will not run as root: every process runs as $RUN_AS when we are root
# (setpriv execs, so a pid recorded here is the process's own).
as_owner() {
  if [ "$(id -u)" = 0 ]; then
    HOME=$FLEET_DIR setpriv --reuid "$RUN_AS" --regid "$RUN_AS" --init-groups "$@"
  else
    "$@"
  fi
}

# Start "$@" detached, its output in $FLEET_DIR/$name.log, its pid in $name.pid.
spawn() {
  local name=$1 log=$FLEET_DIR/$1.log
  shift
  if [ "$(id -u)" = 0 ]; then
    HOME=$FLEET_DIR setpriv --reuid "$RUN_AS" --regid "$RUN_AS" --init-groups \
      setsid "$@" >>"$log" 2>&1 </dev/null &
  else
    setsid "$@" >>"$log" 2>&1 </dev/null &
  fi
  echo $! >"$FLEET_DIR/$name.pid"
}

running() {
  local pidfile=$FLEET_DIR/$1.pid
  [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null
}

install_packages() {
  local missing=()
  command -v etcd >/dev/null 2>&1 || missing+=(etcd-server etcd-client)
  command -v patroni >/dev/null 2>&1 || missing+=(patroni)
  command -v pgbouncer >/dev/null 2>&1 || missing+=(pgbouncer)
  [ -x "$PG_BIN/postgres" ] || missing+=(postgresql-15)
  [ ${#missing[@]} = 0 ] && return 0
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q "${missing[@]}" >/dev/null; then
    apt-get update -q >/dev/null && apt-get install -y -q "${missing[@]}" >/dev/null
  fi
}

prepare_dir() {
  mkdir -p "$FLEET_DIR/run"
  if [ "$(id -u)" = 0 ]; then chown -R "$RUN_AS:" "$FLEET_DIR"; fi
  chmod 700 "$FLEET_DIR"
}

start_etcd() {
  running etcd && return 0
  say "starting etcd on 127.0.0.1:$ETCD_PORT"
  spawn etcd etcd --name fleet --data-dir "$FLEET_DIR/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
    --initial-cluster "fleet=http://127.0.0.1:$ETCD_PEER_PORT" \
    --listen-metrics-urls "" --log-level warn
  wait_for etcd 30 port_open "$ETCD_PORT"
}

# One Patroni node's configuration. ttl/loop_wait/retry_timeout are short so a
# lost leader is replaced in about ttl seconds; synchronous_mode makes every
# commit wait for the standby, so a failover never loses an acknowledged commit.
write_patroni_config() {
  local node=$1 port=${PG_PORT[$1]} rest=${REST_PORT[$1]}
  cat >"$FLEET_DIR/$node.yml" <<EOF
scope: jobplane-fleet
name: $node
log:
  level: INFO
restapi:
  listen: 127.0.0.1:$rest
  connect_address: 127.0.0.1:$rest
etcd3:
  hosts: 127.0.0.1:$ETCD_PORT
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 2
    retry_timeout: 4
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    postgresql:
      use_pg_rewind: true
      parameters:
        wal_level: replica
        hot_standby: "on"
        wal_log_hints: "on"
        max_connections: 200
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 256MB
  initdb:
    - encoding: UTF8
    - locale: C.UTF-8
  pg_hba:
    - local all all trust
    - host replication replicator 127.0.0.1/32 scram-sha-256
    - host all all 127.0.0.1/32 scram-sha-256
postgresql:
  listen: 127.0.0.1:$port
  connect_address: 127.0.0.1:$port
  data_dir: $FLEET_DIR/$node
  bin_dir: $PG_BIN
  pgpass: $FLEET_DIR/run/$node.pgpass
  authentication:
    superuser: {username: postgres, password: postgres}
    replication: {username: replicator, password: replicator}
    rewind: {username: postgres, password: postgres}
  parameters:
    unix_socket_directories: $FLEET_DIR/run
    fsync: "on"
  callbacks:
    on_start: $ROOT/scripts/fleet/pgbouncer-route.sh
    on_role_change: $ROOT/scripts/fleet/pgbouncer-route.sh
EOF
}

start_node() {
  local node=$1
  running "$node" && return 0
  say "starting Patroni $node (Postgres on 127.0.0.1:${PG_PORT[$node]}, REST ${REST_PORT[$node]})"
  write_patroni_config "$node"
  as_owner chmod 600 "$FLEET_DIR/$node.yml" 2>/dev/null || true
  spawn "$node" env FLEET_DIR="$FLEET_DIR" FLEET_NODE_PORT="${PG_PORT[$node]}" \
    patroni "$FLEET_DIR/$node.yml"
}

rest() { curl -fsS --max-time 2 "http://127.0.0.1:$1$2" 2>/dev/null; }
has_leader() { rest "${REST_PORT[pg1]}" /cluster | grep -q '"role": *"leader"'; }
node_streaming() { rest "${REST_PORT[$1]}" /health >/dev/null; }
has_sync_standby() { rest "${REST_PORT[pg1]}" /cluster | grep -q '"role": *"sync_standby"'; }

write_bouncer_config() {
  local leader_port=$1
  [ -f "$FLEET_DIR/pgbouncer.ini" ] && return 0
  cat >"$FLEET_DIR/userlist.txt" <<EOF
"postgres" "postgres"
EOF
  # The [databases] section names the leader; pgbouncer-route.sh (Patroni's
  # callback) rewrites it on every role change and tells PgBouncer to reload.
  [ -f "$FLEET_DIR/pgbouncer-databases.ini" ] ||
    printf '[databases]\n* = host=127.0.0.1 port=%s\n' "$leader_port" >"$FLEET_DIR/pgbouncer-databases.ini"
  cat >"$FLEET_DIR/pgbouncer.ini" <<EOF
%include $FLEET_DIR/pgbouncer-databases.ini
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $BOUNCER_PORT
unix_socket_dir = $FLEET_DIR/run
auth_type = scram-sha-256
auth_file = $FLEET_DIR/userlist.txt
admin_users = postgres
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 40
max_db_connections = 80
server_connect_timeout = 3
server_login_retry = 1
query_wait_timeout = 30
server_reset_query =
ignore_startup_parameters = extra_float_digits,jit
logfile = $FLEET_DIR/pgbouncer.log
pidfile = $FLEET_DIR/run/pgbouncer.pid
EOF
  if [ "$(id -u)" = 0 ]; then chown "$RUN_AS:" "$FLEET_DIR"/pgbouncer*.ini "$FLEET_DIR/userlist.txt"; fi
}

leader_port() {
  local node
  for node in "${NODES[@]}"; do
    if rest "${REST_PORT[$node]}" /primary >/dev/null; then
      echo "${PG_PORT[$node]}"
      return 0
    fi
  done
  return 1
}

start_bouncer() {
  local port
  if [ -f "$FLEET_DIR/run/pgbouncer.pid" ] && kill -0 "$(cat "$FLEET_DIR/run/pgbouncer.pid")" 2>/dev/null; then
    return 0
  fi
  port=$(leader_port)
  write_bouncer_config "$port"
  say "starting PgBouncer on 127.0.0.1:$BOUNCER_PORT (transaction pooling, leader on $port)"
  as_owner pgbouncer -d "$FLEET_DIR/pgbouncer.ini"
  wait_for PgBouncer 20 port_open "$BOUNCER_PORT"
}

start() {
  install_packages
  prepare_dir
  start_etcd
  local node
  for node in "${NODES[@]}"; do start_node "$node"; done
  wait_for "a Patroni leader" 90 has_leader
  for node in "${NODES[@]}"; do wait_for "Patroni $node" 90 node_streaming "$node"; done
  wait_for "a synchronous standby" 60 has_sync_standby
  start_bouncer
  say "ready: postgresql://postgres:postgres@127.0.0.1:${PG_PORT[pg1]},127.0.0.1:${PG_PORT[pg2]}/postgres?target_session_attrs=read-write"
  say "       postgresql://postgres:postgres@127.0.0.1:$BOUNCER_PORT/postgres?pgbouncer=true"
}

stop_pid() {
  local name=$1 pidfile=$2 pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    say "stopping $name ($pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

stop() {
  stop_pid PgBouncer "$FLEET_DIR/run/pgbouncer.pid"
  local node
  for node in "${NODES[@]}"; do stop_pid "Patroni $node" "$FLEET_DIR/$node.pid"; done
  # A Postgres left behind by a Patroni that was killed (the fault tests do).
  for node in "${NODES[@]}"; do
    if [ -f "$FLEET_DIR/$node/postmaster.pid" ]; then
      as_owner "$PG_BIN/pg_ctl" -D "$FLEET_DIR/$node" -m fast stop >/dev/null 2>&1 || true
    fi
  done
  stop_pid etcd "$FLEET_DIR/etcd.pid"
}

case ${1:-start} in
  start) start ;;
  stop) [ -d "$FLEET_DIR" ] && stop || true ;;
  start-node) prepare_dir && start_node "$2" ;;
  status) rest "${REST_PORT[pg1]}" /cluster || rest "${REST_PORT[pg2]}" /cluster ;;
  *) echo "usage: $0 [start|stop|status|start-node pg1|pg2]" >&2; exit 2 ;;
esac
