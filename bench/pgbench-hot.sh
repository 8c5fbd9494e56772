#!/usr/bin/env bash
# pgbench-hot.sh [clients] [seconds]: one hot key decided by pgbench, without the Go client, on a
# scratch schema (txlimit_pgbench, dropped at the end) holding the migrations of this checkout:
#
#   floor   UPDATE of one row … RETURNING: the bench's floor
#   row     DecideOneRow (internal/dbsqlc/queries/engine.sql) on an unsharded limit
#   shards  DecideOne on a limit of 16 shards, the candidates in random order
#
# Each runs for seconds (default 8) with clients (default 64) on one key, prepared statements,
# track_functions on; it prints the transactions per second and how often the engine's functions
# ran (txlimit_await_shard: calls that found every candidate shard taken and waited; txlimit_decide_v1:
# calls that went on to the road for lists). docs/design-history.md quotes its figures. Needs
# pgbench and psql (Debian: postgresql-client) and the database of TEST_DATABASE_URL, else
# postgres://postgres@127.0.0.1:5432/test. Figures move by tens of percent from run to run on a
# shared machine: alternate runs to compare.
set -euo pipefail
clients=${1:-64}
secs=${2:-8}
root=$(git rev-parse --show-toplevel)
url=${TEST_DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}
tmp=$(mktemp -d)
schema=txlimit_pgbench
trap 'psql -q "$url" -c "DROP SCHEMA IF EXISTS $schema CASCADE" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT

{
	echo "SET client_min_messages = warning; DROP SCHEMA IF EXISTS $schema CASCADE; CREATE SCHEMA $schema; SET search_path = $schema;"
	for f in "$root"/migrations/0000*.sql; do sed -n '/+goose Up/,/+goose Down/p' "$f" | grep -v '^-- +goose'; done
	echo "INSERT INTO txlimit_state VALUES ('floor', 'hot', 0, 1e15, 0);"
} >"$tmp/schema.sql"
psql -q -v ON_ERROR_STOP=1 "$url" -f "$tmp/schema.sql" >/dev/null

python3 - "$root" "$tmp" <<'EOF'
import re, sys
root, tmp = sys.argv[1], sys.argv[2]
sys.path.insert(0, f"{root}/bench")
from sqlcquery import params, query
def bind(name, values):
    order = params(root, name)
    return re.sub(r"\$(\d+)", lambda m: values[order[int(m.group(1)) - 1]], query(root, name)) + ";\n"
common = {"NowUs": "NULL::bigint", "Key": "'hot'", "Count": "1", "Allow": "0", "StepUs": "1", "Rate": "1e9",
          "PeriodUs": "1000000", "Cap": "1e9", "AnchorUs": "0", "LockKey": "12345"}
open(f"{tmp}/row.sql", "w").write(bind("decideOneRow", {**common, "Name": "'row'", "QueueKey": "(12345 # 524288)"}))
open(f"{tmp}/shards.sql", "w").write(bind("decideOne", {**common, "Name": "'shards'", "Dry": "false",
    "Shards": "(SELECT array_agg(s ORDER BY random()) FROM generate_series(0, 15) s)::int[]"}))
open(f"{tmp}/floor.sql", "w").write("UPDATE txlimit_state SET value = value - 1 WHERE name = 'floor' AND key = 'hot' AND shard = 0 RETURNING value;\n")
EOF

export PGOPTIONS="-c search_path=$schema -c track_functions=all"
for w in floor row shards; do
	psql -qAt "$url" -c "SELECT pg_stat_reset()" >/dev/null
	tps=$(pgbench -n -M prepared -c "$clients" -j 2 -T "$secs" -f "$tmp/$w.sql" "$url" 2>&1 | grep -oP 'tps = \K[0-9]+' || echo "failed")
	sleep 0.6 # the statistics collector
	calls=$(psql -qAt "$url" -c "SELECT coalesce(string_agg(funcname || ' ' || calls, ', ' ORDER BY funcname), '') FROM pg_stat_user_functions WHERE schemaname = '$schema' AND funcname IN ('txlimit_decide_one_v1', 'txlimit_await_shard', 'txlimit_decide_v1')")
	printf '%-7s %6s tps, %d clients, %ds   %s\n' "$w" "$tps" "$clients" "$secs" "$calls"
done
