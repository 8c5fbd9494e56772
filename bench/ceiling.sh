#!/usr/bin/env bash
# ceiling.sh [rounds]: the HTTP cell with stand-ins for the engine's one-UPDATE road, the road a
# batch of calls on keys of their own takes (docs/batcher-throughput.md, "The HTTP cell with a
# database that does nothing: the ceiling"). Each round runs the HTTP cell three times, alternated:
#
#   as-is    the engine as committed;
#   minimal  the road's block replaced by one UPDATE of the batch's rows that changes nothing, then
#            every request answered granted: the rows are written and the commit flushes, but no
#            rule is evaluated;
#   nothing  the block replaced by the answer alone: nothing written, nothing flushed.
#
# The stand-ins are wrong on purpose and exist only in throwaway worktrees of HEAD; this checkout
# is not changed. Prints, per run, httplimit / redis_rate and both servers' CPU and idle figures.
set -euo pipefail
rounds=${1:-3}
root=$(git rev-parse --show-toplevel)
tmp=$(mktemp -d)
variants=(as-is minimal nothing)
cleanup() {
	for v in "${variants[@]}"; do git -C "$root" worktree remove --force "$tmp/$v" 2>/dev/null || true; done
	rm -rf "$tmp"
}
trap cleanup EXIT
for v in "${variants[@]}"; do git -C "$root" worktree add -q --detach "$tmp/$v" HEAD; done

python3 - "$tmp" <<'EOF'
import sys
tmp = sys.argv[1]
start = "            BEGIN\n                WITH w AS ("
end = "            EXCEPTION WHEN SQLSTATE 'TXLU0' THEN"
answer = """                RETURN QUERY
                SELECT true, false, false, 1::float8, p_cand_shard[q.i], -1, 1, 0::bigint, t_now
                FROM generate_series(1, n) AS q(i);
                RETURN;
"""
bodies = {
    "minimal": """            BEGIN
                UPDATE txlimit_state s SET value = s.value
                WHERE s.name = p_row_name[1] AND s.key = ANY(p_row_key) AND s.shard = 0;
""" + answer,
    "nothing": "            BEGIN\n" + answer,
}
for v, body in bodies.items():
    path = f"{tmp}/{v}/migrations/00001_txlimit_state.sql"
    sql = open(path).read()
    if sql.count(start) != 1 or sql.count(end) != 1:
        sys.exit("ceiling.sh: the one-UPDATE road's block is not where this script expects it")
    i, j = sql.index(start), sql.index(end)
    open(path, "w").write(sql[:i] + body + sql[j:])
EOF

for r in $(seq "$rounds"); do
	for v in "${variants[@]}"; do
		out=$(cd "$tmp/$v/bench" && go run . -quick -cell "${CELL:-4s}" -contenders http -md "$tmp/$v.md" -svg "$tmp/$v.svg" 2>&1 | grep '^\[http\]')
		b=$(grep httplimit <<<"$out")
		c=$(grep redis_rate <<<"$out")
		ratio=$(awk -v b="$(awk '{print $6}' <<<"$b")" -v c="$(awk '{print $5}' <<<"$c")" 'BEGIN { printf "%.2f", b / c }')
		echo "round $r  $v  httplimit/redis_rate $ratio | httplimit: $(grep -o 'CPU µs.*idle CPUs [0-9.]*' <<<"$b") | redis_rate: $(grep -o 'CPU µs.*idle CPUs [0-9.]*' <<<"$c")"
	done
done
