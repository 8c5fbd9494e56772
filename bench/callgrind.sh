#!/usr/bin/env bash
# callgrind.sh [N]: the backend's instructions per decision, counted by valgrind's callgrind in a
# single-user Postgres backend (no network, no other sessions: the count is the same from run to
# run, whatever the machine's load), for nine statements on the schema of migrations/:
#
#   floor       UPDATE txlimit_state SET value = value - 1 … RETURNING value: the bench's floor
#   decide-one  DecideOneRow (internal/dbsqlc/queries/engine.sql) granting a lone Limit, prepared
#               with its 12 typed parameters, generic plan
#   one-deny    DecideOneRow refusing a lone Limit (its UPDATE writes nothing; txlimit_decide_one_v1
#               answers)
#   one-shard   DecideOne granting a lone Limit on a limit of 16 shards (READ COMMITTED)
#   one-shard-ser  the same under SERIALIZABLE (steering checks its shard for staleness; the
#               second pick is read only when the first cannot serve alone)
#   list-grant  txlimit_decide_v1 over 32 requests on keys of their own, all granted
#   list-deny   the same 32 requests, all refused (rows emptied until 2096)
#   list-debts  32 requests refused on rows each owing its own amount (-0.037·i, until 2096): a
#               RetryAt search each, some of whose estimates float8 rounding puts a microsecond off
#   list-mixed  32 requests on keys of their own, every other one refused (a Batcher's batch on a
#               deny-heavy limit of many keys)
#
# Each figure is (instructions of a session running N statements − those of a session running
# none) / N. The single-user harness adds its own cost per statement (parsing EXECUTE and its
# literal arguments), which the column "net" takes away: it subtracts what the same EXECUTE of a
# statement doing nothing costs (floor: one text argument; DecideOneRow: its 12; DecideOne: its
# 13; the lists' literal arrays are not taken away). Compare figures with each other, not with
# the CPU time the bench measures. The first execution plans the statement, so a small N counts
# part of the planning in every figure. Needs valgrind and the Postgres 15 server binaries
# (Debian: postgresql-15, valgrind); runs as the postgres user in a throwaway data dir.
#
# KEEP=DIR keeps callgrind's output of each session there (out.MODE.N), for
# `callgrind_annotate --inclusive=yes DIR/out.one-shard.N` (where a statement's instructions go);
# MODES="a b" counts only those modes.
#
# VARIANTS=DIR also counts each DIR/NAME.prep with DIR/NAME.stmt, net of DecideOneRow's harness:
# NAME.prep holds what runs before the statements (for example CREATE OR REPLACE FUNCTION of a
# changed body, then a PREPARE d(…) AS …, one statement per line), NAME.stmt the EXECUTE d(…) line,
# KEY standing for a key k1 … k64. docs/design-history.md measured statement variants this way.
set -euo pipefail
shopt -s inherit_errexit # a failed count stops the script, not just its $(…)
N=${1:-200}
root=$(git rev-parse --show-toplevel)
bin=${PGBIN:-/usr/lib/postgresql/15/bin}
tmp=$(mktemp -d)
chown postgres "$tmp"
trap 'su postgres -c "$bin/pg_ctl -D $tmp/data -m immediate stop" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
as_pg() { su postgres -c "$1"; }

as_pg "$bin/initdb -D $tmp/data -A trust >/dev/null"
as_pg "$bin/pg_ctl -D $tmp/data -o '-p 5498 -c fsync=off -c listen_addresses= -c unix_socket_directories=$tmp' -l $tmp/log -w start >/dev/null"
for f in "$root"/migrations/0000*.sql; do sed -n '/+goose Up/,/+goose Down/p' "$f" | grep -v '^-- +goose'; done >"$tmp/schema.sql"
cat >>"$tmp/schema.sql" <<'EOF'
INSERT INTO txlimit_state SELECT n, 'k' || i, 0, 1e9, 0 FROM generate_series(1, 64) i, unnest(ARRAY['allow', 'floor']) n;
INSERT INTO txlimit_state SELECT 'deny', 'k' || i, 0, 0, 4000000000000000 FROM generate_series(1, 64) i;
INSERT INTO txlimit_state SELECT 'debts', 'k' || i, 0, -i * 0.037, 4000000000000000 FROM generate_series(1, 64) i;
INSERT INTO txlimit_state SELECT 'shard', 'k' || i, s, 1e9, 0 FROM generate_series(1, 64) i, generate_series(0, 15) s;
EOF
psql -q -h "$tmp" -p 5498 -U postgres -v ON_ERROR_STOP=1 -f "$tmp/schema.sql" postgres >/dev/null
as_pg "$bin/pg_ctl -D $tmp/data -w stop >/dev/null"

python3 - "$root" "$tmp" <<'EOF'
import sys
root, tmp = sys.argv[1], sys.argv[2]
sys.path.insert(0, f"{root}/bench")
from sqlcquery import query
row_types = "bigint, text, text, float8, float8, bigint, float8, bigint, float8, bigint, bigint, bigint"
one_types = "bigint, text, text, float8, float8, bool, bigint, float8, bigint, float8, bigint, int[], bigint"
def one(mode, types, body, args):
    open(f"{tmp}/{mode}.prep", "w").write(f"SET plan_cache_mode = force_generic_plan\nPREPARE d({types}) AS {body}\n")
    open(f"{tmp}/{mode}.stmt", "w").write(f"EXECUTE d({args})\n")
row, one_q = query(root, "decideOneRow"), query(root, "decideOne")
one("decide-one", row_types, row, "NULL, 'allow', 'KEY', 1, 0, 1, 1e9, 1000000, 1e9, 0, 12345, 12345")
one("one-deny", row_types, row, "NULL, 'deny', 'KEY', 1, 0, 100000, 10, 1000000, 10, 0, 12345, 12345")
one("one-shard", one_types, one_q, "NULL, 'shard', 'KEY', 1, 0, false, 1, 1e9, 1000000, 1e9, 0, '{3,9,0,1,2,4,5,6,7,8,10,11,12,13,14,15}', 12345")
open(f"{tmp}/one-shard-ser.prep", "w").write("SET default_transaction_isolation = 'serializable'\n" + open(f"{tmp}/one-shard.prep").read())
open(f"{tmp}/one-shard-ser.stmt", "w").write(open(f"{tmp}/one-shard.stmt").read())
one("harness12", row_types, "SELECT $10", "NULL, 'allow', 'KEY', 1, 0, 1, 1e9, 1000000, 1e9, 0, 12345, 12345")
one("harness13", one_types, "SELECT $13", "NULL, 'shard', 'KEY', 1, 0, false, 1, 1e9, 1000000, 1e9, 0, '{3,9,0,1,2,4,5,6,7,8,10,11,12,13,14,15}', 12345")
open(f"{tmp}/floor.prep", "w").write("PREPARE d(text) AS UPDATE txlimit_state SET value = value - 1 WHERE name = 'floor' AND key = $1 AND shard = 0 RETURNING value\n")
open(f"{tmp}/floor.stmt", "w").write("EXECUTE d('KEY')\n")
open(f"{tmp}/harness1.prep", "w").write("PREPARE d(text) AS SELECT $1\n")
open(f"{tmp}/harness1.stmt", "w").write("EXECUTE d('KEY')\n")
n = 32
def arr(xs, t): return "'{" + ",".join(map(str, xs)) + "}'::" + t
def lst(name, rate, cap):
    return ("SELECT count(*) FROM txlimit_decide_v1(NULL, " + ", ".join([
        arr(range(n), "int[]"), arr([1] * n, "float8[]"), arr([0] * n, "float8[]"), arr(["f"] * n, "bool[]"),
        arr(["t"] * n, "bool[]"), arr([1] * n, "bigint[]"), arr([rate] * n, "float8[]"),
        arr([1000000] * n, "bigint[]"), arr([cap] * n, "float8[]"), arr([0] * n, "bigint[]"),
        arr(range(1, n + 1), "int[]"), arr([0] * n, "int[]"), arr([name] * n, "text[]"),
        arr([f"k{i}" for i in range(1, n + 1)], "text[]"), arr([0] * n, "int[]")]) + ", 0)\n")
mixed = ("SELECT count(*) FROM txlimit_decide_v1(NULL, " + ", ".join([
    arr(range(n), "int[]"), arr([1] * n, "float8[]"), arr([0] * n, "float8[]"), arr(["f"] * n, "bool[]"),
    arr(["t"] * n, "bool[]"), arr([1] * n, "bigint[]"), arr([1e9, 10] * (n // 2), "float8[]"),
    arr([1000000] * n, "bigint[]"), arr([1e9, 10] * (n // 2), "float8[]"), arr([0] * n, "bigint[]"),
    arr([x for j in range(1, n // 2 + 1) for x in (j, n // 2 + j)], "int[]"), arr([0] * n, "int[]"),
    arr(["allow"] * (n // 2) + ["deny"] * (n // 2), "text[]"),
    arr([f"k{j}" for j in range(1, n // 2 + 1)] * 2, "text[]"), arr([0] * n, "int[]")]) + ", 0)\n")
for mode, stmt in (("list-grant", lst("allow", 1e9, 1e9)), ("list-deny", lst("deny", 10, 10)),
                   ("list-debts", lst("debts", 10, 10)), ("list-mixed", mixed)):
    open(f"{tmp}/{mode}.prep", "w").write("SELECT 1\n")
    open(f"{tmp}/{mode}.stmt", "w").write(stmt)
EOF

count() { # count MODE STATEMENTS: the session's instructions
	local mode=$1 n=$2 in=$tmp/$1.$2.sql
	cp "$tmp/$mode.prep" "$in"
	for i in $(seq 1 "$n"); do sed "s/KEY/k$(((i % 64) + 1))/" "$tmp/$mode.stmt" >>"$in"; done
	chmod 644 "$in"
	as_pg "valgrind --tool=callgrind --callgrind-out-file=$tmp/out.$mode.$n $bin/postgres --single -D $tmp/data -c fsync=off postgres <$in >$tmp/single.$mode.$n.log 2>&1"
	if grep -q ERROR "$tmp/single.$mode.$n.log"; then grep -m1 ERROR "$tmp/single.$mode.$n.log" >&2; exit 1; fi
	if [[ -n ${KEEP:-} ]]; then mkdir -p "$KEEP" && cp "$tmp/out.$mode.$n" "$KEEP/"; fi
	callgrind_annotate "$tmp/out.$mode.$n" 2>/dev/null | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }'
}
per() { # per MODE STATEMENTS: instructions per statement
	local a b
	a=$(count "$1" 0)
	b=$(count "$1" "$2")
	echo $(((b - a) / $2))
}
h1=$(per harness1 "$N")
h12=$(per harness12 "$N")
h13=$(per harness13 "$N")
printf '%-14s %10s %10s\n' statement instructions net
for mode in ${MODES:-floor decide-one one-deny one-shard one-shard-ser list-grant list-deny list-debts list-mixed}; do
	n=$N h=$h12
	[[ $mode == floor ]] && h=$h1
	[[ $mode == one-shard* ]] && h=$h13
	[[ $mode == list-* ]] && n=$((N / 4)) h=0
	i=$(per "$mode" "$n")
	printf '%-14s %10d %10d   (%d statements)\n' "$mode" "$i" $((i - h)) "$n"
done
for f in ${VARIANTS:+"$VARIANTS"/*.prep}; do
	mode=variant-$(basename "$f" .prep)
	{ echo "SET plan_cache_mode = force_generic_plan"; cat "$f"; } >"$tmp/$mode.prep"
	cp "${f%.prep}.stmt" "$tmp/$mode.stmt"
	i=$(per "$mode" "$N")
	printf '%-14s %10d %10d   (%d statements)\n' "$mode" "$i" $((i - h12)) "$N"
done
