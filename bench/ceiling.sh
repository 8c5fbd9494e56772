#!/usr/bin/env bash
# ceiling.sh [rounds]: the HTTP cell with stand-ins for txlimit_decide_v1's block for requests alone
# on their rows (migrations/00003_txlimit_decide.sql), which decides a batch of calls on keys of
# their own (docs/batcher-throughput.md, "The HTTP cell with a
# database that does nothing: the ceiling"). Each round runs the HTTP cell three times, alternated:
#
#   as-is    the engine as committed;
#   minimal  the block replaced by one UPDATE of the batch's rows that changes nothing, then
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
start = "    IF p_fast && '{true}'::boolean[] THEN\n"
end = "    -- 1. Plan:"
answer = """    RETURN QUERY
    SELECT q.i, txlimit_pack_v1(true, false, false, 1, p_row_shard[p_row_a[q.i]], -1, 1, 0, t, t)
    FROM generate_series(1, n) AS q(i);
    RETURN;
"""
bodies = {
    "minimal": """    UPDATE txlimit_state s SET value = s.value
    WHERE s.name = p_row_name[1] AND s.key = ANY(p_row_key) AND s.shard = 0;
""" + answer,
    "nothing": answer,
}
for v, body in bodies.items():
    path = f"{tmp}/{v}/migrations/00003_txlimit_decide.sql"
    sql = open(path).read()
    if sql.count(start) != 1 or sql.count(end) != 1:
        sys.exit("ceiling.sh: txlimit_decide_v1's block for lone requests is not where this script expects it")
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
