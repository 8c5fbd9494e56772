"""The statements sqlc generated for pgx (internal/dbsqlc/engine.sql.go), for the shell scripts of
bench/ that send them without the Go client (callgrind.sh, pgbench-hot.sh)."""


def query(root, name):
    """The SQL of sqlc's statement const name, on one line, its leading "-- name:" line dropped."""
    src = open(f"{root}/internal/dbsqlc/engine.sql.go").read()
    q = src[src.index(f"const {name} = `") + len(f"const {name} = `"):]
    return " ".join(q[:q.index("`")].split("\n", 1)[1].split())


def params(root, name):
    """The field names of name's Params struct, in the order of its $n placeholders."""
    src = open(f"{root}/internal/dbsqlc/engine.sql.go").read()
    body = src[src.index(f"type {name[0].upper() + name[1:]}Params struct {{"):]
    return [l.split()[0] for l in body[:body.index("}")].splitlines()[1:] if l.strip()]
