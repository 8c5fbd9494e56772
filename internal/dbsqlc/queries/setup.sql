-- name: SearchPath :one
-- SearchPath is the connection's search_path, read only after a call failed on a missing txlimit
-- table or function, so that the error can say where Postgres looked.
SELECT current_setting('search_path')::text AS search_path;

-- name: SchemaVersion :one
-- SchemaVersion is the highest txlimit migration applied in the schema the search_path finds
-- txlimit_goose_version in (0 when none), and the search_path itself.
SELECT coalesce(max(v.version_id), 0)::bigint AS version,
       current_setting('search_path')::text AS search_path
FROM txlimit_goose_version v
WHERE v.is_applied;
