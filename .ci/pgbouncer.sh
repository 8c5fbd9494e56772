#!/usr/bin/env bash
# .ci/pgbouncer.sh CMD [ARGS...]: run CMD with a PgBouncer in transaction pooling mode in front of
# the test Postgres, then stop it. PgBouncer (Debian's package, 1.18) is installed when missing and
# this runs as root; it listens on a free loopback port, with its config, auth file, log and pidfile
# in a temporary directory removed at exit. CMD sees TXLIMIT_PGBOUNCER_URL, the URL of database
# $PGBOUNCER_DB (default test) through it as user postgres (trust auth; any other role is looked up
# in pg_shadow through auth_user postgres, so tests can connect as roles they create).
# The upstream is PGBOUNCER_UPSTREAM_HOST:PGBOUNCER_UPSTREAM_PORT (default 127.0.0.1:5432).
set -euo pipefail

host=${PGBOUNCER_UPSTREAM_HOST:-127.0.0.1}
upstream=${PGBOUNCER_UPSTREAM_PORT:-5432}
db=${PGBOUNCER_DB:-test}

if ! command -v pgbouncer >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "pgbouncer is missing: installing Debian's package"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q pgbouncer >/dev/null
  else
    echo "pgbouncer is not installed (Debian/Ubuntu: apt-get install pgbouncer)" >&2
    exit 1
  fi
fi
# The package's own service, if the install started one, is not ours: leave it alone.

dir=$(mktemp -d "${TMPDIR:-/tmp}/txlimit-pgbouncer.XXXXXX")
pid=
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT

echo '"postgres" ""' > "$dir/users.txt"
[ "$(id -u)" = 0 ] && chown -R postgres "$dir"   # PgBouncer refuses to run as root

# A free port below the ephemeral range; another process may take it between the check and the
# bind, so a failed start is retried on another port.
port= up=
for _ in $(seq 10); do
  port=$((10000 + RANDOM % 20000))
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && continue
  cat > "$dir/pgbouncer.ini" <<INI
[databases]
* = host=$host port=$upstream

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
pool_mode = transaction
auth_type = trust
auth_file = $dir/users.txt
auth_user = postgres
max_client_conn = 400
default_pool_size = 10
max_db_connections = 20
server_idle_timeout = 10
ignore_startup_parameters = extra_float_digits
logfile = $dir/pgbouncer.log
INI
  # In the foreground of a background job, so that this shell stops and reaps it.
  if [ "$(id -u)" = 0 ]; then
    setpriv --reuid=postgres --regid=postgres --init-groups pgbouncer "$dir/pgbouncer.ini" 2>/dev/null &
  else
    pgbouncer "$dir/pgbouncer.ini" 2>/dev/null &
  fi
  pid=$!
  for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && { up=1; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  [ -n "$up" ] && break
  kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; pid=
done
[ -n "$up" ] || { echo "pgbouncer did not start:" >&2; cat "$dir/pgbouncer.log" >&2; exit 1; }

export TXLIMIT_PGBOUNCER_URL="postgres://postgres@127.0.0.1:$port/$db?sslmode=disable"
echo "== $(pgbouncer --version | head -n1) in transaction pooling mode on 127.0.0.1:$port -> $host:$upstream"
status=0
"$@" || status=$?
exit $status
