#!/usr/bin/env bash
# A three-node RabbitMQ cluster on this host, for the fleet tests and for
# trying failover by hand (docs/operations.md, "A RabbitMQ node lost").
#
#   scripts/fleet/rabbitmq.sh [start]   start the nodes that are down, cluster them
#   scripts/fleet/rabbitmq.sh stop      stop the three nodes (their data stays)
#   scripts/fleet/rabbitmq.sh status    the cluster as node jp1 sees it
#   scripts/fleet/rabbitmq.sh urls      the AMQP addresses, for JOBPLANE_AMQP_URL
#   scripts/fleet/rabbitmq.sh reset     stop and delete the nodes' data
#
# Nodes jp1@localhost, jp2@localhost, jp3@localhost: AMQP on 5681-5683,
# distribution on 25681-25683, management on 15681-15683, all on loopback.
# Their data, logs, configuration and Erlang cookie live under
# build/fleet/rabbitmq/ (FLEET_RABBITMQ_DIR). The machine's own RabbitMQ node
# (rabbit@..., 5672) is another node and is never touched. Idempotent: a start
# with all three running and clustered does nothing.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${FLEET_RABBITMQ_DIR:-$ROOT/build/fleet/rabbitmq}
SBIN=${RABBITMQ_SBIN:-$(dirname "$(readlink -f "$(command -v rabbitmq-server || echo /usr/lib/rabbitmq/bin/rabbitmq-server)")")}
NODES=(1 2 3)
HOSTNAME_PART=localhost

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

node_env() {
  # The environment of node jp$1 (and of the CLI tools that talk to it).
  local n=$1 base="$DIR/jp$1"
  export HOME="$DIR/home"
  export RABBITMQ_NODENAME="jp$n@$HOSTNAME_PART"
  export RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
  export RABBITMQ_NODE_PORT=$((5680 + n))
  export RABBITMQ_DIST_PORT=$((25680 + n))
  export RABBITMQ_MNESIA_BASE="$base/mnesia"
  export RABBITMQ_LOG_BASE="$base/log"
  export RABBITMQ_PID_FILE="$base/pid"
  export RABBITMQ_CONFIG_FILE="$base/rabbitmq.conf"
  export RABBITMQ_ENABLED_PLUGINS_FILE="$base/enabled_plugins"
  export RABBITMQ_CONF_ENV_FILE="$base/rabbitmq-env.conf"
  export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
}

ctl() { # ctl N args...: rabbitmqctl against node jpN
  local n=$1
  shift
  (node_env "$n" && "$SBIN/rabbitmqctl" -n "jp$n@$HOSTNAME_PART" "$@")
}

prepare() {
  mkdir -p "$DIR/home"
  if [ ! -s "$DIR/home/.erlang.cookie" ]; then
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$DIR/home/.erlang.cookie"
  fi
  chmod 400 "$DIR/home/.erlang.cookie"
  local n base
  for n in "${NODES[@]}"; do
    base="$DIR/jp$n"
    mkdir -p "$base/mnesia" "$base/log"
    : > "$base/rabbitmq-env.conf"
    echo "[rabbitmq_management]." > "$base/enabled_plugins"
    cat > "$base/rabbitmq.conf" <<CONF
listeners.tcp.default = 127.0.0.1:$((5680 + n))
management.tcp.ip = 127.0.0.1
management.tcp.port = $((15680 + n))
cluster_name = jobplane-fleet
CONF
  done
}

running() { # running N: the node answers its CLI
  ctl "$1" -q status >/dev/null 2>&1
}

start_node() {
  local n=$1
  if running "$n"; then
    return 0
  fi
  echo "fleet-rabbitmq: starting jp$n@$HOSTNAME_PART (AMQP 127.0.0.1:$((5680 + n)))" >&2
  (node_env "$n" && nohup "$SBIN/rabbitmq-server" > "$DIR/jp$n/log/console.log" 2>&1 &)
}

wait_node() {
  local n=$1
  for _ in $(seq 1 120); do
    if ctl "$n" -q await_startup --timeout 5 >/dev/null 2>&1 && port_open $((5680 + n)); then
      return 0
    fi
    sleep 1
  done
  echo "fleet-rabbitmq: jp$n did not start; see $DIR/jp$n/log/" >&2
  return 1
}

clustered() { # clustered N: jpN's running nodes include jp1
  ctl "$1" -q cluster_status 2>/dev/null | grep -q "jp1@$HOSTNAME_PART"
}

join() {
  local n=$1
  if clustered "$n"; then
    return 0
  fi
  echo "fleet-rabbitmq: jp$n joins jp1's cluster" >&2
  {
    ctl "$n" -q stop_app
    ctl "$n" -q reset
    ctl "$n" -q join_cluster "jp1@$HOSTNAME_PART"
    ctl "$n" -q start_app
  } >> "$DIR/jp$n/log/join.log" 2>&1
}

start() {
  prepare
  local n
  for n in "${NODES[@]}"; do start_node "$n"; done
  for n in "${NODES[@]}"; do wait_node "$n"; done
  for n in 2 3; do join "$n"; done
  status
}

stop() {
  local n pid
  for n in "${NODES[@]}"; do
    [ -d "$DIR/jp$n" ] || continue
    if running "$n"; then
      echo "fleet-rabbitmq: stopping jp$n@$HOSTNAME_PART" >&2
      ctl "$n" -q stop >/dev/null 2>&1 || true
    fi
    pid=$(cat "$DIR/jp$n/pid" 2>/dev/null || true)
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && ! running "$n"; then
      # A node whose Erlang VM outlived its CLI stop (or was never clustered).
      kill "$pid" 2>/dev/null || true
    fi
  done
}

status() {
  local nodes
  nodes=$(ctl 1 -q cluster_status --formatter json 2>/dev/null | grep -o '"running_nodes":\[[^]]*\]' || true)
  echo "fleet-rabbitmq: ${nodes:-"jp1 is not running"}" >&2
  urls
}

urls() {
  local vhost=${1:-} n out=""
  for n in "${NODES[@]}"; do
    out="$out${out:+,}amqp://guest:guest@127.0.0.1:$((5680 + n))/$vhost"
  done
  echo "$out"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  urls) urls "${2:-}" ;;
  reset) stop; rm -rf "$DIR" ;;
  *) echo "usage: $0 [start|stop|status|urls [vhost]|reset]" >&2; exit 2 ;;
esac
