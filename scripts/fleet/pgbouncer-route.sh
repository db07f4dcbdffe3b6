#!/usr/bin/env bash
# Patroni's callback (on_start, on_role_change): when this node becomes the
# leader, point PgBouncer at it. Patroni calls it as `ACTION ROLE SCOPE`, with
# the environment scripts/fleet/postgres.sh started it with.
#
# PgBouncer 1.18 knows one host per database, so the [databases] section names
# the leader's port and a SIGHUP makes PgBouncer reload it: connections to the
# old host are closed as they come free, clients keep theirs.
set -euo pipefail

role=${2:-}
case $role in
  master | primary) ;;
  *) exit 0 ;;
esac
FLEET_DIR=${FLEET_DIR:?}
conf=$FLEET_DIR/pgbouncer-databases.ini
printf '[databases]\n* = host=127.0.0.1 port=%s\n' "${FLEET_NODE_PORT:?}" >"$conf.new"
mv "$conf.new" "$conf"
pidfile=$FLEET_DIR/run/pgbouncer.pid
if [ -f "$pidfile" ]; then
  kill -HUP "$(cat "$pidfile")" 2>/dev/null || true
fi
echo "$(date -u +%FT%TZ) PgBouncer routed to 127.0.0.1:$FLEET_NODE_PORT (${1:-?})" >>"$FLEET_DIR/route.log"
