-- name: SearchPath :one
-- SearchPath is the connection's search_path, read only after a call failed on a missing txlimit
-- table or function, so that the error can say where Postgres looked.
SELECT current_setting('search_path')::text AS search_path;

-- name: SchemaVersion :one
-- SchemaVersion is the highest txlimit migration applied in the schema the search_path finds
-- txlimit_goose_version in (0 when none), the search_path itself, and which of the functions this
-- build's statements call the search_path does not find (missing, in the order listed: empty when
-- none). The list names every txlimit function the statements of this directory call;
-- TestSchemaVersionListsEveryFunctionCalled keeps it so. A schema migrated by a newer txlimit may
-- have dropped a function an older build calls (CONTRIBUTING.md: a function's old version is
-- dropped a release after its new one). A function counts when the search_path sees one of that
-- name, whatever its arguments (to_regproc would call a name with overloads missing).
SELECT coalesce(max(v.version_id), 0)::bigint AS version,
       current_setting('search_path')::text AS search_path,
       (SELECT coalesce(array_agg(f.name ORDER BY f.i), '{}')
        FROM unnest('{txlimit_clock,txlimit_credit_v1,txlimit_decide_one_v1,txlimit_decide_v1,txlimit_granted,txlimit_left,txlimit_level,txlimit_levels_v1,txlimit_next_ts,txlimit_pack_v1,txlimit_prunable,txlimit_reset_v1,txlimit_retry_at}'::text[])
             WITH ORDINALITY AS f(name, i)
        WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p
                          WHERE p.proname = f.name AND pg_catalog.pg_function_is_visible(p.oid)))::text[] AS missing
FROM txlimit_goose_version v
WHERE v.is_applied;
